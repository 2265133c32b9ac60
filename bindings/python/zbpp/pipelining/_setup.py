"""Set-up messages between the pipeline's ranks, outside the runner: shape inference and
forward-only passes.

What this is: the PipelineSchedule mixin that sends activations with their descriptions over the
pipeline's group (or its CPU group, see _messages) where the C runner does not: shape inference
(microbatch 0 forward through every stage once, where and how torch 2.13 runs its metadata
inference: _infer_for) and eval() / forward-only steps. Every wait is bounded by the schedule's timeout and watches the pipeline's
failure key (_agree.py), on a helper thread (distributed.wait_watched): a rank whose forward
raised during inference fails its peers within a second instead of leaving them in a blocking
receive until gloo's own timeout.
What this is not: the runner's transfers (the transports in distributed.py and the C library).
"""

import datetime

import torch
import torch.distributed as dist

from .. import _lib, distributed, runtime
from ._boundary import _META_LEN, _META_TAG, _as_tuple, _decode, _encode, _meta_of


class _SetUp:
    """PipelineSchedule's set-up messages (a mixin; see the module docstring)."""

    def _holder(self, stage):
        return self.schedule.stage_rank(stage)

    def _infer_for(self, trains):
        """torch's metadata inference, where torch runs it: at the first step, and again at the
        first step after the pipeline switched between training and eval() (torch 2.13's
        _initialize_pp_stages re-initializes its stages then). Every stage's module is called once
        more on microbatch 0 each time, as torch calls it, so a module that counts its calls or
        keeps statistics sees torch's numbers. A training inference also gives the boundaries'
        shapes (_meta, the runner's buffer sizes); an eval one only its calls, since forward-only
        steps send each activation with its shape. Stages built with input_args and output_args
        on every rank infer nothing, as torch's (the vote below), nor does a Megatron-style subclass
        that fills _meta itself (_meta_given)."""
        if self._meta_given or self._inferred_for == trains:
            return
        # torch's vote: when every stage of every rank was given input_args and output_args, their
        # shapes are the boundaries' and nothing runs (its STATIC mode); else every rank infers.
        given = self._exchange(self._given_meta(), "the shape vote of the first step") if self.ranks > 1 \
            else [self._given_meta()]
        if all(g is not None for g in given):
            S = self._num_stages
            meta = {s: m for g in given for s, m in g.items() if s < S - 1}
        else:
            meta = self._infer_shapes(trains)
        self._inferred_for = trains
        if not trains:
            return
        if self._runner is not None and meta != self._meta:
            # The batch changed shape while the pipeline was in eval(): buffers of the new sizes.
            self._runner.close()
            self._runner = None
            if self._dviews is not None:
                self._dviews.clear()
        self._meta = meta
        self._shapes_known = True

    def _given_meta(self):
        """{stage: [(dtype, shape)] of its output} from the example tensors this rank's stages were
        built with (PipelineStage's input_args and output_args), or None when one lacks either."""
        out = {}
        for st in self.stages:
            inputs, outputs = getattr(st, "_user_args", (None, None))
            if inputs is None or outputs is None:
                return None
            if st.stage_index < self._num_stages - 1:  # the loss stage's output crosses no boundary
                out[st.stage_index] = _meta_of(_as_tuple(outputs), st.stage_index)
        return out

    def _infer_shapes(self, trains=False):
        """Runs microbatch 0 forward through every stage once, in stage order, passing the real
        activations on, so every rank learns its boundaries' shapes; returns them ({boundary:
        [(dtype, shape)]}). As torch's inference: with gradients enabled when the pipeline trains
        (no_grad otherwise), and when it trains the loss stage's loss_fn runs on its output and
        microbatch 0's target. Nothing of it is kept: no backward runs, and the random streams and
        the modules' buffers are as they were before."""
        S = self.stages[0].num_stages
        # The extra forward must not move the random streams (dropout): the first step then draws
        # the same numbers as a run without inference would.
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self._cuda else None
        # Nor may it move the modules' buffers (BatchNorm's running statistics and its counter): the
        # first step must start from the state the user built.
        buffers = [(b, b.detach().clone()) for st in self.stages for b in st.submod.buffers()]
        self._infer_running = True
        try:
            with torch.enable_grad() if trains else torch.no_grad():
                return self._infer_loop(S, trains)
        finally:
            self._infer_running = False
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    def _infer_loop(self, S, trains):
        carry, meta = None, {}
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
                    inputs, meta[s - 1] = self._recv_activation(prev)
                kwargs = {}
            out = self._run_stage(s, 0, inputs, kwargs)
            if s == S - 1:
                if trains and self._loss_fn is not None and self._mb_target is not None:
                    self._loss_fn(out, self._mb_target[0], **self._loss_kwargs)
                break
            out = _as_tuple(out)
            meta[s] = _meta_of(out, s)
            nxt = self._holder(s + 1)
            if nxt == self.rank:
                carry = tuple(t.detach() for t in out)
            else:
                self._send(_encode(meta[s]), nxt)
                for t in out:
                    self._send(t.detach().contiguous(), nxt)
        return meta

    def _recv_activation(self, rank):
        """An activation `rank` sends with its description first (shape inference, forward-only
        runs): (tensors, [(dtype, shape)])."""
        meta_t = torch.zeros(_META_LEN, dtype=torch.int64, device="cpu")
        self._recv(meta_t, rank)
        meta = _decode(meta_t)
        inputs = tuple(torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in meta)
        for t in inputs:
            self._recv(t, rank)
        return inputs, meta

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
        t = t.to(device)
        work = self._post(dist.isend, t, rank, group, "send to")
        self._wait_setup(work, group, rank, "send to")

    def _recv(self, t, rank):
        group, device = self._messages()
        buf = t if t.device == device else torch.empty_like(t, device=device)
        work = self._post(dist.irecv, buf, rank, group, "receive from")
        self._wait_setup(work, group, rank, "receive from")
        if buf is not t:
            t.copy_(buf)

    def _post(self, op, t, rank, group, what):
        """dist.isend / dist.irecv of a set-up message; a peer gloo already knows is gone (its
        connection closed) is a ZbError naming it, or the failure it published first."""
        peer = distributed.global_rank(self.group, rank)
        try:
            return op(t, peer, group=group, tag=_META_TAG)
        except RuntimeError as exc:
            failed = self._peer_failure()
            if failed is not None:
                raise self._remote_error(f"{self._setup_where()}: {what} rank {rank} stopped", failed) from None
            raise _lib.ZbError(runtime.ZB_ERR_REMOTE, f"rank {self.rank}, {self._setup_where()}: {what} rank {rank} "
                               f"failed: {distributed.first_line(exc)}") from None

    def _setup_where(self):
        return "shape inference" if self._infer_running else "a forward-only step"

    def _wait_setup(self, work, group, peer, what):
        """Waits for a set-up message, at most the schedule's timeout, failing at once when a rank
        publishes a failure (gloo groups; an NCCL message group's wait only orders the stream)."""
        where = self._setup_where()
        if self._messages()[1].type != "cpu" or self._job_store() is None:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            return
        if self._setup_waiter is None:
            self._setup_waiter = distributed._Waiter()
        try:
            failed = distributed.wait_watched(self._setup_waiter, work, group, peer, self.timeout, self._peer_failure)
        except RuntimeError as exc:
            failed = self._peer_failure()
            if failed is None:
                text = distributed.first_line(exc)
                timed_out = "timed out" in text.lower() or "timeout" in text.lower()
                raise _lib.ZbError(runtime.ZB_ERR_TIMEOUT if timed_out else runtime.ZB_ERR_REMOTE,
                                   f"rank {self.rank}, {where}: {what} rank {peer} "
                                   + (f"got nothing within {self.timeout:g} s (the schedule's timeout=)"
                                      if timed_out else f"failed: {text}")) from None
        if failed is not None:
            raise self._remote_error(f"{where}: {what} rank {peer} stopped", failed)

    def _forward_only(self):
        """Every microbatch forward through every stage, without gradients, passing activations
        on with their shapes (so they may change between eval steps): eval(), _ScheduleForwardOnly
        and pipelines without a loss_fn. The loss stage keeps the outputs and, with a loss_fn and a
        target, the losses. Stages run in microbatch, then stage order on every rank; sends do not
        wait, so rank r works on microbatch i+1 while rank r+1 has microbatch i."""
        S, m = self._num_stages, self.n_microbatches
        self._outputs, self._losses = [None] * m, [None] * m
        group, device = self._messages()
        pending = []

        def send(t, rank):
            t = t.to(device)
            pending.append((t, self._post(dist.isend, t, rank, group, "send to"), rank))

        with torch.no_grad():
            for i in range(m):
                carry = None
                for s in range(S):
                    if self._holder(s) != self.rank:
                        continue
                    if s == 0:
                        inputs, kwargs = self._first_inputs(i)
                    else:
                        prev = self._holder(s - 1)
                        if prev == self.rank:
                            inputs = carry
                        else:
                            inputs, _ = self._recv_activation(prev)
                        kwargs = {}
                    out = self._run_stage(s, i, inputs, kwargs)
                    if s == S - 1:
                        self._outputs[i] = out
                        if self._loss_fn is not None and self._mb_target is not None:
                            self._losses[i] = self._loss_fn(out, self._mb_target[i], **self._loss_kwargs)
                        continue
                    outs = _as_tuple(out)
                    nxt = self._holder(s + 1)
                    if nxt == self.rank:
                        carry = outs
                    elif self.ranks > 1:
                        send(_encode(_meta_of(outs, s)), nxt)
                        for t in outs:
                            send(t.contiguous(), nxt)
        for _, work, rank in pending:
            self._wait_setup(work, group, rank, "send to")
