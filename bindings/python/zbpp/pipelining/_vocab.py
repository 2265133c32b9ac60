"""Vocabulary Parallelism in a schedule's steps (vocab_parallel=zbpp.VocabParallel(...)).

What this is: VocabRun, which a PipelineSchedule holds when it was given vocab_parallel: it shards
the user's output layer and embedding over the pipeline's ranks (zbpp.vocab), adds the passes to
the plan (the spec's `vocab` and pass times: S, T, IF, IB on every rank for every microbatch,
placed by the C library), and runs them at the runner's vocab callback. Per step:

  at the start, on every rank: the tokens (stage 0's first argument) from stage 0's rank and the
      target from the last stage's rank, to every rank (CHANNEL_DATA, on the schedule's transport);
  IF(mb): this rank's rows of the embedding; their SUM over the ranks (lane IF) is stage 0's input;
  the last stage's forward: its output, the hidden states, to every rank (lane H, from its rank);
  S(mb): logits, max, sum and target logit on this rank's rows (fused: the input gradient's
      parts); C0, the all-reduces joining the ranks (lane S), gives the loss and (fused) the
      last stage's output gradient;
  T(mb): after C0, the softmax's gradient into this rank's rows of the weight gradient (unfused:
      its part of the output gradient, SUMmed on lane T);
  the last stage's backward: waits for that gradient, then runs as any stage's;
  stage 0's backward: keeps its input gradient for IB;
  IB(mb): that gradient from stage 0's rank to every rank (lane IB), each adding its rows of the
      embedding's weight gradient;
  at the end: every lane drained, the per-microbatch losses (mean cross entropy over its tokens).

CUDA stages: each lane runs its jobs on a stream of its own (_vocab_lanes._Lane says why not the
compute stream) and its collectives over an NCCL group transport when every rank has a GPU of its
own, else through host memory (_choose_collectives). The lanes themselves: _vocab_lanes.py.

Why lanes: the collectives run beside the compute, each kind in microbatch order on a thread with
a transport of its own (as the reference runs them on a stream of their own): the ranks run the
kinds of passes in different orders among themselves (the plan interleaves them with each rank's
own stages), so a pass that blocked on its own collective could wait for a rank that waits in
another kind's (include/zbpp.h, vocab_cb). What needs a result waits for it, bounded by the
schedule's timeout and watching the pipeline's failure key.

Planned from measured times: the plan places the passes by their times and the stages' (1F1B's
reference order by f, b and the pass cost; the other kinds by simulation), so a plan made for
VocabParallel's default times can wait where the real passes are longer or shorter. Unless
plan_from_measured=False or times were given (the schedule's times= or VocabParallel's), step
MEASURE_STEP (the first has warm-up effects) times every stage op without the waits for the
passes in it, and every pass's compute; the ranks exchange them, the kind is planned again on
them, and the new plan runs from the next step when its simulated step is shorter than the one
in force on the same times by REPLAN_MIN_GAIN. `replanned` says what it found.

Forward-only steps (eval()) run no passes: the batch's embedding is one all-reduce before the
forwards, and, with a target, the loss one broadcast of the last stage's outputs and one S over
the whole batch after them.

What this is not: the numerics (zbpp/vocab.py) or the placement (csrc/schedule/gen_vocab.c and
simulate.c's zb__place_vocab).
"""

import logging
import os
import statistics
import time

import torch

from .. import distributed
from ..vocab import CHANNEL_DATA, CHANNEL_HIDDEN, CHANNEL_IF, CHANNEL_S, VocabParallel, _Alone
from ._vocab_lanes import _Box, _handoff, _Lane

_LANES = ("H", "S", "T", "IF", "IB")
MEASURE_STEP = 2  # the step whose times the plan is made again from
_log = logging.getLogger("zbpp")


def plan_copy(schedule, vocab_args):
    """A copy of a plan with Vocabulary Parallelism's passes (kind "custom", unit times), for
    timeline(): from its op lists, since the CSV grammar has no cells for the passes."""
    from ..schedule import Schedule

    p = schedule.ranks
    placement = schedule.placement
    if placement not in ("loop", "v"):
        placement = [schedule.stage_rank(s) for s in range(schedule.stages)]
    return Schedule.from_ops([schedule.rank_ops(r) for r in range(p)], schedule.microbatches, placement=placement,
                             v=schedule.chunks if isinstance(placement, str) else None, **vocab_args)


_MAX_DIMS = 8  # of a microbatch's tokens
_WHY_BYTES = 512  # of the reason a rank's batch cannot be sent, which every rank raises


def check_config(name, vocab_parallel, loss_fn, csv, kind, offload, costs, plan_from_measured, py_kinds):
    """Refuses what vocab_parallel= does not go with, saying what is allowed."""
    if not isinstance(vocab_parallel, VocabParallel):
        raise TypeError(f"zbpp.{name}: vocab_parallel must be a zbpp.VocabParallel(output=..., embedding=...), got "
                        f"{type(vocab_parallel).__name__}")
    why = None
    if loss_fn is not None:
        why = ("computes the loss itself (the output layer's cross entropy, mean over each microbatch's tokens); "
               "drop loss_fn")
    elif csv is not None or kind is None or kind in py_kinds:
        why = "places its passes in the plans of zbpp's kinds (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, " \
              "zb-v, v-half, v-min, zb-auto and their torch names); not in a CSV, a user's order or " + str(kind)
    elif offload is not None:
        why = "does not go with offload= yet"
    elif costs is not None:
        why = "plans from the times it measures (or VocabParallel(times=...) and times=), not from costs= (yet)"
    if why:
        raise ValueError(f"zbpp.{name}: vocab_parallel {why}")


def _int_batch(mbs, what, m):
    """None, or why the microbatches of tokens or targets cannot be sent."""
    if mbs is None:
        return None
    if len(mbs) != m:
        return f"{what} has {len(mbs)} microbatches, the schedule {m}"
    shape = None
    for t in mbs:
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            return f"{what} must be integer tensors of vocabulary ids, got {getattr(t, 'dtype', type(t).__name__)}"
        if shape is not None and t.shape != shape:
            return f"{what}'s microbatches differ in shape ({tuple(shape)} and {tuple(t.shape)})"
        shape = t.shape
    if not 1 <= len(shape) <= _MAX_DIMS:
        return f"{what} must have 1 to {_MAX_DIMS} dimensions a microbatch, got {tuple(shape)}"
    return None


def _send_hidden(tr, h, targets, root, timeout):
    """Lane H's job: the last stage's output rows (and, fed, their targets, host copies) from root to
    every rank."""
    h = tr.broadcast(h, root, timeout=timeout, channel=CHANNEL_HIDDEN)
    if targets is not None:
        targets = _broadcast_ids(tr, targets, root, h.device, timeout, CHANNEL_HIDDEN)
    return h, targets


def _broadcast_ids(tr, ids, root, device, timeout, channel):
    """ids (int64 in host memory, root's or a buffer of their size) from root to every rank, as a
    host copy: an NCCL group transport moves device memory only, so they go by way of `device`."""
    if not getattr(tr, "device_collectives", False):
        return tr.broadcast(ids, root, timeout=timeout, channel=channel)
    on = ids.to(device)
    tr.broadcast(on, root, timeout=timeout, channel=channel)
    return on.cpu()


class VocabRun:
    """A schedule's Vocabulary Parallelism (see the module docstring)."""

    def __init__(self, sched, config, measure=True):
        config._bind(sched.rank, sched.ranks, sched.device)
        config.embedding.timeout = config.output.timeout = sched.timeout
        self.sched, self.vp = sched, config
        self.device = sched.device  # the shards' and the passes' (CUDA stages: their GPU)
        self.measure_at = MEASURE_STEP if measure else None
        self.measuring = False
        self.replanned = None  # what the replan from measured times found (replan)
        self._timed, self._waits = {}, {}
        self.lanes = None
        self._tts = []
        self._nccl = []  # (NCCL group transport, its backend) per lane, with collectives="nccl"
        self.collectives = "host"  # where the lanes' collectives run: "host" or "nccl" (_connect)
        self._main = _Alone()
        # Fed mode (the Megatron adapter, zbpp/megatron/vocab.py): the tokens come from stage 0's
        # forward and the targets from the last stage's, a microbatch at a time, not from step()'s
        # batch; the loss is the caller's, whose gradient per token feed.loss_grad gives (see set_feed).
        self.feed = None
        self._box = _Box(sched.timeout, sched._peer_failure)
        self._labels = {}
        self._reset(None, None, False)

    def agreement(self):
        """What every rank must have alike (the handshake): the layers, and whether (when) the
        plan is made again from measured times, which runs collectives of its own."""
        when = f"replanned after step {self.measure_at}" if self.measure_at else "not replanned"
        return f"{self.vp.describe()}, {when}"

    def spec(self):
        """Schedule.generate's vocab arguments."""
        return dict(vocab=2 if self.vp.fused else 1, vocab_times=dict(self.vp.times))

    def set_feed(self, feed):
        """Fed mode: feed.n is the tokens a microbatch has (fixed by the call's shape);
        feed.loss_grad(mb, loss) on the loss stage's rank gives d(loss)/d(per-token loss) [n] from
        the per-token cross entropy [n] (rows in the order of the last stage's output rows).
        Stage 0's forward hands its token ids over with embed_for_stage; the last stage's forward
        its targets with give_targets, before it returns its output."""
        self.feed = feed

    def _n(self, mb):
        return self.feed.n if self.feed is not None else self.tokens[mb].numel()

    def _reset(self, tokens, targets, trains):
        self.tokens, self.targets, self.trains = tokens, targets, trains
        self.states, self.grads_in, self.losses, self._g = {}, {}, [], {}
        self.emb_first = self.emb_all = None

    # ---- the step ---------------------------------------------------------------------------------

    def _connect(self):
        """The lanes' transports, at the first step (connecting is a collective)."""
        if self.lanes is not None:
            return
        sc = self.sched
        cuda = self.device.type == "cuda"
        streams = {k: torch.cuda.Stream(self.device) for k in _LANES} if cuda else dict.fromkeys(_LANES)
        if sc.ranks == 1:
            transports = {k: _Alone() for k in _LANES}
        else:
            self._main = sc.transport.transport
            self.vp.embedding.transport = self.vp.output.transport = self._main  # gather() between steps
            self.collectives = self._choose_collectives() if cuda else "host"
            if self.collectives == "nccl":
                transports = {k: self._nccl_lane(k, streams[k]) for k in _LANES}
            else:
                # Host transports (CUDA stages: over the host group the pipeline's messages use).
                group = sc._host_group()
                self._tts = [distributed.TorchTransport(group, sc.timeout, name=self._lane_name(k)) for k in _LANES]
                transports = {k: tt.transport for k, tt in zip(_LANES, self._tts)}
        self.lanes = {k: _Lane(k, transports[k], sc.timeout, sc._peer_failure, self.device, streams[k])
                      for k in _LANES}

    def _choose_collectives(self):
        """"nccl" (each lane an NCCL group transport: collectives on the GPUs) when every rank has a
        GPU of its own and NCCL, and none sets ZBPP_VOCAB_COLLECTIVES=host; else "host" (through
        host memory over the host group). Every rank decides from the same gathered facts, so all
        agree."""
        from .. import cuda as zcuda

        want_host = os.environ.get("ZBPP_VOCAB_COLLECTIVES", "").strip().lower() == "host"
        want_host = want_host or not torch.distributed.is_nccl_available()
        facts = self.sched._exchange((zcuda.gpu_identity(self.device), want_host),
                                     "where Vocabulary Parallelism's collectives run")
        if any(h for _, h in facts) or zcuda.shared_gpus([i for i, _ in facts]) is not None:
            return "host"
        return "nccl"

    def _nccl_lane(self, kind, stream):
        """Lane `kind`'s NCCL group transport: a communicator of its own (rank 0 makes its unique id
        and sends it over the host group), its collectives after the lane's stream (a backend
        borrowing that stream)."""
        from .. import runtime

        sc = self.sched
        uid = sc._shared_nccl_id(sc._host_group(), "cpu", f" for Vocabulary Parallelism's lane {kind}")
        backend = runtime.Backend("cuda", device=self.device.index, stream=stream, workspace_bytes=256)
        store = distributed._default_store()
        name = self._lane_name(kind) if store is not None else None
        t = runtime.Transport.nccl_group(sc.rank, sc.ranks, uid, backend, timeout=sc.timeout, abort_store=store,
                                         abort_key=distributed.abort_key(name) if name else None)
        self._nccl.append((t, backend))
        return t

    def _lane_name(self, kind):
        """The lane transport's name (its keys in the job's store), None without a pipeline key."""
        return f"{self.sched._key}-vocab-{kind}" if self.sched._key else None

    def _roots(self):
        sched = self.sched.schedule
        return sched.stage_rank(0), sched.stage_rank(sched.stages - 1)

    def begin_step(self, arg_mbs, target_mbs, trains):
        """Every rank, before the step's ops: the tokens and the target to every rank."""
        self._connect()
        for lane in self.lanes.values():
            lane.reset()
        self._box.reset()
        self._labels = {}
        if self.feed is not None:
            if not trains:
                raise ValueError("zbpp vocab_parallel: a fed schedule runs forward-only passes outside its steps")
            self._reset({}, {}, trains)
            self.measuring = self.measure_at == self.sched.steps + 1
            self._timed, self._waits = {}, {}
            if self.measuring:
                self._time_barrier()
            return
        first, last = self._roots()
        mine = [a[0] if a else None for a in arg_mbs] if arg_mbs is not None else None
        tokens = self._share(mine, first, "the tokens (stage 0's first argument)")
        if tokens is None:
            raise ValueError(f"zbpp vocab_parallel: rank {first} (stage 0) has no tokens to embed: pass the batch of "
                             "token ids to step() there")
        targets = self._share(target_mbs, last, "the target")
        # Checked here, on the host copies every rank has: in the passes, on a GPU, each check
        # would wait for the device.
        self.vp.embedding.check_tokens(torch.cat([t.reshape(-1) for t in tokens]))
        if targets:
            self.vp.output.check_targets(torch.cat([t.reshape(-1) for t in targets]))
        dev = self.device
        self._reset([t.reshape(-1).to(dev) for t in tokens], [t.reshape(-1).to(dev) for t in targets] if targets else None,
                    trains)
        self.measuring = trains and self.measure_at == self.sched.steps + 1
        self._timed, self._waits = {}, {}
        if self.measuring:
            self._time_barrier()
        self.shape = tuple(tokens[0].shape)
        if targets is not None and self.targets[0].numel() != self.tokens[0].numel():
            raise ValueError(f"zbpp vocab_parallel: a microbatch has {self.tokens[0].numel()} tokens and "
                             f"{self.targets[0].numel()} targets; the output layer reads one row a target")
        if not trains:
            # Forward-only: the whole batch's embedding in one collective, before any forward.
            whole = torch.cat(self.tokens)
            with torch.autocast(self.device.type, enabled=False):
                emb = self.vp.embedding.embed(whole, self._main)
            self.emb_all = list(emb.reshape(len(self.tokens), *self.shape, self.vp.hidden).unbind(0))
        elif self.sched._inferred_for is not True and not self.sched._meta_given:
            # The step's shape inference runs microbatch 0 forward first (_setup._infer_for).
            self.emb_first = self.vp.embedding.embed(self.tokens[0], self._main).reshape(*self.shape,
                                                                                          self.vp.hidden)

    def _share(self, mbs, root, what):
        """root's microbatches of integer ids on every rank (None where root has none): a header,
        then the ids. A root whose ids cannot be sent says why in the header, so every rank fails."""
        sc, m = self.sched, self.sched.n_microbatches
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device="cpu")
        why = None
        if sc.rank == root:
            why = _int_batch(mbs, what, m)
            if why is not None:
                header[0] = -1
            elif mbs is not None:
                header[0], header[1] = 1, mbs[0].dim()
                header[2:2 + mbs[0].dim()] = torch.tensor(mbs[0].shape, dtype=torch.int64, device="cpu")
        to = self.sched.timeout
        self._main.broadcast(header, root, timeout=to, channel=CHANNEL_DATA)
        if header[0] == -1:  # every rank says why
            text = torch.zeros(_WHY_BYTES, dtype=torch.uint8, device="cpu")
            if why is not None:
                raw = why.encode()[:_WHY_BYTES]
                text[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8, device="cpu")
            self._main.broadcast(text, root, timeout=to, channel=CHANNEL_DATA)
            said = bytes(text.tolist()).rstrip(b"\0").decode(errors="replace")
            raise ValueError(f"zbpp vocab_parallel: rank {root}'s step() arguments: {said}")
        if header[0] == 0:
            return None
        shape = tuple(int(x) for x in header[2:2 + int(header[1])])
        if sc.rank == root:
            data = torch.stack([t.detach().to("cpu", torch.int64) for t in mbs]).contiguous()
        else:
            data = torch.empty((m,) + shape, dtype=torch.int64, device="cpu")
        self._main.broadcast(data, root, timeout=to, channel=CHANNEL_DATA)
        return list(data.unbind(0))

    def _time_barrier(self):
        """A barrier's all-reduces timed with every rank there at once (all are in begin_step):
        the quickest of a few, of the size of one microbatch's C0. In the step itself a barrier
        also waits for the last rank's pass, which the plan's simulation adds by itself."""
        n, H = self._n(0), self.vp.hidden
        buf = torch.zeros(2 * n + (2 * n * H if self.vp.fused else 0), device=self.device)
        if self.device.type == "cuda":
            # An NCCL lane's collectives follow the lane's stream, not this thread's: buf first.
            torch.cuda.current_stream(self.device).synchronize()
        tr = self.lanes["S"].transport
        took = []
        for _ in range(5):
            t0 = time.perf_counter()
            tr.all_reduce(buf[:n], "max", timeout=self.sched.timeout, channel=CHANNEL_S)
            tr.all_reduce(buf, "sum", timeout=self.sched.timeout, channel=CHANNEL_S)
            took.append(time.perf_counter() - t0)
        self._timed["comm"] = [min(took[1:])]

    def end_step(self):
        """Every rank, after the runner: every lane's collectives done (then nothing of the step
        is held), a tied shard's IB gradient added; the losses."""
        try:
            for name, lane in self.lanes.items():
                lane.drain(f"the step's {name} collectives")
            if self.vp.tied:
                self.vp.embedding.flush_ib()
        finally:
            got = dict(self.losses)
            self._reset(None, None, False)
            for lane in self.lanes.values():
                lane.reset()
            self._box.reset()
        return [got.get(i) for i in range(self.sched.n_microbatches)]

    # ---- the passes (the runner's vocab callback) -------------------------------------------------

    def on_pass(self, kind, mb):
        # In float32 whatever autocast the caller's step runs under: the lanes' threads have none,
        # and one pass's parts must not mix precisions.
        with torch.autocast(self.device.type, enabled=False):
            getattr(self, "_pass_" + kind)(mb)

    def _clock(self):
        """perf_counter, and on CUDA, while measuring, after the current stream's work so far (a
        pass's kernels are timed from the host, so the stream is synchronised around them)."""
        if self.measuring and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def _time(self, kind, t0):
        if self.measuring:
            self._timed.setdefault(kind, []).append(self._clock() - t0)

    def _pass_IF(self, mb):
        if self.feed is not None:
            self._pass_IF_fed(mb)
            return
        t0 = self._clock()
        local = self.vp.embedding.embed_local(self.tokens[mb], check=False).contiguous()
        self._time("IF", t0)
        keep = self.sched.rank == self._roots()[0]  # only stage 0 reads the sum
        to = self.sched.timeout

        def reduce_if(tr):
            got = tr.all_reduce(local, "sum", timeout=to, channel=CHANNEL_IF)
            return got if keep else None

        self.lanes["IF"].start(mb, reduce_if)

    def _pass_IF_fed(self, mb):
        """IF when stage 0's forward reads the tokens: its rank sends them first, on the lane."""
        first, me = self._roots()[0], self.sched.rank
        emb, n, to = self.vp.embedding, self.feed.n, self.sched.timeout

        def reduce_if(tr):
            if me == first:
                tokens = self._box.get(mb, f"the tokens of microbatch {mb} (stage 0's forward)")
            else:
                tokens = torch.empty(n, dtype=torch.int64, device="cpu")
            tokens = _broadcast_ids(tr, tokens, first, emb.device, to, CHANNEL_IF)
            emb.check_tokens(tokens)  # the host copy (IB moves it to the device again)
            self.tokens[mb] = tokens
            t0 = self._clock()
            local = emb.embed_local(tokens, check=False).contiguous()
            self._time("IF", t0)
            got = tr.all_reduce(local, "sum", timeout=to, channel=CHANNEL_IF)
            return got if me == first else None

        self.lanes["IF"].start(mb, reduce_if)

    def _pass_S(self, mb):
        out, last = self.vp.output, self._roots()[1]
        to = self.sched.timeout
        if self.sched.rank != last:  # the last stage's rank started its side at its forward (hidden)
            buf = torch.empty(self._n(mb), self.vp.hidden, device=self.device)
            fed = torch.empty(self._n(mb), dtype=torch.int64, device="cpu") if self.feed is not None else None
            self.lanes["H"].start(mb, lambda tr: _send_hidden(tr, buf, fed, last, to))
        h, fed = self.lanes["H"].take(mb, f"the last stage's output of microbatch {mb}")
        if fed is not None:
            out.check_targets(fed)  # the host copy (fed mode's targets are checked here, once)
            self.targets[mb] = fed.to(self.device)
        t0 = self._clock()
        target = self.targets[mb]
        st = out.s_pass(h, target, check=False)
        self._time("S", t0)
        self.states[mb] = st
        keep = self.sched.rank == last  # only the last stage reads the gradient

        def c0(tr):
            loss = out.reduce(st, tr)
            if self.feed is None:
                mean = out.mean(loss, target)
                _handoff(mean)
                self.losses.append((mb, mean))
                g = out.grad_of_mean(target)  # 1 / the targets that count, each; 0 for ignore_index
            else:
                # The caller's loss on the per-token losses, on its rank; its gradient to every rank.
                g = self.feed.loss_grad(mb, loss) if keep else torch.empty(loss.shape, device=loss.device)
                g = tr.broadcast(g.detach().float().contiguous(), last, timeout=to, channel=CHANNEL_S)
            # What T (the compute stream) reads of this job's work.
            _handoff(st.M, st.sum, st.loss, getattr(st, "grad_unit", None), g)
            self._g[mb] = g
            # Fused: the last stage's output gradient, d(loss)/dh.
            return st.grad_unit * g.unsqueeze(1) if out.fused and keep else None

        self.lanes["S"].start(mb, c0)

    def _pass_T(self, mb):
        out = self.vp.output
        st = self.states.pop(mb)
        self.lanes["S"].wait(mb, f"the output layer's all-reduces of microbatch {mb}")
        t0 = self._clock()
        out.t_pass(st, self._g.pop(mb))
        self._time("T", t0)
        if not out.fused:
            keep = self.sched.rank == self._roots()[1]

            def c1(tr):
                got = out.reduce_grad(st, tr)
                return got if keep else None

            self.lanes["T"].start(mb, c1)

    def _pass_IB(self, mb):
        emb, first = self.vp.embedding, self._roots()[0]
        if self.sched.rank == first:
            grad = self.grads_in.pop(mb)
        else:
            grad = torch.empty(self._n(mb), self.vp.hidden, dtype=emb.weight.dtype, device=self.device)
        tied = self.vp.tied
        emb.prepare_ib(tied)  # made here, on the compute stream, which reads it after the step
        if self.feed is None:
            tokens = self.tokens[mb]
            self.lanes["IB"].start(mb, lambda tr: emb.embed_backward(tokens, grad, first, tr, tied=tied))
            return

        def fed_ib(tr):
            self.lanes["IF"].wait(mb, f"the tokens of microbatch {mb}")  # the IF lane received them
            return emb.embed_backward(self.tokens.pop(mb), grad, first, tr, tied=tied)

        self.lanes["IB"].start(mb, fed_ib)

    # ---- the stages' side -------------------------------------------------------------------------

    def embedding_of(self, mb):
        """Stage 0's input of microbatch mb: the embedding's SUM over the ranks."""
        if self.sched._infer_running and self.emb_first is not None:
            return self.emb_first
        if self.emb_all is not None:
            return self.emb_all[mb]
        t0 = time.perf_counter()
        e = self.lanes["IF"].take(mb, f"stage 0's input (the embedding of microbatch {mb})")
        if self.measuring:
            self._waits[("F", mb)] = time.perf_counter() - t0
        return e.reshape(*self.shape, self.vp.hidden).detach().requires_grad_(True)

    def embed_for_stage(self, mb, tokens):
        """Fed mode, stage 0's forward on its rank: its token ids to the IF lane, which sends them
        to every rank; the embedding's SUM over the ranks comes back ([tokens, hidden] float32,
        in the order of tokens.reshape(-1))."""
        ids = tokens.detach().reshape(-1).to("cpu", torch.int64)
        if ids.numel() != self.feed.n:
            raise ValueError(f"zbpp vocab_parallel: stage 0 embeds {ids.numel()} tokens in microbatch {mb}, the call's "
                             f"shape {self.feed.n}")
        self._box.put(mb, ids)
        t0 = time.perf_counter()
        e = self.lanes["IF"].take(mb, f"stage 0's input (the embedding of microbatch {mb})")
        if self.measuring:
            self._waits[("F", mb)] = time.perf_counter() - t0
        return e

    def give_targets(self, mb, targets):
        """Fed mode, the last stage's forward on its rank: the targets of its output's rows."""
        self._labels[mb] = targets.detach().reshape(-1).to("cpu", torch.int64).contiguous()

    def _rows(self, out, mb):
        """The last stage's output as the output layer's input: [tokens, hidden] float32."""
        n, H = self._n(mb), self.vp.hidden
        if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[-1] != H or out.numel() != n * H:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"zbpp vocab_parallel: the last stage must return the hidden states the output layer "
                             f"reads, [..., {H}] with one row per target ({n} a microbatch), got {got}")
        return out.detach().reshape(n, H).float().contiguous()

    def hidden(self, mb, out):
        """The last stage's forward, on its rank: its output to every rank (lane H)."""
        h = self._rows(out, mb)
        last, to = self._roots()[1], self.sched.timeout
        fed = None
        if self.feed is not None:
            fed = self._labels.pop(mb, None)
            if fed is None or fed.numel() != h.shape[0]:
                raise ValueError(f"zbpp vocab_parallel: the last stage gave {'no' if fed is None else fed.numel()} "
                                 f"targets for the {h.shape[0]} rows of microbatch {mb}")
        self.lanes["H"].start(mb, lambda tr: _send_hidden(tr, h, fed, last, to))

    def hidden_grad(self, mb, out):
        """The last stage's backward: the gradient of its output (fused: from C0; else from C1)."""
        t0 = time.perf_counter()
        g = self.lanes["S" if self.vp.fused else "T"].take(mb, f"the output layer's input gradient of microbatch {mb}")
        if self.measuring:
            self._waits[("B", mb)] = time.perf_counter() - t0
        return g.reshape(out.shape).to(out.dtype)

    def input_grad(self, mb, grad):
        """Stage 0's backward, on its rank: the embedding output's gradient, for IB."""
        H = self.vp.hidden
        dtype = self.vp.embedding.weight.dtype
        self.grads_in[mb] = (grad.detach().reshape(-1, H).to(dtype).contiguous() if grad is not None else
                             torch.zeros(self._n(mb), H, dtype=dtype, device=self.device))

    def forward_only_losses(self, outputs):
        """Forward-only, every rank, after the forwards: each microbatch's loss, or None without a
        target. outputs: the last stage's, on its rank."""
        if self.targets is None:
            self._reset(None, None, False)
            return None
        m, n, last = len(self.tokens), self.tokens[0].numel(), self._roots()[1]
        if self.sched.rank == last:
            h = torch.cat([self._rows(o, i) for i, o in enumerate(outputs)])
        else:
            h = torch.empty(m * n, self.vp.hidden, device=self.device)
        self._main.broadcast(h, last, timeout=self.sched.timeout, channel=CHANNEL_HIDDEN)
        out = self.vp.output
        # A microbatch at a time (its logits only), without the input gradient's parts.
        with torch.autocast(self.device.type, enabled=False):
            losses = [out.mean(out.reduce(out.s_pass(h[i * n:(i + 1) * n], self.targets[i], need_grad=False),
                                          self._main), self.targets[i]) for i in range(m)]
        self._reset(None, None, False)
        return losses

    # ---- the plan from measured times ------------------------------------------------------------

    def _my_times(self):
        """This rank's measured times (ms) of the step just run: the median of each stage op
        (type, stage), less the waits for the passes inside it, and of each pass's compute."""
        sc = self.sched
        starts, ends = sc._last_times
        last = sc._last_schedule.stages - 1
        ops = {}
        for op, a, b in zip(sc._last_schedule.rank_ops(sc.rank), starts, ends):
            if op.type not in ("F", "B", "W", "BW"):
                continue
            d = b - a
            if op.type == "F" and op.stage == 0:
                d -= self._waits.get(("F", op.mb), 0.0)
            elif op.type in ("B", "BW") and op.stage == last:
                d -= self._waits.get(("B", op.mb), 0.0)
            ops.setdefault(f"{op.type}{op.stage}", []).append(max(d, 0.0) * 1e3)
        med = {k: statistics.median(v) for k, v in ops.items()}
        passes = {k: statistics.median(v) * 1e3 for k, v in self._timed.items()}
        return {"ops": med, "passes": passes}

    def replan(self):
        """After MEASURE_STEP, on every rank: the kind planned again on every rank's measured
        times, taken when it steps shorter (see the module docstring)."""
        if not self.measuring:
            return
        self.measuring = False
        from ..schedule import Schedule
        from ._plan import REPLAN_MIN_GAIN

        sc = self.sched
        everyone = sc._exchange(self._my_times(), "Vocabulary Parallelism's measured times")
        ops, passes = {}, {}
        for g in everyone:
            ops.update(g["ops"])
            for k, v in g["passes"].items():
                passes.setdefault(k, []).append(v)
        S, p = sc._num_stages, sc.ranks
        f = [ops.get(f"F{s}", 0.0) for s in range(S)]
        b = [ops.get(f"B{s}", ops.get(f"BW{s}", 0.0) / 2) for s in range(S)]
        w = [ops.get(f"W{s}", ops.get(f"BW{s}", 0.0) / 2) for s in range(S)]
        vt = {k: statistics.median(passes.get(key, [0.0])) for k, key in
              (("s", "S"), ("t", "T"), ("if", "IF"), ("ib", "IF"), ("comm", "comm"))}
        times = {"f": f, "b": b, "w": w}
        old = sc.schedule
        args = dict(vocab=sc._vocab_args["vocab"], vocab_times=vt)
        placement = old.placement if old.placement in ("loop", "v") else [old.stage_rank(s) for s in range(S)]
        before = Schedule.from_ops([old.rank_ops(r) for r in range(p)], old.microbatches, placement=placement,
                                   v=old.chunks if isinstance(placement, str) else None, times=times, **args)
        saved = sc._vocab_args
        sc._vocab_args = args
        try:
            new = sc._generate(sc._kind_arg, p, sc.n_microbatches, S // p, times, sc._cost_args.get("mem_limit"))
        finally:
            sc._vocab_args = saved
        was, now = before.makespan(), new.makespan()
        before.close()
        switched = now < was * (1.0 - REPLAN_MIN_GAIN)
        self.replanned = self.vp.replanned = {"step": sc.steps, "stage_times": times, "vocab_times": vt,
                                              "switched": switched, "before_ms": was, "after_ms": now}
        _log.info("zbpp vocab_parallel: planned %s again on the times step %d measured (passes %s ms): %.1f ms "
                  "simulated against %.1f ms for the plan in force; %s", old.kind, sc.steps,
                  {k: round(v, 2) for k, v in vt.items()}, now, was, "switched" if switched else "kept")
        if not switched:
            new.close()
            return
        if sc.rank == 0:
            from .._notice import notice

            notice("replan", f"zbpp: {type(sc).__name__} with vocab_parallel planned {old.kind} again after step "
                             f"{sc.steps} from the stage and pass times it measured: the simulated step goes from "
                             f"{was:.4g} to {now:.4g} ms ({100 * (1 - now / was):.1f}% shorter); it runs from the next "
                             "step (plan_from_measured=False keeps the first plan; vocab_parallel.replanned has the "
                             "details; zbpp.quiet() or ZBPP_QUIET=1 silences this line)")
        sc._vocab_args = args
        sc._drop_runner()
        sc.schedule = new  # the old plan stays as _last_schedule (timeline() draws it) until the next step
        sc._check_stages()

    def scale_grads(self, divisor):
        for w in self.vp.parameters():
            if w.grad is not None:
                w.grad.div_(divisor)

    def close(self):
        for lane in (self.lanes or {}).values():
            lane.close()
            if lane._thread.is_alive() and getattr(lane.transport, "device_collectives", False):
                # Still inside a collective (a step that failed): end it before its transport goes.
                lane.transport.abort(f"rank {self.sched.rank}: the schedule was closed")
                lane._thread.join(timeout=10.0)
        self.lanes = None
        for tt in self._tts:
            tt.close()
        self._tts = []
        for t, backend in self._nccl:
            t.close()
            backend.close()
        self._nccl = []

    def abort(self, reason):
        """The pipeline failed on this rank: the lanes' peers learn it at once, through their
        transports, or, before those are made (a rank that fails before its first step's
        connect), through the lanes' failure keys, which a peer setting them up watches."""
        for tt in self._tts + [t for t, _ in self._nccl]:
            try:
                tt.abort(reason)
            except Exception:  # noqa: BLE001 - a best effort on the failure path
                pass
        sc = self.sched
        # Also when some lanes exist: a peer may be making the next lane's communicator, which
        # watches that lane's key (the first text published under a key stays).
        store = sc._job_store() if sc.ranks > 1 else None
        if store is not None:
            text = f"rank {distributed.global_rank(sc.group, sc.rank)} failed first: {reason}"
            for k in _LANES:
                try:
                    distributed.publish_failure(store, distributed.abort_key(self._lane_name(k)), text)
                except Exception:  # noqa: BLE001 - a best effort on the failure path
                    pass
