"""A schedule's step: the batch into microbatches, the checks torch makes, one run of the runner.

What this is: the PipelineSchedule mixin with torch's step(), eval() and _step_microbatches() (the
batch split as torch splits it, or microbatches the caller split: microbatch.py), the agreement
whether the pipeline trains, one iteration of the runner (_run_iteration, which the Megatron adapter
calls directly) with its profiling and replanning hooks, and the division of the gradients by the
number of microbatches (scale_grads). Every public call goes through _stepping: the pipeline's
failure path (_agree.py), with torch's PipeliningMetadataError on every rank when a boundary's
metadata was what failed.
What this is not: the runner's callbacks (zbpp/pipelining/__init__.py), the runner's set-up
(_start) or the set-up messages (_setup.py).
"""

import contextlib

import torch

from .. import _lib
from ._boundary import _as_metadata_error
from ._plan import fused_variant


class _Stepping:
    """PipelineSchedule's step (a mixin; see the module docstring)."""

    def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None, arg_mbs=None,
             kwarg_mbs=None, target_mbs=None, **kwargs):
        """One iteration of the pipeline, as torch's step: every rank calls it; the batch (args and
        kwargs, split into n_microbatches by the schedule's chunk specs, dim 0 by default, as
        torch.tensor_split splits) is read on the rank holding stage 0, and each rank's kwargs go
        to each of its stages; target and losses on the loss stage's rank (losses is cleared, then
        gets each microbatch's loss; loss_kwargs go to loss_fn). Or the microbatches already split:
        arg_mbs, kwarg_mbs and target_mbs (lists of n_microbatches tuples, dicts and targets; torch
        takes them since pytorch/pytorch#188500, after 2.13), not with the whole-batch arguments.
        Returns the merged output of the last stage on its rank (output_merge_spec, dim 0 by
        default) unless return_outputs is False, None elsewhere. Gradients accumulate into .grad
        (or main_grad). Without a loss_fn on any rank the step runs forward only, as torch's does.
        With several ranks, a step that fails on one rank fails on every rank and closes the
        pipeline (docs/failures.md; _agree.py)."""
        presplit = None
        if arg_mbs is not None or kwarg_mbs is not None or target_mbs is not None:
            presplit = (arg_mbs, kwarg_mbs, target_mbs)
        with self._stepping():
            return self._step(args, kwargs, target, losses, return_outputs, loss_kwargs, presplit)

    @contextlib.contextmanager
    def _stepping(self):
        """_check_open and _failing (the failure path, _agree.py) around a step's work; on a rank
        whose peer failed with torch's PipeliningMetadataError, the error that failure brings here
        is that class too (_boundary._as_metadata_error)."""
        try:
            self._check_open()
        except RuntimeError as err:
            made = _as_metadata_error(err, self._failed)
            if made is None:
                raise
            raise made from None
        try:
            with self._failing():
                yield
        except _lib.ZbError as err:
            made = _as_metadata_error(err, self._failed)
            if made is None:
                raise
            raise made from err.__cause__

    def _step(self, args, kwargs, target, losses, return_outputs, loss_kwargs, presplit=None):
        trains = self._trains()
        if trains and self._backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError("step() requires gradients to be enabled for backward computation; it should "
                               "not be used under torch.no_grad() context. Please call eval() instead.")
        from .microbatch import _check_presplit, _split_batch

        if presplit is not None:
            _check_presplit(args, kwargs, target, *presplit[:2])
            return self._step_microbatches(*presplit, losses, return_outputs, loss_kwargs=loss_kwargs)
        arg_mbs = kwarg_mbs = target_mbs = None
        if self.holds_first or self.schedule is None:
            if args or kwargs:
                arg_mbs, kwarg_mbs = self._split_inputs(args, kwargs)
        elif kwargs:  # torch hands each rank's keyword arguments to every stage it holds
            kwarg_mbs = self._split_inputs((), kwargs)[1]
        if target is not None and (self.holds_loss or self.schedule is None):
            target_mbs = _split_batch(target, self.n_microbatches, "the target", self.ranks > 1)
        return self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                       loss_kwargs=loss_kwargs)

    def eval(self, *args, target=None, losses=None, **kwargs):
        """One forward-only iteration, as torch's eval(): no gradients, no backward; every rank
        calls it. The loss stage's rank gets the merged output, and each microbatch's loss in
        `losses` when a loss_fn and a target are given. Takes the batch as step() does, whole or
        as arg_mbs, kwarg_mbs and target_mbs (torchtitan's validator calls it so)."""
        saved, self._backward_agreed = self._backward_agreed, False
        try:
            return self.step(*args, target=target, losses=losses, **kwargs)
        finally:
            self._backward_agreed = saved

    def _trains(self):
        """Whether steps run backward: when some rank of the pipeline was given a loss_fn (torch
        asks each rank for one; zbpp needs it only where the loss is computed). Agreed once, at
        the first step, by every rank (the handshake, _agree), so no rank runs a backward its
        peers do not."""
        if self._backward_agreed is None:
            with self._device_scope():
                self._agree()
            self._backward_agreed = self._loss_anywhere
        return self._backward_agreed

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                           loss_kwargs=None):
        """One iteration over microbatches the caller split (torch's _step_microbatches): arg_mbs
        and kwarg_mbs (lists of n_microbatches tuples and dicts) on the rank holding stage 0,
        target_mbs on the loss stage's rank."""
        with self._stepping():
            return self._step_split(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs)

    def _step_split(self, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs):
        m = self.n_microbatches
        for mbs, what in ((arg_mbs, "arg_mbs"), (kwarg_mbs, "kwarg_mbs"), (target_mbs, "target_mbs")):
            if mbs is not None:
                if not isinstance(mbs, list):
                    raise TypeError(f"{what} must be a list but got a {type(mbs)}")
                if len(mbs) != m:
                    raise ValueError(f"Expecting {m} {what} but got {len(mbs)}")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses)}")
        if not self._runnable:
            raise RuntimeError(f"zbpp.{type(self).__name__}: its stages carry no modules (stage_index and submod); "
                               "it can show its pipeline_order but not run")
        trains = self._trains()  # the handshake at the first step: before anything that may fail on one rank
        self._sync_order()
        with self._device_scope():
            self._agree()  # again when the order the user set changed the plan
        for st in self.stages:
            st.has_backward = trains
            st.clear_runtime_states()
        if self.holds_first and arg_mbs is None and kwarg_mbs is None:
            raise ValueError("zbpp: step() on the rank holding stage 0 needs the batch as arguments")
        # As torch: stage 0 takes its microbatch's args, and every stage of the rank its kwargs.
        self._mb_args = [tuple(a) for a in arg_mbs] if arg_mbs is not None else [()] * m
        self._mb_kwargs = [dict(k) for k in kwarg_mbs] if kwarg_mbs is not None else [{}] * m
        self._mb_target = target_mbs
        if self.holds_loss and trains:
            if self._loss_fn is None and self._vp is None:
                raise ValueError(f"zbpp: rank {self.rank} holds the loss stage ({self.loss_stage}) but the "
                                 "schedule has no loss_fn; pass loss_fn=... when constructing it")
            if target_mbs is None:
                raise ValueError(f"zbpp: rank {self.rank} holds the loss stage; pass target=... to step()")
        self._loss_kwargs = dict(loss_kwargs or {})
        if self._custom:
            self._custom_step(losses)
        try:
            if self._vp is not None:
                self._vp.begin_step(arg_mbs, target_mbs, trains)  # every rank gets the tokens and targets
            if trains:
                self._run_iteration()
            else:
                with self._device_scope():
                    self._infer_for(False)
                    self._forward_only()
                    if self._vp is not None:
                        got = self._vp.forward_only_losses(self._outputs)
                        if got is not None and self.holds_loss:
                            self._losses = got
        finally:
            self._mb_args = self._mb_kwargs = self._mb_target = None
            self._loss_kwargs = {}
        if trains and self.scale_grads:
            self._scale_grads(m)
        if not self.holds_loss:
            return None
        outs, got = self._outputs, self._losses
        self._outputs = self._losses = None
        last = self._by_index[self.loss_stage]
        last.output_chunks[:] = outs
        theirs = getattr(last, "torch_stage", None)  # the stage object a script built with torch's class
        if theirs is not None and isinstance(getattr(theirs, "output_chunks", None), list):
            theirs.output_chunks[:] = outs
        if losses is not None and (trains or all(x is not None for x in got)):
            losses.clear()
            losses.extend(got)
        if not return_outputs:
            return None
        if self._output_merge_spec is not None:
            from .microbatch import merge_chunks

            return merge_chunks(outs, self._output_merge_spec)
        if all(isinstance(o, torch.Tensor) for o in outs):
            return torch.cat([o if o.dim() else o.reshape(1) for o in outs])
        return outs

    def _split_inputs(self, args, kwargs):
        """The batch as n_microbatches (args, kwargs) pairs, as torch splits it (microbatch.py):
        sizes may differ by a row when the pipeline is on one rank, not across ranks."""
        from .microbatch import _split_inputs

        return _split_inputs(args, kwargs, self.n_microbatches, self._args_chunk_spec, self._kwargs_chunk_spec,
                             even=self.ranks > 1)

    def _run_iteration(self):
        """Runs this rank's op list once (the runner calls _forward/_backward); after the last
        profiled step, plans again from the measured costs (a collective, see _plan_from_profile).
        The Megatron adapter calls it directly: it checks and publishes failures as step() does."""
        with self._stepping():
            self._run_iteration_agreed()

    def _run_iteration_agreed(self):
        m = self.n_microbatches
        window = self._profile
        profiling = window is not None and window[0] <= self.steps + 1 <= window[1]
        fused = profiling and self.steps + 1 == window[0] and self._profiles_fused()
        if fused:
            # The first profiled step runs the plan with every backward fused (same order), so the
            # profile measures a fused backward too (_plan.fused_variant says why), on a runner
            # made for it; the plan's runner is made again for the next step.
            self._held_plan = self.schedule
            self._drop_runner()
            self.schedule = fused_variant(self.schedule)
        try:
            self._run_iteration_body(m, window, profiling, fused)
        finally:
            if self._held_plan is not None:  # the fused step failed: the plan in force stays in force
                fused_plan = self.schedule
                self._restore_held()
                if fused_plan is not self._last_schedule:
                    fused_plan.close()

    def _drop_runner(self):
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._dviews is not None:
            self._dviews.clear()

    def _restore_held(self):
        """After the fused profiled step: the plan in force again (its runner is made at the next step)."""
        self._drop_runner()
        self.schedule, self._held_plan = self._held_plan, None

    def _run_iteration_body(self, m, window, profiling, fused):
        with self._device_scope():
            self._agree()
            if self._vp is not None and self._vp.feed is not None:
                self._vp.begin_step(None, None, True)  # fed (Megatron): the lanes ready, after the handshake
            self._infer_for(True)
            if self._runner is None:
                self._start()
            if self._transport is not None:
                self._transport.end_step()  # keeps memory flat (distributed.py, Shutdown)
            self._ctx, self._outputs, self._losses = {}, [None] * m, [None] * m
            if self._offloader is not None:
                self._offloader.begin_step()
            if self._cuda:
                # The runner's copies and W GEMMs go on torch's current stream, the stream the
                # callbacks' torch work lands on, so one stream order covers all of it.
                self._store.prepare_run()
            extra = self._transport.take_error if self._transport is not None and not self._cuda else None
            self._profiling = profiling
            try:
                try:
                    self._runner.run(extra_error=extra)
                except _lib.ZbError as err:
                    cause = err.__cause__
                    if isinstance(cause, Exception) and getattr(cause, "_zbpp_in_stage", False):
                        # A stage's forward or backward (the user's module or loss_fn) raised: the
                        # user's own exception, as torch raises it, caused by the runner's report
                        # of where it happened (rank, op, microbatch).
                        err.__cause__ = None
                        raise cause from err
                    raise
            finally:
                self._ctx = {}
                self._profiling = False
            if self._vp is not None:
                got = self._vp.end_step()  # every lane's collectives done, before the gradients are scaled
                if self.holds_loss:
                    self._losses = got
            self._last_times = self._runner.times()
            old, self._last_schedule = self._last_schedule, self.schedule
            if old is not None and old is not self.schedule and old is not self._held_plan:
                old.close()  # the plan before a replan: its last step's timeline was drawn, if wanted
            self.steps += 1
            if self._vp is not None:
                self._vp.replan()  # after its measured step: planned again on every rank's times
            if profiling:
                self._profile_runs.append((self.schedule.to_csv(), *self._last_times, fused))
                if fused:  # the plan in force again from the next step
                    self._restore_held()
                if self.steps == window[1]:
                    self._plan_from_profile()
            else:
                self._trial_step()  # a replan on trial is kept or undone (_plan.py, TRIAL_STEPS)

    def _scale_grads(self, divisor):
        """Divides the gradients by the number of microbatches, as torch's scale_grads does (a
        division, not a multiplication by 1/m, so the bits match torch's). Once per parameter: a
        parameter that several stages of this rank share (a tied embedding and LM head at both ends
        of a V, both on rank 0) holds one gradient, summed over its uses, and is divided once, as
        a sequential loop divides it. Sharing across ranks is the user's to reduce, as in torch."""
        done = set()
        if self._vp is not None:
            self._vp.scale_grads(divisor)
        for st in self.stages:
            if st.stage_index in self._scaled:  # a custom function scaled it (stage.scale_grads)
                done.update(id(prm) for prm in st.submod.parameters())
        for st in self.stages:
            if st.stage_index not in self._scaled:
                self._scale_stage(st, divisor, done)

    @staticmethod
    def _scale_stage(st, divisor, done=None):
        """Divides the gradients of st's parameters not in `done` (ids; those divided are added)."""
        for prm in st.submod.parameters():
            if done is not None:
                if id(prm) in done:
                    continue
                done.add(id(prm))
            if prm.grad is not None:
                prm.grad.div_(divisor)
            main = getattr(prm, "main_grad", None)
            if main is not None:
                main.div_(divisor)
