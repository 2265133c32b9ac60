"""A torch.distributed.pipelining-style API whose schedule loop is the C runner.

What this is: `PipelineStage` (a stage's module, its index and the pipeline's size) and schedule
classes with torch's constructor and `step()`:

    stage = zbpp.PipelineStage(module, stage_index, num_stages, device)
    schedule = zbpp.ScheduleZBVZeroBubble([stage_a, stage_b], n_microbatches, loss_fn=loss_fn)
    schedule.step(x)                              # first stage (rank 0)
    schedule.step(target=y, losses=losses)        # the loss stage (rank 0 for V schedules)
    schedule.step()                               # every other rank

so a script written for torch.distributed.pipelining runs with `import zbpp as pipelining`-style
changes only. Python supplies each stage's forward and backward (callbacks from the C runner);
the op order, the transfers, W and the measured times are C's. Semantics follow torch's: the batch
is split into n_microbatches along dim 0, `losses` receives each microbatch's loss, the loss stage
returns the merged output, and gradients are averaged over the microbatches (scale_grads=True).

Boundary shapes: the first step runs microbatch 0 forward through the stages once, without
gradients, to learn the shape and dtype of every activation; they must stay the same afterwards.

Subclassing (the Megatron adapter does): override _first_inputs, _run_stage, _compute_loss and
_loss_backward, fill _meta and set _meta_given to skip shape inference, and call _run_iteration();
these names are the adapter interface and stay stable.

CUDA: stages on a GPU (all of a rank's on one device) run on that device's CUDA backend, on
torch's current stream (set before every step, so the runner's copies, the W GEMMs and the model
share one stream order). The callbacks see the runner's device buffers as CUDA tensors (no host
copies). With several ranks the activations travel over the library's NCCL transport, made from a
unique id that rank 0 broadcasts; the optimizer's post-validation messages (host memory) keep using
the torch.distributed callback transport over a group that takes CPU tensors (gloo). See cuda.py.

What this is not: a tracer or a model splitter. Each rank builds its own stage modules.
"""

import contextlib
import ctypes

import torch
import torch.distributed as dist

from . import _lib, cuda, distributed, runtime
from .distributed import TorchTransport, group_rank, group_size
from .schedule import Schedule
from .split import default_store

__all__ = [
    "PipelineStage",
    "PipelineSchedule",
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleZBH1",
    "ScheduleZBH2",
    "ScheduleZBVZeroBubble",
    "ScheduleZBV",
    "ScheduleVHalf",
    "ScheduleVMin",
    "ScheduleZBAuto",
    "ScheduleInterleavedZeroBubble",
    "ScheduleFromCSV",
    "get_schedule_class",
]

_V_KINDS = ("zb-v", "v-half", "v-min")
_META_TAG = 1 << 20  # shape inference messages; the runner's channels use small tags
_META_LEN = 64
_ALIGN = 16
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]


class PipelineStage:
    """One stage of the pipeline on this rank (torch.distributed.pipelining.PipelineStage's shape).

    submodule: the layers of this stage; stage_index in [0, num_stages); device: where its tensors
    live ("cpu", or a CUDA device: one GPU per rank, all of a rank's stages on it); group: the
    pipeline's process group (None: the default group, or a single process when torch.distributed
    is not initialised).
    input_args/output_args are accepted for compatibility; shapes are inferred at the first step.
    """

    def __init__(self, submodule, stage_index, num_stages, device=None, input_args=None, output_args=None,
                 group=None, dw_builder=None):
        if not isinstance(submodule, torch.nn.Module):
            raise TypeError(f"zbpp.PipelineStage: submodule must be a torch.nn.Module, got {type(submodule).__name__}")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"zbpp.PipelineStage: num_stages must be an int >= 1, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"zbpp.PipelineStage: stage_index {stage_index!r} is out of range; "
                             f"it must be in [0, {num_stages - 1}] for num_stages={num_stages}")
        if dw_builder is not None:
            raise ValueError("zbpp.PipelineStage: dw_builder is not used; call zbpp.split_linear(module) "
                             "to split the backward of its Linear layers")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        try:
            self.device = cuda.device_of(device)
        except ValueError as exc:
            raise ValueError(f"zbpp.PipelineStage: {str(exc).replace('zbpp: ', '', 1)}") from None
        self.group = group
        self.group_rank = group_rank(group)
        self.group_size = group_size(group)
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1

    def __repr__(self):
        return f"<zbpp.PipelineStage {self.stage_index}/{self.num_stages} on rank {self.group_rank}>"


# ---- packing activations into the runner's boundary buffers ----------------------------------------

def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _meta_of(tensors, stage):
    meta = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"zbpp: stage {stage} must return tensors (or a tuple of them) to pass to "
                            f"the next stage; got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"zbpp: stage {stage} returns a {t.dtype} tensor; allowed: "
                            + ", ".join(str(d) for d in _DTYPES))
        meta.append((t.dtype, tuple(t.shape)))
    return meta


def _layout(meta):
    """Byte offsets of each tensor in a boundary buffer and its total size."""
    offsets, size = [], 0
    for dtype, shape in meta:
        size = (size + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets.append(size)
        n = 1
        for d in shape:
            n *= d
        size += n * torch.empty((), dtype=dtype).element_size()
    return offsets, size


def _buffer(addr, nbytes):
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)


def _views(addr, meta):
    return _typed(_buffer(addr, _layout(meta)[1]), meta)


def _typed(raw, meta):
    """Typed, shaped views of a uint8 buffer laid out by _layout."""
    offsets, _ = _layout(meta)
    out = []
    for (dtype, shape), off in zip(meta, offsets):
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        out.append(raw[off:off + nbytes].view(dtype).view(shape))
    return out


def _encode(meta):
    enc = [len(meta)]
    for dtype, shape in meta:
        enc += [_DTYPES.index(dtype), len(shape), *shape]
    if len(enc) > _META_LEN:
        raise ValueError(f"zbpp: a stage output with {len(meta)} tensors is too large to describe "
                         f"(at most {_META_LEN} numbers of metadata)")
    return torch.tensor(enc + [0] * (_META_LEN - len(enc)), dtype=torch.int64)


def _decode(t):
    v = t.tolist()
    n, k, meta = v[0], 1, []
    for _ in range(n):
        dtype, ndim = _DTYPES[v[k]], v[k + 1]
        meta.append((dtype, tuple(v[k + 2:k + 2 + ndim])))
        k += 2 + ndim
    return meta


def _split(value, m, what):
    """Splits a tensor (dim 0) or a tuple/list/dict of them into m microbatches; other values are
    handed to every microbatch unchanged."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % m != 0:
            size = "a scalar" if value.dim() == 0 else f"batch size {value.shape[0]}"
            raise ValueError(f"zbpp: {what} has {size}, which does not split into n_microbatches={m} "
                             f"equal microbatches along dim 0; make the batch a multiple of {m}")
        return list(value.chunk(m, dim=0))
    if isinstance(value, (tuple, list)):
        parts = [_split(v, m, f"{what}[{i}]") for i, v in enumerate(value)]
        return [type(value)(p[i] for p in parts) for i in range(m)]
    if isinstance(value, dict):
        parts = {k: _split(v, m, f"{what}[{k!r}]") for k, v in value.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(m)]
    return [value] * m


# ---- the schedules ---------------------------------------------------------------------------------

class PipelineSchedule:
    """Base class: a zbpp schedule kind run by the C runner over this rank's stages.

    Subclasses fix `kind`. Extra keyword arguments beyond torch's: mem_limit (zb-auto's memory limit,
    in microbatches of a rank's activations, or a string such as "2p"), times (per-rank F/B/W costs
    for zb-auto, see zbpp.Schedule.generate), timeout (seconds one transfer may take before the step
    fails naming the peer; default 300), csv (a schedule in torch's CSV grammar instead of a kind),
    cpu_group (CUDA stages only: a gloo group over the pipeline's ranks for host-memory messages,
    needed when `group` is a non-gloo subgroup of the world; by default the group itself when it
    takes CPU tensors, else a gloo group made over the whole world).
    """

    kind = None

    def __init__(self, stage_or_stages, n_microbatches, loss_fn=None, args_chunk_spec=None,
                 kwargs_chunk_spec=None, output_merge_spec=None, scale_grads=True, *, kind=None,
                 csv=None, mem_limit=None, times=None, timeout=300.0, cpu_group=None):
        stages = list(stage_or_stages) if isinstance(stage_or_stages, (list, tuple)) else [stage_or_stages]
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"zbpp.{type(self).__name__}: expected a zbpp.PipelineStage or a list of them")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"zbpp.{type(self).__name__}: n_microbatches must be an int >= 1, got {n_microbatches!r}")
        if args_chunk_spec or kwargs_chunk_spec or output_merge_spec:
            raise NotImplementedError("zbpp: chunk and merge specs are not supported; batches split "
                                      "along dim 0, as torch's default does")
        first = stages[0]
        S, group = first.num_stages, first.group
        for s in stages:
            if s.num_stages != S or s.group is not group:
                raise ValueError(f"zbpp.{type(self).__name__}: all stages of a rank must share num_stages "
                                 "and group")
            if s.device != first.device:
                raise ValueError(f"zbpp.{type(self).__name__}: all stages of a rank must be on one device (one "
                                 f"runner, one stream); got {first.device} and {s.device}")
        self.device = first.device
        self._cuda = self.device.type == "cuda"
        self._cpu_group_given = cpu_group
        self.stages = sorted(stages, key=lambda s: s.stage_index)
        self.n_microbatches = m = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.group = group
        self.rank = first.group_rank
        self.ranks = p = first.group_size
        self.timeout = float(timeout)
        if S % p:
            raise ValueError(f"zbpp.{type(self).__name__}: num_stages={S} is not a multiple of the "
                             f"pipeline's {p} ranks")
        v = S // p
        kind = kind or self.kind
        if csv is None and _kind_name(kind) in _V_KINDS and v != 2:
            raise ValueError(f"zbpp.{type(self).__name__}: {_kind_name(kind)} is a V schedule: each rank holds 2 "
                             f"stages (rank r holds stages r and 2p-1-r), but num_stages={S} over {p} "
                             f"rank(s) gives {v} stage(s) per rank; build 2 PipelineStages per rank with "
                             f"num_stages={2 * p}")
        if csv is not None:
            self.schedule = Schedule.from_csv(csv, times=times, mem_limit=mem_limit)
            info = (self.schedule.ranks, self.schedule.stages, self.schedule.microbatches)
            if info != (p, S, m):
                raise ValueError(f"zbpp: the CSV schedule has {info[0]} ranks, {info[1]} stages and {info[2]} "
                                 f"microbatches; this pipeline has {p}, {S} and n_microbatches={m}")
            self.schedule.validate()
        else:
            self.schedule = Schedule.generate(kind, p=p, m=m, v=v, times=times, mem_limit=mem_limit)
        mine = [s.stage_index for s in self.stages]
        want = self.schedule.rank_stages(self.rank)
        if mine != want:
            placement = self.schedule.placement
            hint = (f"a V schedule needs 2 stages per rank: rank r holds stages r and {2 * p - 1}-r"
                    if placement == "v" else
                    f"a loop schedule puts stage s on rank s mod {p}")
            raise ValueError(f"zbpp.{type(self).__name__} ({self.schedule.kind}): rank {self.rank} was given "
                             f"stage(s) {mine} but the schedule puts {want} on it; {hint} "
                             f"(num_stages={S}, {p} ranks, {v} stage(s) per rank)")
        self.loss_stage = S - 1
        self.holds_loss = self.loss_stage in mine
        self.holds_first = 0 in mine
        self._by_index = {s.stage_index: s for s in self.stages}
        self._meta = {}       # boundary b -> [(dtype, shape)] of the activation from stage b to b+1
        self._meta_given = False  # a subclass that knows the shapes fills _meta and sets this
        self._runner = None
        self._transport = None
        self._nccl = None
        self._store = default_store(self.device if self._cuda else None)
        self._dviews = cuda.DeviceViews(self.device) if self._cuda else None
        self._msg = None  # (group, device) of shape inference and the NCCL unique id; see _messages
        self._last_times = None
        self.steps = 0

    # ---- shape inference -------------------------------------------------------------------------

    def _holder(self, stage):
        return self.schedule.stage_rank(stage)

    def _infer_shapes(self):
        """Runs microbatch 0 forward through every stage once, in stage order, without gradients,
        passing the real activations on, so every rank learns its boundaries' shapes."""
        S = self.stages[0].num_stages
        # The extra forward must not move the random streams (dropout): the first step then draws
        # the same numbers as a run without inference would.
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self._cuda else None
        try:
            self._infer_loop(S)
        finally:
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)

    def _infer_loop(self, S):
        carry = None
        for s in range(S):
            holder = self._holder(s)
            if holder != self.rank:
                carry = None
                continue
            if s == 0:
                inputs, kwargs = self._first_inputs(0)
            else:
                prev = self._holder(s - 1)
                if prev == self.rank:
                    inputs = carry
                else:
                    meta_t = torch.zeros(_META_LEN, dtype=torch.int64)
                    self._recv(meta_t, prev)
                    meta = _decode(meta_t)
                    inputs = tuple(torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in meta)
                    for t in inputs:
                        self._recv(t, prev)
                    self._meta[s - 1] = meta
                kwargs = {}
            if s == S - 1:
                break
            with torch.no_grad():
                out = _as_tuple(self._run_stage(s, 0, inputs, kwargs))
            meta = _meta_of(out, s)
            self._meta[s] = meta
            nxt = self._holder(s + 1)
            if nxt == self.rank:
                carry = tuple(t.detach() for t in out)
            else:
                self._send(_encode(meta), nxt)
                for t in out:
                    self._send(t.detach().contiguous(), nxt)

    def _messages(self):
        """Where the set-up messages go: CPU tensors over the pipeline's group when it takes them
        (gloo), else over the gloo group of cpu_group= or one made over the world (when the pipeline
        is the whole world; a collective, made at the first step, where every rank is); a
        non-gloo subgroup without cpu_group= gets device tensors over itself (NCCL), since making a
        gloo group over part of the world needs every process of the world."""
        if self._msg is None:
            cpu = torch.device("cpu")
            if not self._cuda or self.ranks == 1 or distributed.takes_cpu(self.group):
                self._msg = (self.group, cpu)
            elif self._cpu_group_given is not None:
                self._msg = (self._cpu_group_given, cpu)
            elif dist.get_world_size(self.group) == dist.get_world_size():
                self._msg = (distributed.cpu_group(self.group), cpu)
            else:
                self._msg = (self.group, self.device)
        return self._msg

    def _send(self, t, rank):
        group, device = self._messages()
        dist.send(t.to(device), dst=_global(self.group, rank), group=group, tag=_META_TAG)

    def _recv(self, t, rank):
        group, device = self._messages()
        buf = t if t.device == device else torch.empty_like(t, device=device)
        dist.recv(buf, src=_global(self.group, rank), group=group, tag=_META_TAG)
        if buf is not t:
            t.copy_(buf)

    # ---- the runner's callbacks ------------------------------------------------------------------

    # Hooks a subclass (the Megatron adapter) overrides: where stage 0's inputs come from, how a
    # stage runs, and how the loss is computed and differentiated.

    def _first_inputs(self, i):
        return self._mb_args[i], self._mb_kwargs[i]

    def _run_stage(self, s, i, inputs, kwargs):
        return self._by_index[s].submod(*inputs, **kwargs)

    def _compute_loss(self, i, out):
        if self._loss_fn is None:
            raise ValueError("zbpp: the loss stage has no loss_fn; pass loss_fn=... to the "
                             "schedule on the rank holding the last stage")
        loss = self._loss_fn(out, self._mb_target[i])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("zbpp: loss_fn must return a tensor with one element")
        self._outputs[i] = out.detach() if isinstance(out, torch.Tensor) else out
        self._losses[i] = loss.detach()
        return loss

    def _loss_backward(self, loss):
        loss.backward()

    def _forward(self, s, i, in_addr, out_addr):
        if s == 0:
            inputs, kwargs = self._first_inputs(i)
        else:
            inputs = []
            for t in self._views(in_addr, s - 1):
                t = t.clone()
                if t.is_floating_point():
                    t.requires_grad_(True)
                inputs.append(t)
            inputs, kwargs = tuple(inputs), {}
        with torch.enable_grad():
            out = self._run_stage(s, i, inputs, kwargs)
            if s == self.loss_stage:
                self._ctx[(s, i)] = (inputs, None, self._compute_loss(i, out))
                return
        outs = _as_tuple(out)
        meta = self._meta[s]
        if _meta_of(outs, s) != meta:
            raise ValueError(f"zbpp: stage {s} returned {[(str(d), sh) for d, sh in _meta_of(outs, s)]} for "
                             f"microbatch {i}, but the boundary was set up for "
                             f"{[(str(d), sh) for d, sh in meta]}; shapes must not change")
        for view, t in zip(self._views(out_addr, s), outs):
            view.copy_(t.detach())
        self._ctx[(s, i)] = (inputs, outs, None)

    def _views(self, addr, boundary):
        """Typed tensors over a runner buffer of `boundary` (host memory, or device memory wrapped
        as CUDA tensors: every copy in and out then runs on torch's current stream, the runner's
        compute stream)."""
        meta = self._meta[boundary]
        if self._dviews is None:
            return _views(addr, meta)
        dv = self._dviews
        return dv.get(addr, boundary, lambda a: _typed(dv.buffer(a, _layout(meta)[1]), meta))

    def _backward(self, s, i, gout_addr, gin_addr):
        inputs, outs, loss = self._ctx.pop((s, i))
        store = self._store
        store.capturing = True
        try:
            if loss is not None:
                self._loss_backward(loss)
            else:
                pairs = [(o, g) for o, g in zip(outs, self._views(gout_addr, s))
                         if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g.clone() for _, g in pairs])
        finally:
            store.capturing = False
        if s > 0:
            for view, x in zip(self._views(gin_addr, s - 1), inputs):
                if x.grad is not None:
                    view.copy_(x.grad)
                else:
                    view.zero_()

    # ---- step --------------------------------------------------------------------------------------

    def step(self, *args, target=None, losses=None, **kwargs):
        """One iteration of the pipeline: every rank calls it (inputs on the first stage's rank,
        target and losses on the loss stage's rank). Returns the merged output of the last stage
        on its rank, None elsewhere. Gradients accumulate into .grad (or main_grad)."""
        m = self.n_microbatches
        if self.holds_first:
            if not args and not kwargs:
                raise ValueError("zbpp: step() on the rank holding stage 0 needs the batch as arguments")
            self._mb_args = [tuple(a) for a in _split(tuple(args), m, "the input")]
            self._mb_kwargs = _split(dict(kwargs), m, "the keyword input")
        elif args or kwargs:
            raise ValueError(f"zbpp: rank {self.rank} does not hold stage 0; call step() without inputs "
                             "there (targets go to the loss stage's rank)")
        if self.holds_loss:
            if self._loss_fn is None:
                raise ValueError(f"zbpp: rank {self.rank} holds the loss stage ({self.loss_stage}) but the "
                                 "schedule has no loss_fn; pass loss_fn=... when constructing it")
            if target is None:
                raise ValueError(f"zbpp: rank {self.rank} holds the loss stage; pass target=... to step()")
            self._mb_target = _split(target, m, "the target")
        try:
            self._run_iteration()
        finally:
            self._mb_args = self._mb_kwargs = self._mb_target = None
        if self.scale_grads:
            self._scale_grads(m)
        if self.holds_loss:
            if losses is not None:
                losses.extend(self._losses)
            outs = self._outputs
            self._outputs = self._losses = None
            if all(isinstance(o, torch.Tensor) for o in outs):
                return torch.cat([o if o.dim() else o.reshape(1) for o in outs])
            return outs
        return None

    def _run_iteration(self):
        """Runs this rank's op list once (the runner calls _forward/_backward)."""
        m = self.n_microbatches
        with self._device_scope():
            if self._runner is None:
                self._start()
            self._ctx, self._outputs, self._losses = {}, [None] * m, [None] * m
            if self._cuda:
                # The runner's copies and W GEMMs go on torch's current stream, the stream the
                # callbacks' torch work lands on, so one stream order covers all of it.
                self._store.prepare_run()
            extra = self._transport.take_error if self._transport is not None and not self._cuda else None
            try:
                self._runner.run(extra_error=extra)
            finally:
                self._ctx = {}
        self._last_times = self._runner.times()
        self.steps += 1

    def _scale_grads(self, divisor):
        """Divides the gradients by the number of microbatches, as torch's scale_grads does (a
        division, not a multiplication by 1/m, so the bits match torch's)."""
        for st in self.stages:
            for prm in st.submod.parameters():
                if prm.grad is not None:
                    prm.grad.div_(divisor)
                main = getattr(prm, "main_grad", None)
                if main is not None:
                    main.div_(divisor)

    @property
    def transport(self):
        """This rank's transport over torch.distributed (None with one rank); the optimizer's
        post-validation shares it (on channels of its own). CPU stages: the runner's transport too.
        CUDA stages: host messages only, over a group that takes CPU tensors (cpu_group); on first
        use every rank must ask for it, since making a gloo group is a collective."""
        if self._transport is None and self.ranks > 1:
            group = self.group
            if self._cuda:
                group = self._cpu_group_given
                if group is None:
                    group = distributed.cpu_group(self.group)
            self._transport = TorchTransport(group, self.timeout)
        return self._transport

    def _device_scope(self):
        return torch.cuda.device(self.device) if self._cuda else contextlib.nullcontext()

    def _start(self):
        if not self._cuda:
            self.transport  # noqa: B018 - created here at the latest: it is the runner's
        if not self._meta_given:
            self._infer_shapes()
        S = self.stages[0].num_stages
        sizes = [(_layout(self._meta[b])[1] if b in self._meta else 0) for b in range(S - 1)]
        if self._cuda:
            if self.ranks > 1 and self._nccl is None:
                self._nccl = self._make_nccl()
            transport = self._nccl
        else:
            transport = self._transport.transport if self._transport else None
        self._runner = runtime.Runner(self.schedule, self.rank, self._store.backend, self._store.store,
                                      transport, sizes, self._forward, self._backward, timeout_s=self.timeout)

    def _make_nccl(self):
        """The NCCL transport: rank 0 makes the unique id and sends it to every rank (with a flag,
        so that a rank 0 that failed makes the others fail at once instead of at their timeout)."""
        uid, failure = bytes(runtime.NCCL_UNIQUE_ID_BYTES), None
        if self.rank == 0:
            try:
                uid = runtime.nccl_unique_id()
            except _lib.ZbError as exc:
                failure = exc
        group, device = self._messages()
        got = distributed.broadcast_bytes(bytes([failure is None]) + uid, _global(self.group, 0), group, device)
        if failure is not None:
            raise failure
        if got[0] != 1:
            raise _lib.ZbError(runtime.ZB_ERR_REMOTE, f"rank {self.rank}: pipeline rank 0 could not make an NCCL "
                                                      "unique id (its error says why)")
        return runtime.Transport.nccl(self.rank, self.ranks, got[1:], self._store.backend, self.schedule,
                                      timeout=self.timeout)

    # ---- measured timeline -----------------------------------------------------------------------

    def timeline(self):
        """The last step's measured op times of every rank as a zbpp.Schedule (set_times applied),
        for .to_svg(), .to_chrome() and .simulate()-style figures; a collective: every rank calls
        it, every rank gets the same result. Clocks are CLOCK_MONOTONIC, so the ranks must share a
        host (as with CPU runs over gloo)."""
        if self._last_times is None:
            raise RuntimeError("zbpp: timeline() needs a finished step()")
        mine = self._last_times
        if self.ranks > 1:
            gathered = [None] * self.ranks
            dist.all_gather_object(gathered, mine, group=self.group)
        else:
            gathered = [mine]
        copy = Schedule.from_csv(self.schedule.to_csv())
        # .measured: span, busy and bubble rate of the measured times (the paper's definitions)
        copy.measured = copy.set_times([g[0] for g in gathered], [g[1] for g in gathered])
        return copy

    def close(self):
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._dviews is not None:
            self._dviews.clear()  # views of the runner's buffers, which are gone now
        if self._nccl is not None:
            self._nccl.close()
            self._nccl = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self.schedule.close()


def _kind_name(name):
    """The canonical kind name for any name the library accepts (ZbError otherwise)."""
    kind, factor = ctypes.c_int(), ctypes.c_double()
    _lib.call("zb_kind_from_name", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_double)],
              name.encode(), ctypes.byref(kind), ctypes.byref(factor))
    return _lib.function("zb_kind_name", [ctypes.c_int], ctypes.c_char_p)(kind.value).decode()


def _global(group, rank):
    from .distributed import global_rank
    return global_rank(group, rank)


def _kind_class(kind_name, cls_name, doc):
    return type(cls_name, (PipelineSchedule,), {"kind": kind_name, "__doc__": doc, "__module__": __name__})


ScheduleGPipe = _kind_class("gpipe", "ScheduleGPipe", "GPipe: all forwards, then all backwards (memory m).")
Schedule1F1B = _kind_class("1f1b", "Schedule1F1B", "1F1B (PipeDream-flush), fused backward.")
ScheduleInterleaved1F1B = _kind_class("interleaved-1f1b", "ScheduleInterleaved1F1B",
                                      "Megatron's interleaved 1F1B: several stages per rank in a loop.")
ScheduleZBH1 = _kind_class("zb-h1", "ScheduleZBH1", "ZB-H1: 1F1B's memory, about a third of its bubble.")
ScheduleZBH2 = _kind_class("zb-h2", "ScheduleZBH2", "ZB-H2: memory 2p-1, no bubble once m is large.")
ScheduleZBVZeroBubble = _kind_class("zb-v", "ScheduleZBVZeroBubble",
                                    "ZB-V: two stages per rank in a V, 1F1B's memory, no bubble.")
ScheduleZBV = ScheduleZBVZeroBubble
ScheduleVHalf = _kind_class("v-half", "ScheduleVHalf", "V-Half: a V schedule at half of 1F1B's memory.")
ScheduleVMin = _kind_class("v-min", "ScheduleVMin", "V-Min: a V schedule at a third of 1F1B's memory.")
ScheduleZBAuto = _kind_class("zb-auto", "ScheduleZBAuto",
                             "Automatic zero bubble for the given costs under a memory limit (mem_limit=).")
ScheduleInterleavedZeroBubble = _kind_class("zb-auto", "ScheduleInterleavedZeroBubble",
                                            "torch's InterleavedZeroBubble name: zbpp's automatic scheduler "
                                            "over loop-placed stages.")


class ScheduleFromCSV(PipelineSchedule):
    """A schedule read from torch's CSV action grammar: ScheduleFromCSV(stages, m, csv=path_or_text, ...)."""

    def __init__(self, stage_or_stages, n_microbatches, loss_fn=None, *, csv, **kwargs):
        super().__init__(stage_or_stages, n_microbatches, loss_fn, csv=csv, **kwargs)


_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleZBH1,
    "zb-h2": ScheduleZBH2,
    "zb-v": ScheduleZBVZeroBubble,
    "v-half": ScheduleVHalf,
    "v-min": ScheduleVMin,
    "zb-auto": ScheduleZBAuto,
}


def get_schedule_class(name):
    """The schedule class for a name: zbpp's kind names (zb-v, zb-h1, 1f1b, ...) or torch's class
    names (1F1B, Interleaved1F1B, GPipe, InterleavedZeroBubble, ZBVZeroBubble, also with the
    "Schedule" prefix), case-insensitively. Raises ValueError listing the valid names."""
    if not isinstance(name, str):
        raise TypeError(f"zbpp.get_schedule_class: name must be a str, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-")
    if key in ("interleavedzerobubble", "scheduleinterleavedzerobubble"):
        return ScheduleInterleavedZeroBubble
    try:
        kind = _kind_name(name)
    except _lib.ZbError as exc:
        raise ValueError(f"zbpp.get_schedule_class: unknown schedule {name!r}; valid names: "
                         + ", ".join(_CLASSES) + " and torch's 1F1B, Interleaved1F1B, GPipe, "
                         "InterleavedZeroBubble, ZBVZeroBubble (case-insensitive)") from exc
    cls = _CLASSES.get(kind)
    if cls is None:
        raise ValueError(f"zbpp.get_schedule_class: {name!r} ({kind}) has no generator; use "
                         "ScheduleFromCSV for a schedule from a file")
    return cls
