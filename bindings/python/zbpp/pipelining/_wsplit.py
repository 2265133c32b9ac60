"""Which backwards a schedule splits into B and W, and how (the stage's split_backward).

What this is: the mixin that, for each backward the runner calls, says whether the schedule runs
its W apart (a B op with a W op of its own, as the zero-bubble kinds place them; a BW op is a
fused backward), and then splits it for any module: nn.Linear layers become zbpp.SplitLinear
before the first step (their W is a GEMM in the W store), and every other trainable parameter gets
its W through the autograd graph (zbpp._autograd_split). It also notices a schedule whose W ops
stay empty (split_backward=False, stages without trainable parameters) and says so once, since
the zero bubble is then lost without any other sign.
What this is not: the W store (zbpp.split) or the graph split itself (zbpp._autograd_split).
"""

import logging

import torch

from .. import splitters

_log = logging.getLogger("zbpp")


def _marked(callback):
    """The runner's callback, marking what it raises as the stage's own failure (_run_iteration
    raises those themselves, not the runner's ZbError)."""
    def call(*args):
        try:
            return callback(*args)
        except Exception as exc:
            exc._zbpp_in_stage = True
            raise

    return call


_BASE = []  # PipelineSchedule, once asked for (it imports this module)


def _base():
    if not _BASE:
        from . import PipelineSchedule

        _BASE.append(PipelineSchedule)
    return _BASE[0]


class _Splitting:
    """PipelineSchedule's B/W split (a mixin: it uses the schedule's stages, store and plan)."""

    def _stage_splits(self, stage):
        """Whether `stage` splits its backwards: the schedule's split_backward, else the stage's,
        and never with a dw_builder (torch's own W) or a schedule that backpropagates the loss its
        own way (a subclass's _loss_backward, as the Megatron adapter's)."""
        if stage is None or getattr(stage, "dw_builder", None) is not None:
            return False
        if type(self)._loss_backward is not _base()._loss_backward:
            return False
        wanted = self._split_arg if self._split_arg is not None else getattr(stage, "split_backward", True)
        return bool(wanted)

    def _apart(self):
        """(schedule, {(stage, mb) of this rank's B ops whose W runs apart}, the last of them in
        this rank's order), for the schedule the runner runs."""
        if self._split_for is None or self._split_for[0] is not self.schedule:
            ops = [(op.stage, op.mb) for op in self.schedule.rank_ops(self.rank) if op.type == "B"]
            self._split_for = (self.schedule, set(ops), ops[-1] if ops else None)
            self._w_work, self._w_seen = {}, False
        return self._split_for

    def _prepare_split(self):
        """Before a runner starts: the nn.Linear layers of every stage that will split become
        SplitLinear (a class swap in place; outside a pipeline they behave as nn.Linear)."""
        if self.schedule is None:
            return
        stages_apart = {s for s, _ in self._apart()[1]}
        for st in self.stages:
            if st.stage_index in stages_apart and self._stage_splits(st):
                splitters.split(st.submod, warn=False)

    def _splits(self, s, i, stage, dw_builder):
        """None: this backward is fused (no W op of its own); True: split it here; False: its W
        runs apart but this stage does not split (what layers deferred by themselves is W)."""
        if (s, i) not in self._apart()[1]:
            return None
        return self._stage_splits(stage)

    def _split_backward(self, stage, outputs, grads, inputs):
        """B of a split backward (inside the B's capture): input gradients now, the rest pushed to
        the W store as this microbatch's W."""
        if not self._graph_split_pays(stage) and any(
                isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            # What the layer splitters leave is norms' scales and biases only: their gradients are
            # row sums, cheaper than the graph walk that would move them (measured while writing
            # this: the walk and its per-group W calls cost about 1.5 ms a microbatch on
            # bench_torch's GPT stage, the norms' gradients under 0.1 ms). B computes them with the
            # input gradients; the split layers' W is still the store's. (A stage with no input
            # gradient to send runs its whole backward at W below, as torch's.)
            torch.autograd.backward(outputs, grads)
            return
        # Every trainable parameter, those of split layers too: the graph walk leaves out the edges
        # from a split layer's own backward (its W is the store's), so a weight it shares with
        # another use (tied, or passed to a functional call) still gets that use's gradient here.
        params = [prm for prm in self._stage_params(stage) if prm.requires_grad]
        weight = self._generic_splitter().backward_input(outputs, grads, inputs, params,
                                                          accumulators=self._params_cache[2])
        if weight is not None:
            self._store.push_action(_marked(weight))

    def _stage_params(self, stage):
        """The parameters of stage's module, read from the module once per step (every B of a
        step asks; walking the module tree each time cost as much as a small layer's graph walk).
        Whether each requires a gradient is asked at each B. The step's cache also keeps the
        parameters' gradient accumulators for the graph split (backward_input's accumulators)."""
        cache = self._params_cache
        if cache[0] != self.steps:
            cache = self._params_cache = (self.steps, {}, {})
        got = cache[1].get(stage.stage_index)
        if got is None or got[0] is not stage.submod:
            got = cache[1][stage.stage_index] = (stage.submod, list(stage.submod.parameters()))
        return got[1]

    def _graph_split_pays(self, stage):
        """Whether the graph split has work worth moving on `stage`: a trainable parameter of two
        or more dimensions that no layer splitter defers (a weight tied between a split layer and
        another use counts, as splitters.partition keeps it in `remaining`), or no layer splitter
        deferring anything (the graph split is then the stage's only W). Asked once per step and
        stage (requires_grad may change between steps)."""
        cache = self._params_cache
        if cache[0] != self.steps:
            cache = self._params_cache = (self.steps, {}, {})
        key = ("pays", stage.stage_index)
        got = cache[1].get(key)
        if got is None or got[0] is not stage.submod:
            part = splitters.partition(stage.submod)
            # Nothing deferred by a layer splitter: the graph split is all the W there is.
            pays = not part.deferred or any(prm.dim() >= 2 for prm in part.remaining)
            got = cache[1][key] = (stage.submod, pays)
        return got[1]

    def _generic_splitter(self):
        """zbpp._autograd_split (splitters.autograd_splitter), looked up once; it registers the
        active families' deferring Functions itself when new modules were imported."""
        if self._generic is None:
            self._generic = splitters.autograd_splitter()
        return self._generic

    def _check_w_work(self):
        """At this rank's last split B of a step: if no stage left any W work, say why, once."""
        work, seen, self._w_work, self._w_seen = self._w_work, self._w_seen, {}, False
        if seen or self._w_empty_warned:
            return
        self._w_empty_warned = True
        reasons = []
        for st in self.stages:
            if st.stage_index not in work:
                continue
            if not any(prm.requires_grad for prm in st.submod.parameters()):
                reasons.append(f"stage {st.stage_index} has no trainable parameters")
            elif not self._stage_splits(st):
                reasons.append(f"stage {st.stage_index} has split_backward=False")
            else:
                reasons.append(f"stage {st.stage_index}'s parameters get no gradient")
        _log.warning("zbpp.%s: the schedule has W ops, but on rank %d they are empty (%s): B runs the whole "
                     "backward and the zero bubble is lost. Leave split_backward on (the default) so that "
                     "weight gradients move to W, or use a schedule without W (Schedule1F1B, "
                     "ScheduleInterleaved1F1B).", type(self).__name__, self.rank, "; ".join(reasons))


def measured_w_share(schedule):
    """The share of the backward's measured time spent in W ops (W / (B + W + BW)), over every
    rank of a measured timeline; 0.0 when every backward ran fused."""
    w = total = 0.0
    for r in range(schedule.ranks):
        starts, ends = schedule.rank_times(r)
        for op, a, b in zip(schedule.rank_ops(r), starts, ends):
            if op.type in ("B", "W", "BW"):
                total += b - a
                if op.type == "W":
                    w += b - a
    return w / total if total > 0 else 0.0
