"""torch's schedule IR on zbpp's schedules: pipeline_order and its CSV form.

What this is: the PipelineSchedule mixin with torch's pipeline_order (the plan as _Action lists,
settable: a user's order then runs, validated by the C library), pipeline_order_with_comms,
_prepare_schedule_with_comms, _load_csv, _dump_csv and _validate_and_set_stage_mapping, as
torch.distributed.pipelining's schedules have them. _order.py converts between the forms.
What this is not: a second runtime; every order runs on the C runner.
"""


class _TorchIR:
    """PipelineSchedule's torch IR (a mixin; see the module docstring)."""

    @property
    def pipeline_order(self):
        """The plan as torch's IR: {rank: [_Action, ...]} for every rank (F, I, W and B for full
        backward; no idle steps), made from the plan in force. Setting it (or _load_csv, or
        _prepare_schedule_with_comms) makes the next step run that order instead, once the C
        library has validated it (zbpp/pipelining/_order.py says what it reads); an order that was
        set may then be changed in place too."""
        if not self._order_user and self.schedule is not None and self._order_schedule is not self.schedule:
            from ._order import to_actions

            self._order = to_actions(self.schedule)
            self._order_schedule = self.schedule
        return self._order

    @pipeline_order.setter
    def pipeline_order(self, order):
        if getattr(self, "_vp", None) is not None:
            raise ValueError(f"zbpp.{type(self).__name__}: its plan has Vocabulary Parallelism's passes "
                             "(vocab_parallel=), which torch's order has no actions for; it runs its kind's plan")
        self._order = order
        self._order_user = True
        self._order_seen = None
        self._order_comms = self._order_comms_from = None

    @property
    def pipeline_order_with_comms(self):
        """The order with torch's transfer actions (torch's own lowering of pipeline_order, or
        what was set). Setting it runs that order: its transfers are dropped (the runner makes
        its own), the rest is as setting pipeline_order."""
        order = self.pipeline_order
        if order is None:
            return None
        if self._order_comms is not None and self._order_comms_from is None:
            return self._order_comms  # as the user set it
        made_from = (self.schedule, {r: list(a) for r, a in order.items()})
        if self._order_comms is None or self._order_comms_from[0] is not made_from[0] \
                or self._order_comms_from[1] != made_from[1]:
            # made again after a replan or a change to the order
            from ._order import with_comms

            current = not self._order_user or self._order_schedule is self.schedule  # the plan runs this order
            self._order_comms = with_comms(order, self.schedule if current else None, self.ranks, self._num_stages,
                                           self.n_microbatches)
            self._order_comms_from = made_from
        return self._order_comms

    @pipeline_order_with_comms.setter
    def pipeline_order_with_comms(self, actions):
        self.pipeline_order = {r: list(a) for r, a in actions.items()}
        self._order_comms = actions
        self._order_comms_from = None  # the user's own: kept as given

    def _sync_order(self):
        """Before a step: runs the pipeline_order the user set or changed, as a zbpp schedule."""
        order = self._order
        if order is None:
            if self.schedule is None:
                raise RuntimeError(f"zbpp.{type(self).__name__}: no schedule to run: set pipeline_order "
                                   "(rank -> list of _Action) or call _load_csv(...) first")
            return
        if not self._order_user:
            # Made from the plan: a view. Changing it in place changes nothing, as with torch's
            # runtime schedules, which lower their order once (torch's own helpers such as
            # _add_send_recv consume the lists they are given).
            return
        if order == self._order_seen and self._order_schedule is self.schedule:
            return  # as set, and run before
        from ._order import schedule_from_actions

        new = schedule_from_actions(order, self.ranks, self._num_stages, self.n_microbatches, **self._cost_args)
        self._switch_schedule(new)
        self._order_seen = None  # recorded once the stages are checked: a failed check fails every step
        self._check_stages()
        self._order_seen = {r: list(a) for r, a in order.items()}
        self._order_schedule = new
        self._plan_kind = None  # the user's order is run as given, never replanned
        self._profile = None
        self._offload_profile = False

    def _switch_schedule(self, new):
        """Runs `new` from the next step on: the runner is made again for its op lists (the shapes,
        the transport, the W store and everything about training stay)."""
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._dviews is not None:
            self._dviews.clear()
        if self.schedule is not None and self.schedule is not self._last_schedule:
            self.schedule.close()
        self.schedule = new

    def _validate_and_set_stage_mapping(self, actions):
        """torch's: checks `actions` with torch's own _validate_schedule (every stage's F, I, W and
        B counted, I before W) and takes the stage-to-rank map from it; the order itself runs once
        it is pipeline_order (the C library validates it again, deadlocks included)."""
        from .schedules import _validate_schedule

        mapping = _validate_schedule(actions, self.ranks, self._num_stages, self.n_microbatches)
        self.stage_index_to_group_rank = mapping
        for st in self.stages:
            st.stage_index_to_group_rank = mapping
        return mapping

    def _prepare_schedule_with_comms(self, actions, format="compute_only"):
        """torch's: takes an order in the compute-only form (F, I, W, B) or with its transfers
        (SEND_F, RECV_F, SEND_B, RECV_B: the runner makes its own, so they are dropped) and
        validates it at once."""
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(f"format={format!r} is not implemented; use 'compute_only' or 'compute_comms'")
        self.pipeline_order = {r: list(a) for r, a in actions.items()}
        if format == "compute_comms":
            self._order_comms, self._order_comms_from = {r: list(a) for r, a in actions.items()}, None
        self._sync_order()

    def _load_csv(self, filename, format="compute_only"):
        """Reads an order from torch's CSV (one row per rank, cells such as 0F1, 1I0, 2W3, 0B1, and
        in the compute_comms form 0SEND_F1, 1RECV_B0, ...) and validates it."""
        import csv as _csv

        from .schedules import _Action

        with open(filename, newline="") as f:
            actions = {r: [_Action.from_str(c) for c in row] for r, row in enumerate(_csv.reader(f))}
        self._prepare_schedule_with_comms(actions, format=format)

    def _dump_csv(self, filename, format="compute_only"):
        """Writes pipeline_order (or, format="compute_comms", the order with torch's transfer
        actions added) as torch's CSV."""
        import csv as _csv

        if format == "compute_only":
            order = self.pipeline_order
        elif format == "compute_comms":
            order = self.pipeline_order_with_comms
        else:
            raise NotImplementedError(f"format={format!r} is not implemented; use 'compute_only' or 'compute_comms'")
        with open(filename, "w", newline="") as f:
            writer = _csv.writer(f)
            for r in sorted(order):
                writer.writerow(order[r])
