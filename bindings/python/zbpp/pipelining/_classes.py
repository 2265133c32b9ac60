"""The schedule classes over PipelineSchedule, torch's names for them, and get_schedule_class.

What this is: torch's class hierarchy on zbpp's base class (PipelineScheduleSingle,
PipelineScheduleMulti, _PipelineScheduleRuntime and the signature of its interleaved classes), one
class per zbpp kind (ScheduleGPipe, ScheduleZBH1, ScheduleZBVZeroBubble, ...), the orders zbpp's
Python side makes (ScheduleLoopedBFS, ScheduleDualPipeV), ScheduleFromCSV, get_schedule_class
(a class for a zbpp kind name or a torch class name), and the helpers PipelineSchedule uses too
(_kind_name, _group_ranks, _global). Scripts import all of it from zbpp.pipelining (or
zbpp.pipelining.schedules, torch's path).
What this is not: the schedule itself (PipelineSchedule and its mixins, zbpp/pipelining/__init__.py),
the generators (the C library) or the orders' construction (_order.py). It imports PipelineSchedule
from the package, which imports this module after defining it.
"""

import ctypes

import torch.distributed as dist

from .. import _lib
from ..schedule import Schedule
from . import PipelineSchedule
from ._custom import CustomFunctions



_PY_KINDS = ("looped-bfs", "dualpipe-v")  # orders zbpp's Python side makes (the C library validates and runs them)


def _kind_name(name):
    """The canonical kind name for any name the library accepts (ZbError otherwise)."""
    if name in _PY_KINDS:
        return name
    kind, factor = ctypes.c_int(), ctypes.c_double()
    _lib.call("zb_kind_from_name", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_double)],
              name.encode(), ctypes.byref(kind), ctypes.byref(factor))
    return _lib.function("zb_kind_name", [ctypes.c_int], ctypes.c_char_p)(kind.value).decode()


def _group_ranks(group):
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _global(group, rank):
    from ..distributed import global_rank
    return global_rank(group, rank)


def _kind_class(kind_name, cls_name, doc, base=None, **attrs):
    return type(cls_name, (base or PipelineSchedule,),
                {"kind": kind_name, "__doc__": doc, "__module__": __name__, **attrs})


# The schedule classes take torch 2.13's positional arguments in its order (test_torch_names.py
# compares every signature with the installed torch's), then zbpp's keywords (PipelineSchedule).

class PipelineScheduleSingle(PipelineSchedule):
    """torch's base class of the schedules with one stage per rank (GPipe, 1F1B). Takes the stage
    itself or a list with one stage."""

    def __init__(self, stage=None, n_microbatches=None, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads=True, **kwargs):
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, **kwargs)


class PipelineScheduleMulti(PipelineSchedule):
    """torch's base class of the schedules with one or more stages per rank. Itself (no kind), it
    runs the order a user gives: a subclass sets `self.pipeline_order` (rank -> list of _Action)
    in its __init__ after this one's, or the script calls _load_csv(path); the C library
    validates it at the next step and the C runner runs it (zbpp/pipelining/_order.py)."""

    def __init__(self, stages=None, n_microbatches=None, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, use_full_backward=None, scale_grads=True, backward_requires_autograd=True,
                 **kwargs):
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, use_full_backward=use_full_backward,
                         backward_requires_autograd=backward_requires_autograd, **kwargs)


class _PipelineScheduleRuntime(CustomFunctions, PipelineScheduleMulti):
    """torch's runtime for orders with their transfers (compute_comms): zbpp's runner makes its own
    transfers, so it reads both forms (_prepare_schedule_with_comms, _load_csv(format=...)). Takes
    torch's custom functions (register_custom_function; zbpp/pipelining/_custom.py)."""


class _Interleaved(_PipelineScheduleRuntime):
    """The signature of torch's interleaved classes (Interleaved1F1B, InterleavedZeroBubble,
    ZBVZeroBubble, DualPipeV): no use_full_backward, defer_pp_recv last."""

    def __init__(self, stages=None, n_microbatches=None, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads=True, backward_requires_autograd=True, defer_pp_recv=False,
                 **kwargs):
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, **kwargs)


class _ScheduleForwardOnly(PipelineScheduleSingle):
    """Forward only: every microbatch through every stage, no loss, no backward (torch's)."""

    kind = "gpipe"

    def _trains(self):
        return False

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                           loss_kwargs=None):
        if target_mbs is not None or losses is not None:
            raise RuntimeError("Forward-only schedule does not support loss computation")
        return super()._step_microbatches(arg_mbs, kwarg_mbs, None, None, return_outputs, loss_kwargs)


ScheduleGPipe = _kind_class("gpipe", "ScheduleGPipe", "GPipe: all forwards, then all backwards (memory m).",
                            PipelineScheduleSingle)
Schedule1F1B = _kind_class("1f1b", "Schedule1F1B", "1F1B (PipeDream-flush), fused backward.", PipelineScheduleSingle)
ScheduleInterleaved1F1B = _kind_class("interleaved-1f1b", "ScheduleInterleaved1F1B",
                                      "Interleaved 1F1B: stages in a loop, any number per rank; m in torch's "
                                      "rounds (max(1, m // p) of equal size).", _Interleaved)


class ScheduleLoopedBFS(_PipelineScheduleRuntime):
    """Breadth-first pipelining (torch's ScheduleLoopedBFS): stages in a loop; each rank runs all
    microbatches through a stage before its next stage, and the backwards in reverse. Memory: every
    microbatch of every stage of the rank."""

    kind = "looped-bfs"

    def __init__(self, stages, n_microbatches, loss_fn=None, output_merge_spec=None, scale_grads=True,
                 backward_requires_autograd=True, defer_pp_recv=False, **kwargs):
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, **kwargs)

    def _generate(self, kind, p, m, v, times, limit):
        from ._order import looped_bfs

        schedule = Schedule.from_ops(looped_bfs(p, v, m), m, placement="loop", v=v, times=times, mem_limit=limit)
        schedule.validate()
        return schedule


class ScheduleDualPipeV(_Interleaved):
    """DeepSeek's DualPipeV (torch's ScheduleDualPipeV): two stages per rank in a V, m >= 2p, its
    steady phase in pairs of one stage's forward and the other's backward (OVERLAP_F_B in
    pipeline_order). zbpp's runner runs each pair's forward, then its backward; the order is
    validated and run by the C library like any other (zbpp/pipelining/_order.py)."""

    kind = "dualpipe-v"

    def _generate(self, kind, p, m, v, times, limit):
        from ._order import dualpipe_v, schedule_from_actions

        S = 2 * p
        if m < S:
            raise ValueError(f"DualPipeV requires at least as many microbatches as stages, but got {m} microbatches "
                             f"and {S} stages")
        order = dualpipe_v(p, m)
        schedule = schedule_from_actions(order, p, S, m, times=times, mem_limit=limit)
        # pipeline_order shows the pairs as torch's OVERLAP_F_B actions (the ops are their halves)
        self._order, self._order_schedule = order, schedule
        return schedule


ScheduleZBH1 = _kind_class("zb-h1", "ScheduleZBH1", "ZB-H1: 1F1B's memory, about a third of its bubble.",
                           PipelineScheduleMulti)
ScheduleZBH2 = _kind_class("zb-h2", "ScheduleZBH2", "ZB-H2: memory 2p-1, no bubble once m is large.",
                           PipelineScheduleMulti)
ScheduleZBVZeroBubble = _kind_class("zb-v", "ScheduleZBVZeroBubble",
                                    "ZB-V: two stages per rank in a V, 1F1B's memory, no bubble.",
                                    _Interleaved)
ScheduleZBV = ScheduleZBVZeroBubble
ScheduleVHalf = _kind_class("v-half", "ScheduleVHalf", "V-Half: a V schedule at half of 1F1B's memory.",
                            PipelineScheduleMulti)
ScheduleVMin = _kind_class("v-min", "ScheduleVMin", "V-Min: a V schedule at a third of 1F1B's memory.",
                           PipelineScheduleMulti)
ScheduleZBAuto = _kind_class("zb-auto", "ScheduleZBAuto",
                             "Automatic zero bubble for the given costs under a memory limit (mem_limit=).",
                             PipelineScheduleMulti)
ScheduleGroupInterleaved1F1B = _kind_class("group-interleaved-1f1b", "ScheduleGroupInterleaved1F1B",
                                           "Group-interleaved 1F1B (GIS): PipeOffload's base schedule, stages in a "
                                           "loop, groups of about p/2 microbatches, B and W split; as the reference "
                                           "fork builds it.", _Interleaved)
ScheduleInterleavedZeroBubble = _kind_class("zb-auto", "ScheduleInterleavedZeroBubble",
                                            "torch's InterleavedZeroBubble name: zbpp's automatic scheduler "
                                            "over loop-placed stages.", _Interleaved,
                                            _loop_placement=True)


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
    "group-interleaved-1f1b": ScheduleGroupInterleaved1F1B,
}


# torch's names that are not zbpp kinds (lower case, without the "Schedule" prefix).
_TORCH_NAMES = {
    "interleavedzerobubble": ScheduleInterleavedZeroBubble,
    "loopedbfs": ScheduleLoopedBFS,
    "dualpipev": ScheduleDualPipeV,
    "pipelineschedulesingle": PipelineScheduleSingle,
    "pipelineschedulemulti": PipelineScheduleMulti,
}


def get_schedule_class(schedule_name):
    """The schedule class for a name: zbpp's kind names (zb-v, zb-h1, 1f1b, ...) or torch's class
    names (1F1B, Interleaved1F1B, GPipe, InterleavedZeroBubble, ZBVZeroBubble, also with the
    "Schedule" prefix), case-insensitively. Raises ValueError listing the valid names."""
    name = schedule_name
    if not isinstance(name, str):
        raise TypeError(f"zbpp.get_schedule_class: name must be a str, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-")
    torch_name = _TORCH_NAMES.get(key[len("schedule"):] if key.startswith("schedule") else key)
    if torch_name is not None:
        return torch_name
    try:
        kind = _kind_name(name)
    except _lib.ZbError as exc:
        raise ValueError(f"zbpp.get_schedule_class: unknown schedule {name!r}; valid names: "
                         + ", ".join(_CLASSES) + " and torch's 1F1B, Interleaved1F1B, GPipe, LoopedBFS, "
                         "InterleavedZeroBubble, ZBVZeroBubble, PipelineScheduleSingle, PipelineScheduleMulti "
                         "(case-insensitive)") from exc
    cls = _CLASSES.get(kind)
    if cls is None:
        raise ValueError(f"zbpp.get_schedule_class: {name!r} ({kind}) has no generator; use "
                         "ScheduleFromCSV for a schedule from a file")
    return cls


# ---- what help() shows ----------------------------------------------------------------------------

def _document_classes():
    from ._class_docs import document

    loop = ("stage = PipelineStage(my_layers, rank, world, device)      # stage r on rank r\n"
            "schedule = {name}(stage, n_microbatches=8, loss_fn=loss_fn{extra})\n"
            "if rank == 0: schedule.step(x)\n"
            "elif rank == world - 1: schedule.step(target=y, losses=losses)\n"
            "else: schedule.step()")
    vee = ("chunks_here = (rank, 2 * world - 1 - rank)               # a V: rank 0 holds the first and last\n"
           "stages = [PipelineStage(chunks[s], s, 2 * world, device) for s in chunks_here]\n"
           "schedule = {name}(stages, n_microbatches=8, loss_fn=loss_fn)\n"
           "schedule.step(x, target=y, losses=losses) if rank == 0 else schedule.step()")
    inter = ("stages = [PipelineStage(chunks[s], s, 2 * world, device) for s in (rank, rank + world)]\n"
             "schedule = {name}(stages, n_microbatches=8, loss_fn=loss_fn)   # m a multiple of world\n"
             "if rank == 0: schedule.step(x)\n"
             "elif rank == world - 1: schedule.step(target=y, losses=losses)\n"
             "else: schedule.step()")
    base = PipelineSchedule.__init__
    for cls, shape, extra in ((ScheduleGPipe, loop, ""), (Schedule1F1B, loop, ""), (ScheduleZBH1, loop, ""),
                              (ScheduleZBH2, loop, ""), (ScheduleZBAuto, loop, ', mem_limit="2p"'),
                              (ScheduleInterleaved1F1B, inter, ""), (ScheduleGroupInterleaved1F1B, inter, ""),
                              (ScheduleInterleavedZeroBubble, inter, ""), (ScheduleLoopedBFS, inter, ""),
                              (ScheduleZBVZeroBubble, vee, ""), (ScheduleVHalf, vee, ""), (ScheduleVMin, vee, ""),
                              (ScheduleDualPipeV, vee, "")):
        summary = cls.__doc__ + (f"\n\nzbpp kind {cls.kind!r}: `zbpp schedule {cls.kind} -p P -m M` prints and "
                                 "draws its plan; docs/schedules.md compares the kinds." if cls.kind else "")
        document(cls, base, summary, shape.format(name=cls.__name__, extra=extra))
    document(ScheduleFromCSV, base, ScheduleFromCSV.__doc__,
             "schedule = ScheduleFromCSV(stages, n_microbatches=8, loss_fn=loss_fn, csv=\"plan.csv\")\n"
             "# plan.csv: torch's action grammar, e.g. from `zbpp schedule zb-v -p 4 -m 8 --format csv -o plan.csv`")
    for cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        document(cls, base, cls.__doc__,
                 f"class MySchedule({cls.__name__}):\n"
                 "    def __init__(self, *args, **kwargs):\n"
                 "        super().__init__(*args, **kwargs)\n"
                 "        self.pipeline_order = {...}   # rank -> list of torch's _Action")


_document_classes()
