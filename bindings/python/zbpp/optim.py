"""Optimizer post-validation for torch optimizers (the paper's section 4), over the C protocol.

What this is: `PostValidatedOptimizer(optimizer, stage_params, num_stages, ...)` wraps a
torch.optim optimizer (AdamW, SGD, anything whose step() reads .grad) so that it steps without a
global synchronisation first: each rank sends the partial gradient state (per stage: squared norm
and inf/NaN flag) on along the pipeline, steps at once with what it has, and when the full state
comes back the C library (zb_postval_*) says whether the step stands. If it does not (inf/NaN
somewhere, or clipping needed another factor), this wrapper restores the parameters and the
optimizer state it saved and steps again with the right factor, or skips the step and backs the
loss scale off. The result is bit for bit the synchronous path's (post_validation=False).

Precision: fp32 parameters are stepped in place. bf16 and fp16 parameters get fp32 master copies
(which replace them in the optimizer's param groups, as Megatron's mixed-precision optimizer
does); gradients are read in fp32 and the stepped masters are copied back to the model in its
dtype after the decision. Gradients come from `param.main_grad` when present, else `param.grad`.

Two paths (fused=):
  - fused (the default when every parameter is on a GPU and the optimizer is torch.optim.AdamW or
    SGD in a form the library's kernels implement; fused=True forces it, on the CPU too, where the
    C reference runs): the library's kernels do it all (_fused_optim.py). Each stage's squared norm
    and inf/NaN flag come from zb_sq_norm, the update from zb_optim_step over the fp32 masters
    reading the gradients in their own dtype, and a refuted step is undone by zb_optim_undo from the
    undo record the step wrote (AdamW 12 bytes per element, SGD with momentum 8, plain SGD 4; with
    undo_memory="host" in pinned host memory, written by the kernel over the bus). Nothing is copied
    per step: no gradient, no parameter, no optimizer state.
  - unfused (fused=False, and any other optimizer): the wrapped optimizer's own step() after a
    snapshot of the fp32 parameters and the optimizer state (AdamW: 3 values per parameter; SGD
    with momentum: 2), restored to undo. CUDA gradients' per-tensor squared norms and flags are
    computed on the device (each tensor's sum of squares in float64, summed over a stage's tensors
    in order on the host), and only those few numbers are copied to the host, once per device per
    step. CPU gradients take exactly the path they always did.
Both run on torch's current stream; each equals its own synchronous path bit for bit.

Tensor parallelism (Megatron): with `tensor_parallel_group=` each stage's squared norm is summed
over the tensor-parallel ranks (parameters marked `tensor_model_parallel` are shards; the others
are copies, counted on tensor-parallel rank 0 only, as Megatron's get_grad_norm_fp32 does) and its
inf/NaN flag is or-ed there, before the pipeline exchange. That collective stays inside the stage,
so no pipeline-wide synchronisation comes back; every tensor-parallel rank then takes the same
decision. Data parallelism needs nothing: Megatron's DDP leaves the same reduced gradients on
every data-parallel rank (the distributed optimizer's sharded state is not supported).

Checkpoints: state_dict() is the wrapped optimizer's own (torch's "state" and "param_groups" at
the top level, so torch and tools that read its layout still can) plus one key, "zbpp": the fp32
masters of half-precision parameters (under torch's parameter ids), the loss scaler as GradScaler
names it (scale, _growth_tracker) and the step counts (steps, skipped, clipped, rolled_back: this
rank's). load_state_dict() restores all of it and still takes a plain torch optimizer state dict.
The masters follow the model: before each step (and in state_dict()), a half-precision parameter
changed since this wrapper last wrote it (torch's _version counter: model.load_state_dict, an
in-place op; not a write through .data, which torch does not count) gives its master its value,
unless the new value is exactly the master rounded to the parameter's dtype: then the master, with
the low bits a checkpoint restored, stays. So a run resumed from the model's and this optimizer's
state dicts, loaded in either order, before or after the wrap, steps bit for bit as the run that
was not interrupted; a model loaded alone is stepped from its own values.

What this is not: an optimizer. The update is the wrapped optimizer's own; the loss scale is
applied by the caller (multiply the loss by `.loss_scale` before backward).
"""

import ctypes
from typing import NamedTuple

import torch

from . import _fused_optim, _lib

__all__ = ["PostValidatedOptimizer", "StepResult", "StepStats"]

_c = ctypes
_P = _c.c_void_p


class _Config(_c.Structure):
    _fields_ = [
        ("struct_size", _c.c_uint32),
        ("version", _c.c_uint32),
        ("clip_grad", _c.c_double),
        ("loss_scale", _c.c_double),
        ("backoff", _c.c_double),
        ("growth", _c.c_double),
        ("growth_interval", _c.c_int32),
        ("post_validation", _c.c_int32),
        ("stages", _c.c_int32),
        ("rank", _c.c_int32),
        ("ranks", _c.c_int32),
        ("placement", _c.c_int),
        ("transport", _P),
        ("timeout_s", _c.c_double),
    ]


class _Decision(_c.Structure):
    _fields_ = [
        ("step", _c.c_int32),
        ("undo", _c.c_int32),
        ("factor", _c.c_float),
        ("skipped", _c.c_int32),
        ("clipped", _c.c_int32),
        ("grad_norm", _c.c_double),
        ("loss_scale", _c.c_double),
    ]


class _State(_c.Structure):  # zb_postval_state_t
    _fields_ = [
        ("struct_size", _c.c_uint32),
        ("version", _c.c_uint32),
        ("loss_scale", _c.c_double),
        ("good_steps", _c.c_int64),
        ("steps", _c.c_int64),
        ("skipped", _c.c_int64),
        ("clipped", _c.c_int64),
        ("undone", _c.c_int64),
    ]


_STATE_VERSION = 1  # ZB_POSTVAL_STATE_VERSION
_CKPT_VERSION = 1   # the layout of state_dict()["zbpp"]


# Device gradients are reduced in pieces of this many elements, so the float64 copy a piece needs
# stays small (a whole 100M-element tensor would need 800 MB more).
_PIECE = 1 << 24


def _device_sq(g):
    """A device tensor's sum of squares in float64 and its inf/NaN flag, both still on the device."""
    flat = g.reshape(-1)
    if flat.numel() <= _PIECE:
        return flat.double().pow(2).sum(), ~torch.isfinite(flat).all()
    sq = bad = None
    for piece in flat.split(_PIECE):
        ps, pb = piece.double().pow(2).sum(), ~torch.isfinite(piece).all()
        sq, bad = (ps, pb) if sq is None else (sq + ps, bad | pb)
    return sq, bad


def _is_tp_shard(master):
    return getattr(master, "_zbpp_tp_shard", False)


def _tp_reduce(sq, bad, group):
    """Sums the per-stage squares over the tensor-parallel group and ors the flags (the caller left
    copies of a parameter out everywhere but on the group's rank 0; see the module docstring)."""
    import torch.distributed as dist

    S = len(sq)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([sq[s] for s in range(S)] + [float(bad[s]) for s in range(S)], dtype=torch.float64,
                     device=device)
    dist.all_reduce(t, group=group)
    out = t.cpu().tolist()
    for s in range(S):
        sq[s] = out[s]
        bad[s] = 1 if out[S + s] > 0 else 0


def _stage_state(grads, S, counted=None):
    """Per stage: the sum of squares of its gradients (float64) and an inf/NaN flag, as ctypes arrays
    for zb_postval_begin. CPU tensors: each tensor's float64 sum, read at once (the original path);
    device tensors: the same per-tensor values computed on the device and read in one copy per
    device. Either way the stage's sum is accumulated on the host in tensor order."""
    sq = (_c.c_double * S)()
    bad = (_c.c_int32 * S)()
    values = {}   # (stage, index) -> (sum of squares, nonfinite) as Python numbers
    pending = {}  # device -> [((stage, index), sq tensor, flag tensor)]
    for s, row in grads.items():
        for k, (master, g) in enumerate(row):
            if g is None or (counted is not None and not counted(master)):
                continue
            if g.device.type == "cpu":
                values[(s, k)] = (float(g.double().pow(2).sum()), not bool(torch.isfinite(g).all()))
            else:
                pending.setdefault(g.device, []).append(((s, k),) + _device_sq(g))
    for items in pending.values():
        sums = torch.stack([v for _, v, _ in items]).cpu().tolist()
        flags = torch.stack([f for _, _, f in items]).cpu().tolist()
        for (key, _, _), v, f in zip(items, sums, flags):
            values[key] = (v, bool(f))
    for s, row in grads.items():
        acc = 0.0
        for k in range(len(row)):
            v = values.get((s, k))
            if v is None:
                continue
            if v[1]:
                bad[s] = 1
            acc += v[0]
        sq[s] = acc
    return sq, bad


class StepResult(NamedTuple):
    skipped: bool       # inf/NaN somewhere: no parameter changed, the loss scale backed off
    clipped: bool       # the gradients were scaled down to clip_grad
    rolled_back: bool   # this rank undid a speculative step (and redid or skipped it)
    grad_norm: float    # global L2 norm of the unscaled gradients (inf when skipped)
    loss_scale: float   # multiply the next iteration's loss by this


class StepStats(NamedTuple):
    """This rank's counts since the first step (kept across checkpoints)."""
    steps: int          # step() calls that returned, skipped ones included
    skipped: int        # inf/NaN somewhere: no step
    clipped: int        # the gradients were scaled down to clip_grad
    rolled_back: int    # this rank undid a speculative step


class PostValidatedOptimizer:
    """A torch optimizer stepped with post-validation; see the module docstring.

    stage_params: {stage index: [parameters]} for this rank's stages (each parameter in exactly one
    stage, all of them in the optimizer, except frozen ones, requires_grad=False, which are left
    out: they have no gradient to validate). num_stages, rank, ranks, placement ('loop' or 'v') and
    transport (an object with .handle, e.g. the schedule's) describe the pipeline;
    `PostValidatedOptimizer.for_schedule(optimizer, schedule)` fills them in from a zbpp schedule.
    clip_grad: max global norm (0: none); loss_scale/backoff/growth/growth_interval: a dynamic loss
    scale as torch's GradScaler (1.0 and no growth: none); post_validation=False gives the
    synchronous reference path. fused: None (the library's kernels when every parameter is on a GPU
    and the optimizer allows), True or False; undo_memory: 'device' or 'host' (pinned), where the
    fused path keeps its undo record (see the module docstring).
    """

    def __init__(self, optimizer, stage_params, num_stages, *, rank=0, ranks=1, placement="loop",
                 transport=None, clip_grad=0.0, loss_scale=1.0, backoff=0.5, growth=2.0,
                 growth_interval=0, post_validation=True, timeout=300.0, tensor_parallel_group=None,
                 fused=None, undo_memory="device"):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"zbpp.PostValidatedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if placement not in ("loop", "v"):
            raise ValueError(f"zbpp.PostValidatedOptimizer: placement must be 'loop' or 'v', got {placement!r}")
        if ranks > 1 and transport is None:
            raise ValueError("zbpp.PostValidatedOptimizer: a pipeline of several ranks needs a transport "
                             "(use PostValidatedOptimizer.for_schedule)")
        self.optimizer = optimizer
        self.num_stages = num_stages
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._stages = {}  # stage -> [(model param, master param)]
        seen = set()
        for s, params in sorted(stage_params.items()):
            if not 0 <= s < num_stages:
                raise ValueError(f"zbpp.PostValidatedOptimizer: stage {s} is outside [0, {num_stages - 1}]")
            pairs = []
            for p in params:
                if id(p) in seen:
                    raise ValueError(f"zbpp.PostValidatedOptimizer: a parameter {tuple(p.shape)} is listed twice")
                seen.add(id(p))
                if id(p) not in in_opt:
                    if not p.requires_grad:
                        continue  # frozen (fine-tuning): no gradient, nothing to step or validate
                    raise ValueError(f"zbpp.PostValidatedOptimizer: a trainable parameter {tuple(p.shape)} of stage "
                                     f"{s} is not in the optimizer's param groups (add it, or freeze it with "
                                     "requires_grad_(False))")
                if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise TypeError(f"zbpp.PostValidatedOptimizer: parameters must be float32, float16 or "
                                    f"bfloat16, got {p.dtype}")
                pairs.append((p, p if p.dtype == torch.float32 else self._master(p)))
            self._stages[s] = pairs
        # Half-precision parameters and the _version each had when its master last matched it.
        self._halves = [(p, m) for pairs in self._stages.values() for p, m in pairs if m is not p]
        self._versions = [p._version for p, _ in self._halves]
        missing = in_opt - seen
        if missing:
            raise ValueError(f"zbpp.PostValidatedOptimizer: {len(missing)} parameter(s) of the optimizer "
                             "belong to no stage in stage_params")
        masters = [m for pairs in self._stages.values() for _, m in pairs]
        if fused is None:
            fused = (bool(masters) and all(m.device.type == "cuda" and m.is_contiguous() for m in masters)
                     and _fused_optim.fusable(optimizer))
        elif fused and not all(m.is_contiguous() for m in masters):
            raise ValueError("zbpp.PostValidatedOptimizer(fused=True): the fused kernels step contiguous "
                             "parameters; one is not (channels_last?); pass fused=False")
        if not fused and undo_memory != "device":
            raise ValueError("zbpp.PostValidatedOptimizer: undo_memory applies to the fused path (fused=True); "
                             "the unfused path keeps its snapshot beside the parameters")
        self._fused = _fused_optim.FusedStep(optimizer, undo_memory) if fused else None
        self._post_validation = bool(post_validation)
        # What every rank of a pipeline must have alike (the schedule's handshake compares it).
        self._agreement = (f"{'on' if post_validation else 'off (synchronous path)'}, clip_grad={clip_grad:g}, "
                           f"loss_scale={loss_scale:g}, backoff={backoff:g}, growth={growth:g}, "
                           f"growth_interval={growth_interval}")
        self._transport = transport
        self._tp_group = tensor_parallel_group
        if tensor_parallel_group is not None:
            # Which masters are shards (Megatron's tensor_model_parallel attribute of the parameter).
            for pairs in self._stages.values():
                for p, master in pairs:
                    master._zbpp_tp_shard = bool(getattr(p, "tensor_model_parallel", False))
        cfg = _Config()
        cfg.struct_size, cfg.version = _c.sizeof(_Config), 1
        cfg.clip_grad, cfg.loss_scale, cfg.backoff, cfg.growth = clip_grad, loss_scale, backoff, growth
        cfg.growth_interval, cfg.post_validation = growth_interval, int(bool(post_validation))
        cfg.stages, cfg.rank, cfg.ranks = num_stages, rank, ranks
        cfg.placement = 1 if placement == "v" else 0
        cfg.transport = transport.handle if transport is not None else None
        cfg.timeout_s = timeout
        self._h = _P()
        _lib.call("zb_postval_create", [_c.POINTER(_P), _c.POINTER(_Config)], _c.byref(self._h), _c.byref(cfg))

    @classmethod
    def for_schedule(cls, optimizer, schedule, **kwargs):
        """Wraps `optimizer` for the stages, ranks and transport of a zbpp PipelineSchedule. Every
        trainable parameter of this rank's stages must be in the optimizer; frozen ones
        (requires_grad=False) may be left out."""
        # A parameter several stages of this rank share (a tied embedding and LM head at both ends
        # of a V) is one parameter with one gradient: it belongs to the first stage that holds it.
        stage_params, seen = {}, set()
        for st in sorted(schedule.stages, key=lambda st: st.stage_index):
            stage_params[st.stage_index] = [p for p in st.submod.parameters() if id(p) not in seen]
            seen.update(id(p) for p in stage_params[st.stage_index])
        vp = getattr(schedule, "_vp", None)
        if vp is not None and kwargs.get("loss_scale", 1.0) != 1.0:
            raise ValueError("zbpp.PostValidatedOptimizer: loss_scale must be 1 with vocab_parallel=: the schedule "
                             "backpropagates Vocabulary Parallelism's loss itself, unscaled (train in float32 or "
                             "bfloat16, which need no loss scale)")
        if vp is not None:
            # Vocabulary Parallelism's shards (vocab_parallel=): this rank's rows of the output
            # layer and embedding, validated with the rank's first stage (the shards of the ranks
            # are disjoint, so the global norm and the inf check see every row once).
            first = min(stage_params)
            stage_params[first] = stage_params[first] + [p for p in vp.vp.parameters() if id(p) not in seen]
        wrapped = cls(optimizer, stage_params, schedule.stages[0].num_stages, rank=schedule.rank,
                      ranks=schedule.ranks, placement=schedule.schedule.placement,
                      transport=schedule.transport, timeout=schedule.timeout, **kwargs)
        # The pipeline's handshake checks that every rank wraps its optimizer the same way (again
        # at the next step when the schedule has run before).
        schedule._post_validation = wrapped._agreement
        schedule._agreed = False
        return wrapped

    def _master(self, p):
        master = torch.nn.Parameter(p.detach().float().clone(memory_format=torch.contiguous_format))
        for g in self.optimizer.param_groups:
            g["params"] = [master if q is p else q for q in g["params"]]
        if p in self.optimizer.state:
            raise ValueError("zbpp.PostValidatedOptimizer: wrap the optimizer before its first step (a "
                             "half-precision parameter already has optimizer state)")
        return master

    def _sync_masters(self):
        """Gives a half-precision parameter's master the parameter's value when something other
        than this wrapper wrote the parameter (model.load_state_dict after the wrap), unless that
        value is the master rounded (the model and a restored master from one checkpoint, loaded
        in either order): see the module docstring."""
        with torch.no_grad():
            for i, (p, master) in enumerate(self._halves):
                if p._version == self._versions[i]:
                    continue
                rounded = master.to(p.dtype)
                if not torch.equal(rounded.view(torch.int16), p.detach().view(torch.int16)):
                    master.copy_(p)
                self._versions[i] = p._version

    @property
    def loss_scale(self):
        out = _c.c_double()
        _lib.call("zb_postval_loss_scale", [_P, _c.POINTER(_c.c_double)], self._handle(), _c.byref(out))
        return out.value

    def _handle(self):
        if not self._h:
            raise ValueError("zbpp.PostValidatedOptimizer: closed")
        return self._h

    # ---- one step --------------------------------------------------------------------------------

    def _grads(self, widen=True):
        """{stage: [(master, gradient or None)]} as the gradients are now (loss scale included): fp32
        copies where widen, else the gradients themselves (main_grad, else .grad)."""
        out = {}
        for s, pairs in self._stages.items():
            row = []
            for p, master in pairs:
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad
                row.append((master, None if g is None else (g.detach().float() if widen else g.detach())))
            out[s] = row
        return out

    def _apply(self, grads, factor):
        for row in grads.values():
            for master, g in row:
                master.grad = None if g is None else g.mul(factor)
        self.optimizer.step()
        for row in grads.values():
            for master, _ in row:
                master.grad = None

    def _snapshot(self):
        snap = []
        for pairs in self._stages.values():
            for _, master in pairs:
                state = self.optimizer.state.get(master)
                copy = None if state is None else {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
                snap.append((master, master.detach().clone(), copy))
        return snap

    def _restore(self, snap):
        with torch.no_grad():
            for master, value, state in snap:
                master.copy_(value)
                if state is None:
                    self.optimizer.state.pop(master, None)
                else:
                    self.optimizer.state[master] = state

    def _publish(self):
        with torch.no_grad():
            for i, (p, master) in enumerate(self._halves):
                p.copy_(master)
                self._versions[i] = p._version

    def step(self):
        """One optimizer step with post-validation; blocks for the pipeline's exchange. Returns a
        StepResult. On a transport failure raises ZbError with this rank's parameters and optimizer
        state as they were before the call. Whatever fails on this rank is published to the
        pipeline's other ranks (the transport's abort, under the pipeline's key), so none of them
        waits out its timeout in the exchange, and the schedule takes no more steps."""
        try:
            return self._step()
        except BaseException as exc:
            abort = getattr(self._transport, "abort", None)
            if abort is not None:
                from .distributed import first_line

                abort(f"PostValidatedOptimizer.step: {type(exc).__name__}: {first_line(exc)}")
            raise

    def _step(self):
        S = self.num_stages
        fused = self._fused
        self._sync_masters()
        grads = self._grads(widen=fused is None)
        counted = None
        if self._tp_group is not None and torch.distributed.get_rank(self._tp_group) != 0:
            # Copies of a parameter (not tensor-parallel shards) are counted on rank 0 only. Their
            # inf/NaN is seen there too: the copies are equal.
            counted = _is_tp_shard
        sq, bad = (_stage_state if fused is None else fused.stage_state)(grads, S, counted)
        # The fused step's calls are made before the exchange starts: nothing between
        # zb_postval_begin and zb_postval_end may raise, or the other ranks would wait for this one.
        calls = fused.plan(grads) if fused is not None else None
        if self._tp_group is not None:
            _tp_reduce(sq, bad, self._tp_group)
        d = _Decision()
        _lib.call("zb_postval_begin", [_P, _c.POINTER(_c.c_double), _c.POINTER(_c.c_int32), _c.POINTER(_Decision)],
                  self._handle(), sq, bad, _c.byref(d))
        if fused is not None:
            self._step_fused(d, calls)
        else:
            snap = None
            if d.step:
                snap = self._snapshot()
                self._apply(grads, d.factor)
            status = _lib.function("zb_postval_end", [_P, _c.POINTER(_Decision)])(self._handle(), _c.byref(d))
            if d.undo and snap is not None:
                self._restore(snap)
            _lib.check(status)
            if d.step:
                self._apply(grads, d.factor)
        self._publish()
        return StepResult(bool(d.skipped), bool(d.clipped), bool(d.undo), float(d.grad_norm), float(d.loss_scale))

    def _step_fused(self, d, calls):
        """The decision's steps through the library's kernels: speculatively with an undo record,
        undone bit for bit if the full state refutes it, redone with the right factor."""
        fused, ran = self._fused, False
        if d.step:
            fused.run(calls, d.factor, undoable=self._post_validation)
            ran = True
        status = _lib.function("zb_postval_end", [_P, _c.POINTER(_Decision)])(self._handle(), _c.byref(d))
        if d.undo and ran:
            fused.undo(calls)
            ran = False
        _lib.check(status)
        if d.step:
            fused.run(calls, d.factor, undoable=False)
            ran = True
        if ran:
            fused.commit(calls)

    @property
    def fused(self):
        """True when steps run through the library's kernels (see the module docstring)."""
        return self._fused is not None

    def zero_grad(self, set_to_none=True):
        for pairs in self._stages.values():
            for p, _ in pairs:
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.zero_()
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    # ---- checkpoints ---------------------------------------------------------------------------

    def _get_state(self):
        if not self._h and getattr(self, "_final_state", None) is not None:
            return self._final_state  # closed: what it was (a checkpoint after close still works)
        st = _State()
        st.struct_size, st.version = _c.sizeof(_State), _STATE_VERSION
        _lib.call("zb_postval_get_state", [_P, _c.POINTER(_State)], self._handle(), _c.byref(st))
        return st

    @property
    def stats(self):
        """StepStats: this rank's step counts, restored with a checkpoint."""
        st = self._get_state()
        return StepStats(st.steps, st.skipped, st.clipped, st.undone)

    def _param_ids(self, param_groups):
        """(torch's id in a state dict, the parameter of this optimizer) in torch's order."""
        ids = [i for g in param_groups for i in g["params"]]
        params = [q for g in self.optimizer.param_groups for q in g["params"]]
        return zip(ids, params)

    def state_dict(self):
        """The wrapped optimizer's state dict plus "zbpp": {"version", "masters": {torch's parameter
        id: the fp32 master of a half-precision parameter}, "scaler": {"scale", "_growth_tracker"},
        "stats": {"steps", "skipped", "clipped", "rolled_back"}}. As torch's, the tensors are the
        live ones (not copies): save them before the next step."""
        self._sync_masters()
        out = self.optimizer.state_dict()
        halves = {id(m) for _, m in self._halves}
        st = self._get_state()
        out["zbpp"] = {
            "version": _CKPT_VERSION,
            "masters": {i: q.detach() for i, q in self._param_ids(out["param_groups"]) if id(q) in halves},
            "scaler": {"scale": st.loss_scale, "_growth_tracker": st.good_steps},
            "stats": {"steps": st.steps, "skipped": st.skipped, "clipped": st.clipped, "rolled_back": st.undone},
        }
        return out

    def load_state_dict(self, state_dict):
        """Restores a state_dict() of this class, or a plain torch optimizer state dict (then the
        masters, loss scale and counts stay as they are). Masters are restored for the parameters
        that are half precision here (a master saved for one that is fp32 here is left out: the
        model's own weights stand); the scaler's growth settings are the constructor's."""
        state = dict(state_dict)
        extra = state.pop("zbpp", None)
        if extra is None:
            self.optimizer.load_state_dict(state)
            return
        if extra.get("version") != _CKPT_VERSION:
            raise ValueError(f"zbpp.PostValidatedOptimizer.load_state_dict: the state dict's zbpp part has "
                             f"version {extra.get('version')!r}; this zbpp reads {_CKPT_VERSION}")
        halves = {id(m) for _, m in self._halves}
        params = dict(self._param_ids(state["param_groups"]))
        masters = []
        for i, value in extra["masters"].items():
            q = params.get(i)
            if q is None or id(q) not in halves:
                continue
            if tuple(value.shape) != tuple(q.shape):
                raise ValueError(f"zbpp.PostValidatedOptimizer.load_state_dict: the master of parameter {i} has "
                                 f"shape {tuple(value.shape)}, the parameter {tuple(q.shape)}")
            masters.append((q, value))
        scaler, stats = extra["scaler"], extra["stats"]
        new = _State()
        new.struct_size, new.version = _c.sizeof(_State), _STATE_VERSION
        new.loss_scale, new.good_steps = float(scaler["scale"]), int(scaler["_growth_tracker"])
        new.steps, new.skipped = int(stats["steps"]), int(stats["skipped"])
        new.clipped, new.undone = int(stats["clipped"]), int(stats["rolled_back"])
        old = self._get_state()
        set_state = [_P, _c.POINTER(_State)]
        _lib.call("zb_postval_set_state", set_state, self._handle(), _c.byref(new))  # checks the values
        try:
            self.optimizer.load_state_dict(state)
        except BaseException:
            _lib.call("zb_postval_set_state", set_state, self._handle(), _c.byref(old))
            raise
        with torch.no_grad():
            for q, value in masters:
                q.copy_(value)

    def close(self):
        if self._h:
            self._final_state = self._get_state()
        h, self._h = self._h, _P()
        if h:
            _lib.call("zb_postval_destroy", [_P], h)
        # A schedule closed before this optimizer left the transport they share for us to free.
        if getattr(self._transport, "close_pending", False):
            self._transport.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing sensible to do during garbage collection
            pass
