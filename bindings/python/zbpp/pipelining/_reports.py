"""What a step leaves to look at: the measured timeline of every rank, and PipeOffload's measured
memory beside the plan's.

What this is: the PipelineSchedule mixin with timeline() and offload_report().
What this is not: the step (_step.py) or the offload machinery (_offload.py).
"""

from ..schedule import Schedule
from ._wsplit import measured_w_share


class _Reports:
    """PipelineSchedule's timeline() and offload_report() (a mixin; see the module docstring)."""

    # ---- measured timeline -----------------------------------------------------------------------

    def timeline(self):
        """The last step's measured op times of every rank as a zbpp.Schedule (set_times applied),
        for .to_svg(), .to_chrome() and .simulate()-style figures; a collective: every rank calls
        it, every rank gets the same result. Clocks are CLOCK_MONOTONIC, so the ranks must share a
        host (as with CPU runs over gloo)."""
        if self._last_times is None:
            raise RuntimeError("zbpp: timeline() needs a finished step()")
        self._check_open()
        with self._failing():
            gathered = self._exchange(self._last_times, "timeline()")
        if self._vp is not None:
            from ._vocab import plan_copy

            copy = plan_copy(self._last_schedule, self._vocab_args)
        else:
            copy = Schedule.from_csv(self._last_schedule.to_csv())
        # .measured: span, busy and bubble rate of the measured times (the paper's definitions);
        # .measured_w_share: the share of the backward's time spent in W ops
        copy.measured = copy.set_times([g[0] for g in gathered], [g[1] for g in gathered])
        copy.measured_w_share = measured_w_share(copy)
        # Its pictures say what they show: the kind, measured, which step; times in milliseconds.
        copy.set_display(f"{self._last_schedule.kind}, measured step {self.steps}", "ms")
        return copy

    def offload_report(self):
        """This rank's saved activations in the last step with PipeOffload's copies (offload=), as
        measured beside the plan's figures: {'device_peak_bytes', 'host_peak_bytes' (measured, counted
        as the schedule model counts them: _offload.py), 'planned_device_peak', 'planned_host_peak'
        (the plan's, in microbatches through all of this rank's layers), 'bytes_per_microbatch'
        (measured: the mean of one microbatch's saved bytes per stage, summed over the rank's
        stages), 'planned_device_peak_bytes', 'planned_host_peak_bytes', 'host_pool_bytes' (the host
        memory reserved for copies: pinned on CUDA, as many slots per stage as the plan holds at
        once), 'host_pool_misses' (groups in the last step that found no slot and got memory of
        their own: larger than the stage's first microbatch)}, and on the CPU
        'sync_device_peak_bytes', 'sync_host_peak_bytes': the plan's figures for copies that take no
        time of their own, as the CPU's synchronous copies (copy_inline) run. The plan's memory model
        counts every stage alike (F adds 1/v; a split backward frees 1 - w_share of it at B): the
        figures agree where that holds (equal stages; a split layer's input counted until its W,
        as the model counts w_share), not for the first stage of a split schedule, whose whole
        backward runs at W. None without copies."""
        off = self._offloader
        if off is None or self._last_schedule is None:
            return None
        dev, host = off.peaks()
        per_stage = {}
        for (s, _i), n in off.group_bytes.items():
            per_stage.setdefault(s, []).append(n)
        unit = sum(sum(v) / len(v) for v in per_stage.values())
        sched = self._last_schedule
        sched.simulate()
        pdev, phost = sched.rank_memory(self.rank)
        report = {"device_peak_bytes": dev, "host_peak_bytes": host, "planned_device_peak": pdev,
                  "planned_host_peak": phost, "bytes_per_microbatch": unit,
                  "planned_device_peak_bytes": pdev * unit, "planned_host_peak_bytes": phost * unit,
                  "host_pool_bytes": off.pool.reserved, "host_pool_misses": off.pool.misses}
        if not self._cuda:
            # Synchronous copies take no time of their own on the copy lane: the same op lists with
            # copy times 0. A rank's memory then moves only at its own compute ops' boundaries, in
            # list order, so this is what the run holds whatever its timing.
            from . import _stage_times  # the package's, which its set-up uses too

            S = sched.stages
            times = _stage_times(sched)
            # (A RELOAD lasts a millionth of the shortest op, so that copies at one instant keep
            # their list order, as the synchronous ones do. An OFFLOAD lasts nothing: it runs right
            # after its F, before the next compute op starts, so its bytes leave the device at the
            # instant that op starts, which frees first; with a duration of its own it would still
            # hold them as the next F allocates: a GPU's copy engine does, a CPU's inline copy does
            # not. A ZB-V rank of the GPT example was predicted a fifth of a microbatch high so.)
            tiny = 1e-6 * min(x for v in times.values() for x in v if x > 0)
            times.update(offload=[0.0] * S, reload=[tiny] * S)
            sync = Schedule.from_csv(sched.to_csv(), times=times, w_share=sched.w_share)
            sdev, shost = sync.rank_memory(self.rank)
            sync.close()
            report.update(sync_device_peak_bytes=sdev * unit, sync_host_peak_bytes=shost * unit)
        return report
