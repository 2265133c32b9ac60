"""torch.distributed.pipelining.schedules' names for scripts that import them from zbpp.

The schedule classes are zbpp's (the C runner executes them; see zbpp.pipelining). The action data
that describes a schedule is torch's own (zbpp/pipelining/_torch.py says why): `_Action`,
`_ComputationType` and its constants (F, I, W, B, FORWARD, FULL_BACKWARD, OVERLAP_F_B, SEND_F,
RECV_F, SEND_B, RECV_B, UNSHARD, RESHARD, REDUCE_GRAD, ...) and the functions that transform and
check lists of actions (`_format_pipeline_order`, `_add_send_recv`, `_merge_bw`,
`_validate_schedule`, `_simulate_comms_compute`, ...), so an action list built for torch is one
zbpp reads, and the other way round.

`_PipelineSchedule` is zbpp's base class of every schedule (`isinstance` checks hold), with torch's
hierarchy under it: `PipelineScheduleSingle` (GPipe, 1F1B, `_ScheduleForwardOnly`),
`PipelineScheduleMulti` (a user's order through `pipeline_order`) and `_PipelineScheduleRuntime`
(orders with transfers; `ScheduleInterleaved1F1B`, `ScheduleLoopedBFS`,
`ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`). `_PipelineContext` and `_wait_batch_p2p`
are torch's helpers, for scripts that import them. `ScheduleDualPipeV` runs each overlapped pair
one half after the other (docs/torch.md lists what zbpp runs).
"""

from . import (
    PipelineSchedule,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleLoopedBFS,
    _PipelineScheduleRuntime,
    _ScheduleForwardOnly,
    Schedule1F1B,
    ScheduleFromCSV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleVHalf,
    ScheduleVMin,
    ScheduleZBAuto,
    ScheduleZBH1,
    ScheduleZBH2,
    ScheduleZBV,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from ._torch import need

_s = need("schedules")

_PipelineSchedule = PipelineSchedule

_Action = _s._Action
_ComputationType = _s._ComputationType
FORWARD = _s.FORWARD
BACKWARD_INPUT = _s.BACKWARD_INPUT
BACKWARD_WEIGHT = _s.BACKWARD_WEIGHT
FULL_BACKWARD = _s.FULL_BACKWARD
UNSHARD = _s.UNSHARD
RESHARD = _s.RESHARD
SEND_F = _s.SEND_F
RECV_F = _s.RECV_F
SEND_B = _s.SEND_B
RECV_B = _s.RECV_B
F, I, W, B = _s.F, _s.I, _s.W, _s.B
# Newer than some torch 2.x releases: present when this torch has them.
for _name in ("OVERLAP_F_B", "REDUCE_GRAD"):
    if hasattr(_s, _name):
        globals()[_name] = getattr(_s, _name)
for _name in ("_PipelineContext", "_wait_batch_p2p", "_batch_p2p", "_sorted_batch_p2p", "_format_pipeline_order", "_add_send_recv", "_merge_bw", "_add_unshard_reshard", "_add_reduce_grad",
              "_validate_schedule", "_simulate_comms_compute", "_dump_chrometrace"):
    if hasattr(_s, _name):
        globals()[_name] = getattr(_s, _name)
del _name

__all__ = [
    "get_schedule_class",
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleDualPipeV",
    "PipelineScheduleSingle",
    "PipelineScheduleMulti",
]
