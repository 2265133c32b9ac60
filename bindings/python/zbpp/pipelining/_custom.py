"""torch's custom functions (`_PipelineScheduleRuntime.register_custom_function`) on zbpp's runner.

What a user gets: torch's protocol. `register_custom_function(FORWARD, fn)` (or FULL_BACKWARD,
BACKWARD_INPUT, BACKWARD_WEIGHT, OVERLAP_F_B) makes zbpp call `fn(action, ctx)` in place of its own work for every
action of that type on this rank, with `ctx` torch's `_PipelineContext` (schedule_ref, arg_mbs,
kwarg_mbs, target_mbs, losses). The function does the work through torch's calls, which zbpp's
stages and schedules answer: `stage.forward_one_chunk(mb, args, kwargs)` runs the stage's forward
and returns its output, `stage.backward_one_chunk(mb, loss=..., full_backward=..., last_backward=...)`
its backward, `schedule._maybe_get_loss(stage, mb)` gives the loss, `stage.scale_grads(f)` divides
the stage's gradients; `schedule.fwd_recv_ops` / `bwd_recv_ops` hold an entry (an empty list of
works) for each input the runner has received for the action, which torch's `_wait_batch_p2p`
waits on at no cost; `set_local_fwd_input`, `set_local_bwd_input` and `get_local_bwd_output` (V
stages on one rank) are accepted and do nothing, since the runner hands those over itself. A
function that does not call the stage's work fails the step, naming the action (the runner would
otherwise send a buffer nobody filled).

OVERLAP_F_B: with a function registered, the runner runs each pair as one unit (both inputs
received first, both outputs sent after: zb_runner_config_t.pair_first), and the function gets the
pair's action with its sub_actions, free to run the forward and the backward in any order or
interleaved (on two CUDA streams, say: DualPipe's overlap). Without one, a pair is its forward and
then its backward, as before.

BACKWARD_WEIGHT: W ops run in C, from the W store. With a function registered, each split B (an I
action) of the rank also queues one Python entry last in its microbatch's W group, so at the W op,
after zbpp's own W work for that microbatch (split layers' GEMMs, the autograd split), the runner
calls the function with the W action; `stage.backward_weight_one_chunk(mb)` inside it runs what
the stage's dw_builder returned at that B (torch's dw_runner; nothing without a dw_builder, since
zbpp's W work has run). A function that does not call it leaves that work undone, as in torch.

What this is not: UNSHARD, RESHARD and REDUCE_GRAD (zbpp runs no FSDP stages and drops
REDUCE_GRAD) raise NotImplementedError when registered.
"""

import collections
import logging

from ._torch import need

_log = logging.getLogger("zbpp.pipelining")

_TORCH_TYPES = ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "OVERLAP_F_B", "UNSHARD", "RESHARD",
                "REDUCE_GRAD")
_UNSUPPORTED = {
    "UNSHARD": "zbpp does not run FSDP-sharded stages",
    "RESHARD": "zbpp does not run FSDP-sharded stages",
    "REDUCE_GRAD": "zbpp's orders drop REDUCE_GRAD (it scales gradients by its own scale_grads)",
}


class _Schedules:
    """torch's schedules module, imported on first use (zbpp.pipelining imports on torches without
    torch.distributed.pipelining too)."""

    def __getattr__(self, name):
        return getattr(need("schedules"), name)


_s = _Schedules()


def _context(schedule, losses):
    ctx_cls = getattr(_s, "_PipelineContext", None)
    m = schedule.n_microbatches
    # As torch: every rank's arg_mbs and kwarg_mbs have an entry per microbatch (empty where the
    # rank holds no first stage and was given no inputs).
    args = (schedule, getattr(schedule, "_mb_args", None) or [()] * m,
            getattr(schedule, "_mb_kwargs", None) or [{}] * m, getattr(schedule, "_mb_target", None), losses)
    if ctx_cls is not None:
        return ctx_cls(*args)
    return collections.namedtuple("_PipelineContext", "schedule_ref arg_mbs kwarg_mbs target_mbs losses")(*args)


class CustomFunctions:
    """Mixin for _PipelineScheduleRuntime: the registry, the runner callbacks that consult it, and
    what the stages' torch calls run."""

    def __init__(self, *args, **kwargs):
        self._custom_init()
        super().__init__(*args, **kwargs)

    def _custom_init(self):
        self._custom = {}
        self._op_kind = {}
        self.fwd_recv_ops = {}
        self.bwd_recv_ops = {}
        self.backward_counter = collections.defaultdict(int)
        self._io = {}  # ("F" | "B", stage, mb) -> (input address, output address) of the action being run
        self._done = set()  # the same keys, once the user's function ran their work
        self._pair_of = {}  # ("B", stage, mb) -> the OVERLAP_F_B action whose second half it is
        self._pair_head = set()  # ("F", stage, mb) that open such a pair
        self._user_losses = None
        self._scaled = set()  # stages whose gradients a custom function scaled this step
        self._dw_runner = {}  # (stage, mb) -> what dw_builder() returned at its B (None without one)
        self._w_running = None  # (stage, mb) of the W action whose custom function is running

    def register_custom_function(self, computation_type, custom_function):
        """torch's: `custom_function(action, ctx)` does the work of every action of this type on
        this rank from the next step on (see zbpp/pipelining/_custom.py)."""
        name = getattr(computation_type, "name", str(computation_type))
        if name not in _TORCH_TYPES or not isinstance(computation_type, _s._ComputationType):
            raise ValueError(f"Invalid computation type {computation_type}. Only FORWARD, FULL_BACKWARD, "
                             "BACKWARD_INPUT, BACKWARD_WEIGHT, OVERLAP_F_B, UNSHARD, RESHARD and REDUCE_GRAD "
                             "are supported.")
        if name in _UNSUPPORTED:
            raise NotImplementedError(f"zbpp.{type(self).__name__}.register_custom_function({name}): "
                                      f"{_UNSUPPORTED[name]}; FORWARD, FULL_BACKWARD, BACKWARD_INPUT, "
                                      "BACKWARD_WEIGHT and OVERLAP_F_B take custom functions")
        if not callable(custom_function):
            raise TypeError(f"zbpp: the custom function for {name} must be callable, got "
                            f"{type(custom_function).__name__}")
        if computation_type in self._custom:
            _log.warning("Computation type %s is already registered. Overwriting the existing custom function.",
                         computation_type)
        self._custom[computation_type] = custom_function
        if name == "OVERLAP_F_B" and self._runner is not None:
            self._runner.close()  # the pairs are part of the runner's configuration
            self._runner = None

    # ---- the runner's configuration and callbacks ---------------------------------------------------

    def _custom_step(self, losses):
        """At the start of a step: torch's per-step state."""
        self.backward_counter.clear()
        self._scaled.clear()
        self._dw_runner.clear()  # a W function that never ran one leaves it undone (as torch's)
        self._user_losses = losses

    def _runner_pairs(self):
        """Indices into this rank's op list where an OVERLAP_F_B pair starts, when a function for
        OVERLAP_F_B is registered (else none: pairs run as two ops)."""
        self._pair_of, self._pair_head = {}, set()
        ops = [(op.type, op.stage, op.mb) for op in self.schedule.rank_ops(self.rank)]
        self._op_kind = {(s, i): t for t, s, i in ops if t in ("B", "BW")}
        if _s.OVERLAP_F_B not in self._custom:
            return ()
        order = self.pipeline_order
        actions = order.get(self.rank, []) if order else []
        from ._order import _compute

        pairs, expanded = [], []  # expanded: the actions as the ops they run, to check against the plan
        for step, action in enumerate(actions):
            mine = _compute(action, self.rank, step)
            if action is not None and action.computation_type == _s.OVERLAP_F_B:
                if len(mine) != 2 or mine[0][0] != "F" or mine[1][0] not in ("B", "BW"):
                    raise ValueError(f"zbpp: {action} on rank {self.rank}: a custom OVERLAP_F_B function needs "
                                     "pairs of one forward and one backward (F then I or B)")
                pairs.append(len(expanded))
                self._pair_head.add(("F", mine[0][1], mine[0][2]))
                self._pair_of[("B", mine[1][1], mine[1][2])] = action
            expanded += mine
        if ops != expanded:
            raise RuntimeError(f"zbpp: rank {self.rank}'s pipeline_order does not match the plan it runs; "
                               "set pipeline_order again before registering OVERLAP_F_B")
        return pairs

    def _on_forward(self, s, i, in_addr, out_addr):
        key = ("F", s, i)
        if not self._custom:
            return self._forward(s, i, in_addr, out_addr)
        self._io[key] = (in_addr, out_addr)
        if key in self._pair_head:
            return None  # run inside the pair's function, at its backward's callback
        fn = self._custom.get(_s.FORWARD)
        if fn is None:
            self._io.pop(key)
            return self._forward(s, i, in_addr, out_addr)
        self._call_custom(fn, _s._Action(s, _s.FORWARD, i), [key])
        return None

    def _on_backward(self, s, i, gout_addr, gin_addr):
        if _s.BACKWARD_WEIGHT in self._custom and self._op_kind.get((s, i)) == "B":
            return self._with_w_function(s, i, lambda: self._dispatch_backward(s, i, gout_addr, gin_addr))
        return self._dispatch_backward(s, i, gout_addr, gin_addr)

    def _dispatch_backward(self, s, i, gout_addr, gin_addr):
        key = ("B", s, i)
        if not self._custom:
            return self._backward(s, i, gout_addr, gin_addr)
        self._io[key] = (gout_addr, gin_addr)
        pair = self._pair_of.get(key)
        if pair is not None:
            f = pair.sub_actions[0]
            self._call_custom(self._custom[_s.OVERLAP_F_B], pair, [("F", f.stage_index, f.microbatch_index), key])
            return None
        full = self._op_kind.get((s, i)) == "BW"
        fn = self._custom.get(_s.FULL_BACKWARD if full else _s.BACKWARD_INPUT)
        if fn is None:
            self._io.pop(key)
            return self._backward(s, i, gout_addr, gin_addr)
        self._call_custom(fn, _s._Action(s, _s.FULL_BACKWARD if full else _s.BACKWARD_INPUT, i), [key])
        return None

    def _with_w_function(self, s, i, backward):
        """Runs a split B so that its W op calls the BACKWARD_WEIGHT function (module docstring): the
        stage's dw_builder is built here, as torch builds it at the B, and kept for
        backward_weight_one_chunk; the entry the function runs from goes last in the W group (in
        dw_builder's place, which _backward pushes, or after the backward without one)."""
        from . import _marked

        stage = self._by_index[s]
        user = getattr(stage, "dw_builder", None)
        self._dw_runner[(s, i)] = None
        entry = _marked(lambda: self._run_w_function(s, i))
        if user is None:
            out = backward()
            self._store.push_action(entry)  # still inside the runner's B callback: this B's W group
            return out

        def builder():
            self._dw_runner[(s, i)] = user()
            return entry

        stage.dw_builder = builder  # what _backward reads and pushes; the user's again right after
        try:
            return backward()
        finally:
            stage.dw_builder = user

    def _run_w_function(self, s, i):
        self._w_running = (s, i)
        try:
            self._custom[_s.BACKWARD_WEIGHT](_s._Action(s, _s.BACKWARD_WEIGHT, i), _context(self, self._user_losses))
        finally:
            self._w_running = None

    def _call_custom(self, fn, action, keys):
        for kind, s, i in keys:
            if kind == "F" and s > 0 and (s - 1) not in self._by_index:
                self.fwd_recv_ops[(s, i)] = []  # the runner has received it: nothing left to wait for
            elif kind == "B" and s < self._num_stages - 1 and (s + 1) not in self._by_index:
                self.bwd_recv_ops[(s, i)] = []
        try:
            fn(action, _context(self, self._user_losses))
            missing = [k for k in keys if k not in self._done]
            if missing:
                what = ", ".join(f"{'forward_one_chunk' if k[0] == 'F' else 'backward_one_chunk'}({k[2]}) of stage {k[1]}"
                                 for k in missing)
                raise RuntimeError(f"zbpp: the custom function for {action} returned without calling {what}; "
                                   "the runner sends what that work produces, so it must run inside the function")
        finally:
            for kind, s, i in keys:
                self._io.pop((kind, s, i), None)
                self._done.discard((kind, s, i))
                (self.fwd_recv_ops if kind == "F" else self.bwd_recv_ops).pop((s, i), None)

    # ---- what the stages' torch calls run -----------------------------------------------------------

    def _custom_run(self, kind, s, i):
        key = (kind, s, i)
        io = self._io.get(key)
        if io is None:
            call = "forward_one_chunk" if kind == "F" else "backward_one_chunk"
            raise RuntimeError(f"zbpp: stage {s}.{call}({i}) is not the work of the action being run; inside a "
                               "custom function a stage runs the microbatch of that action (or of its pair's "
                               "sub-actions) only")
        if key in self._done:
            raise RuntimeError(f"zbpp: stage {s}, microbatch {i}: its {'forward' if kind == 'F' else 'backward'} "
                               "already ran in this action")
        self._done.add(key)
        if kind == "F":
            return self._forward(s, i, *io)
        self._backward(s, i, *io)
        return None

    def _custom_run_w(self, s, i):
        """stage.backward_weight_one_chunk(i) inside a BACKWARD_WEIGHT function: runs the function
        dw_builder returned at this microbatch's B, once."""
        if self._w_running != (s, i):
            raise RuntimeError(f"zbpp: stage {s}.backward_weight_one_chunk({i}) is not the work of the action being "
                               "run; it runs inside the custom function of that microbatch's BACKWARD_WEIGHT action")
        if not self._by_index[s].has_backward:
            return
        if (s, i) not in self._dw_runner:
            raise AssertionError(f"zbpp: stage {s}: backward_weight_one_chunk({i}) ran already in this action, or "
                                 "without its backward_one_chunk(full_backward=False) first")
        runner = self._dw_runner.pop((s, i))
        if runner is not None:
            runner()

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        """torch's: zbpp's forward of the loss stage has computed the loss already."""
        return None

    def _maybe_get_loss(self, stage, mb_index):
        """torch's: the loss of microbatch mb_index when `stage` is the loss stage, else None."""
        if stage.stage_index != self.loss_stage:
            return None
        held = self._ctx.get((stage.stage_index, mb_index))
        return held[2] if held is not None else None

    def _custom_scale(self, stage, factor):
        self._scaled.add(stage.stage_index)
        if factor != 1:
            self._scale_stage(stage, factor)
