"""A torch.distributed.pipelining-style API whose schedule loop is the C runner.

What this is: `PipelineStage` (a stage's module, its index and the pipeline's size) and schedule
classes with torch's constructor and `step()`:

    stage = zbpp.PipelineStage(module, stage_index, num_stages, device)
    schedule = zbpp.ScheduleZBVZeroBubble([stage_a, stage_b], n_microbatches, loss_fn=loss_fn)
    schedule.step(x)                              # first stage (rank 0)
    schedule.step(target=y, losses=losses)        # the loss stage (rank 0 for V schedules)
    schedule.step()                               # every other rank

so a script written for torch.distributed.pipelining runs with `import zbpp as pipelining`-style
changes only. Python supplies each stage's forward and backward (callbacks from the C runner);
the op order, the transfers, W and the measured times are C's. Semantics follow torch's: the batch
is split into n_microbatches along dim 0, `losses` receives each microbatch's loss, the loss stage
returns the merged output, and gradients are averaged over the microbatches (scale_grads=True).

Boundary shapes: the first step runs microbatch 0 forward through the stages once, without
gradients, to learn the shape and dtype of every activation; they must stay the same afterwards.

Subclassing (the Megatron adapter does): override _first_inputs, _run_stage, _compute_loss and
_loss_backward, fill _meta and set _meta_given to skip shape inference, and call _run_iteration();
these names are the adapter interface and stay stable.

CUDA: stages on a GPU (all of a rank's on one device) run on that device's CUDA backend, on
torch's current stream (set before every step, so the runner's copies, the W GEMMs and the model
share one stream order). The callbacks see the runner's device buffers as CUDA tensors (no host
copies). With several ranks the activations travel over the library's NCCL transport, made from a
unique id that rank 0 broadcasts; the optimizer's post-validation messages (host memory) keep using
the torch.distributed callback transport over a group that takes CPU tensors (gloo). See cuda.py.

Plans from measured costs: the zero-bubble kinds (zb-auto, zb-h1, zb-h2, zb-v, v-half, v-min) are
first planned for equal F/B/W times, but real W costs a fraction of F and B. So by default the
schedule times steps 2 and 3 (step 1 carries one-off costs), gathers every stage's measured F, B,
W, transfer time and activation memory to every rank (zbpp.StageCosts, costs.py), plans its kind
again for them under the same memory limit, checks that every rank got the same op lists, and,
if the new plan simulates at least REPLAN_MIN_GAIN shorter on the measured costs than the plan in
force, runs it from step 4 on (else the plan in force stays). Only the order of the ops changes,
never what they compute, so training stays bit for bit that of a sequential loop. `plan_from_measured=False` (or
ZBPP_PLAN_FROM_MEASURED=0) turns it off; `profile_steps=(a, b)` times steps a..b and replans after
b; `costs=` plans from saved costs at once; `save_plan_dir=` (or ZBPP_PLAN_DIR) writes the costs
and the plan; `plan_info` says what happened. Fixed orders (gpipe, 1f1b, interleaved-1f1b) and
schedules from CSV are never replanned.

Where the parts are: PipelineStage in _stage.py; the schedule classes (torch's hierarchy, one class
per kind) and get_schedule_class in _classes.py; PipelineSchedule, the runner's callbacks and the
runner's set-up here, its other parts in the mixins of the other _*.py modules. Every name is
imported from this package.

What this is not: a tracer or a model splitter. Each rank builds its own stage modules.
"""

import contextlib
import itertools
import logging
import os
import weakref

import torch
import torch.distributed as dist

from .. import _lib, cuda, distributed, runtime
from ..costs import ActivationMeter, StageCosts, parse_mem_limit
from ..distributed import TorchTransport
from ..schedule import Schedule
from ..split import default_store
from ..splitters.linear import fused_forward
from ._boundary import _BoundaryBuffers, _as_tuple, _layout, _shares_storage
from ._agree import _Agreement, pipeline_key
from ._ir import _TorchIR
from ._offload import OFFLOAD_SLOWDOWN, _copy_times_in, _has_copies, _offload_choice
from ._setup import _SetUp
from ._stage import PipelineStage, _adopt
from ._reports import _Reports
from ._step import _Stepping
from ._wsplit import _marked as _wsplit_marked, _Splitting, measured_w_share
from ._plan import DEFAULT_PROFILE_STEPS, PLANNED_KINDS, REPLAN_MIN_GAIN, PlanInfo, _Planning, _profile_window  # noqa: F401
from ._plan import refined

__all__ = [
    "PipelineStage",
    "PipelineSchedule",
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleZBH1",
    "ScheduleZBH2",
    "ScheduleZBVZeroBubble",
    "ScheduleZBV",
    "ScheduleVHalf",
    "ScheduleVMin",
    "ScheduleZBAuto",
    "ScheduleGroupInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleFromCSV",
    "ScheduleLoopedBFS",
    "ScheduleDualPipeV",
    "PipelineScheduleSingle",
    "PipelineScheduleMulti",
    "PlanInfo",
    "get_schedule_class",
    # torch's, resolved on first use (module __getattr__ below)
    "pipeline",
    "pipe_split",
    "SplitPoint",
    "Pipe",
    "build_stage",
    "TensorChunkSpec",
    "split_args_kwargs_into_chunks",
    "merge_chunks",
]

_V_KINDS = ("zb-v", "v-half", "v-min", "dualpipe-v")
_log = logging.getLogger("zbpp")
_SHARED_GPU_WARNED = []  # the shared-GPU warning is given once per process


_marked = _wsplit_marked  # the runner's marking of a stage's own failure (defined in _wsplit.py)


def _stage_times(schedule):
    """A schedule's per-stage times as Schedule.generate's times dict (copies included)."""
    return {t.lower(): [schedule.op_time(t, st) for st in range(schedule.stages)]
            for t in ("F", "B", "W", "BW", "OFFLOAD", "RELOAD")}


# ---- the schedules ---------------------------------------------------------------------------------

class PipelineSchedule(_Agreement, _SetUp, _TorchIR, _Planning, _Splitting, _BoundaryBuffers, _Stepping,
                       _Reports):
    """Base class: a zbpp schedule kind run by the C runner over this rank's stages.

    Subclasses fix `kind`. Extra keyword arguments beyond torch's: mem_limit (zb-auto's memory limit,
    in microbatches of a rank's activations, a string such as "2p", or bytes of activations per
    rank such as "8GB", turned into microbatches by the measured activation memory), times
    (per-rank F/B/W costs for zb-auto, see zbpp.Schedule.generate), timeout (seconds one transfer
    may take before the step fails naming the peer; default 300), csv (a schedule in torch's CSV
    grammar instead of a kind), cpu_group (CUDA stages only: a gloo group over the pipeline's ranks
    for host-memory messages, needed when `group` is a non-gloo subgroup of the world; by default
    the group itself when it takes CPU tensors, else a gloo group made over the whole world).

    PipeOffload (_offload.py): offload ("none"; "auto": activations move to host memory where the
    copies hide, the step growing by OFFLOAD_SLOWDOWN at most, a numeric mem_limit the device limit
    to reach; or a list of the stage indices whose activations may move), with the copy times from
    times= ('offload', 'reload'), costs=, or measured in the profiled steps of a planned kind;
    offload_modelled (CPU stages: each copy runs on the runner's copy thread for at least its
    planned time, times in ms, as a PCIe link would take it, instead of at once on the runner's
    thread; for benchmarks and tests of the timing without a device); offload_paired (ranks 2k and
    2k+1 share one link to host memory, one PCIe switch for two GPUs: their copies take turns). offload_report() gives the
    measured peaks beside the plan's.

    Vocabulary Parallelism (_vocab.py): vocab_parallel (a zbpp.VocabParallel holding the output
    layer and the input embedding, split over the vocabulary across every rank; the plan gets
    their passes; the loss is their cross entropy, so no loss_fn).

    Plans from measured costs (the module docstring): plan_from_measured (None: on for the kinds in
    PLANNED_KINDS unless times= or costs= is given, or ZBPP_PLAN_FROM_MEASURED=0; False: off; True:
    on, an error for a fixed kind), profile_steps (the steps timed, counted from 1: (first, last),
    or n for steps 2..n+1; default (2, 3); the plan changes after the last), costs (a
    zbpp.StageCosts or the path of a zbpp-costs JSON file: plan from it at once, and do not
    profile unless plan_from_measured=True), save_plan_dir (a directory where rank 0 writes
    zbpp-costs.json and the plan as CSV and SVG when it replans; default $ZBPP_PLAN_DIR).
    """

    kind = None

    def __init__(self, stage_or_stages=None, n_microbatches=None, loss_fn=None, args_chunk_spec=None,
                 kwargs_chunk_spec=None, output_merge_spec=None, scale_grads=True, *, kind=None,
                 csv=None, mem_limit=None, times=None, timeout=300.0, cpu_group=None,
                 plan_from_measured=None, profile_steps=None, costs=None, save_plan_dir=None,
                 use_full_backward=None, backward_requires_autograd=True, defer_pp_recv=False,
                 stages=None, stage=None, split_backward=None, offload=None, offload_modelled=False,
                 offload_paired=False, vocab_parallel=None):
        name = type(self).__name__
        # torch's keyword names: stages= (PipelineScheduleMulti and its subclasses), stage= (Single)
        given = [x for x in (stage_or_stages, stages, stage) if x is not None]
        if len(given) != 1:
            raise TypeError(f"zbpp.{name}: pass the stage(s) once (positionally, stages= or stage=), got {len(given)}")
        stage_or_stages = given[0]
        if n_microbatches is None:
            raise TypeError(f"zbpp.{name}: n_microbatches is required")
        raw = list(stage_or_stages) if isinstance(stage_or_stages, (list, tuple)) else [stage_or_stages]
        if not raw:
            raise TypeError(f"zbpp.{name}: expected a zbpp.PipelineStage or a list of them, got an empty list")
        stages = [_adopt(s, name) for s in raw]
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"zbpp.{name}: n_microbatches must be an int >= 1, got {n_microbatches!r}")
        if use_full_backward is not None:
            _log.warning("zbpp.%s: use_full_backward is no longer used (as in torch); drop it", name)
        # torch's chunk and merge specs (TensorChunkSpec, _Replicate, reducers): split and merged
        # by torch's own functions, so they mean what they mean there (zbpp.pipelining.microbatch).
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self._loss_kwargs = {}
        first = stages[0]
        S, group = first.num_stages, getattr(first, "group", None)
        # Stages that carry only the pipeline's shape (num_stages, group_size, group_rank: torch's
        # tests build such mocks to look at a schedule's pipeline_order) are planned, not run.
        self._runnable = all(hasattr(s, "stage_index") and hasattr(s, "submod") and s.submod is not None
                             for s in stages)
        for s in stages:
            if s.num_stages != S or getattr(s, "group", None) is not group:
                raise ValueError(f"zbpp.{name}: all stages of a rank must share num_stages and group")
            if self._runnable and s.device != first.device:
                raise ValueError(f"zbpp.{name}: all stages of a rank must be on one device (one "
                                 f"runner, one stream); got {first.device} and {s.device}")
        self.device = first.device if self._runnable else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._cpu_group_given = cpu_group
        self.stages = sorted(stages, key=lambda s: s.stage_index) if self._runnable else stages
        self.n_microbatches = self._n_microbatches = m = n_microbatches
        self._loss_fn = loss_fn
        self._backward_agreed = None  # whether the pipeline trains: agreed at the first step (_trains)
        self._backward_requires_autograd = backward_requires_autograd
        # None: each stage's own split_backward; True/False: every stage of this rank.
        if split_backward is not None and not isinstance(split_backward, bool):
            raise TypeError(f"zbpp.{name}: split_backward must be True, False or None (each stage's own), "
                            f"got {split_backward!r}")
        self._split_arg = split_backward
        self._split_for = None  # (schedule, {(stage, mb) whose W runs apart}, last such B) see _splits
        self._w_empty_warned = False
        self._w_work = {}  # the stages whose B ran with W apart this step (as keys)
        self._w_seen = False  # whether one of them left W work this step
        self._params_cache = (None, {}, {})  # (step, stage -> (module, parameters), accumulators); _stage_params
        self._generic = None  # the generic splitter, once asked for (_generic_splitter)
        self.scale_grads = scale_grads
        self.group = group
        self.rank = first.group_rank
        self.ranks = self.pp_group_size = p = first.group_size
        self._num_stages = S
        self.timeout = float(timeout)
        kind = kind or self.kind
        if S % p and (kind is not None or csv is not None):
            # A user's order (kind None) may place stages any way; the kinds place v per rank.
            raise ValueError(f"zbpp.{name}: num_stages={S} is not a multiple of the "
                             f"pipeline's {p} ranks")
        v = S // p
        if csv is None and kind is not None and _kind_name(kind) in _V_KINDS and v != 2:
            raise ValueError(f"zbpp.{name}: {_kind_name(kind)} is a V schedule: each rank holds 2 "
                             f"stages (rank r holds stages r and 2p-1-r), but num_stages={S} over {p} "
                             f"rank(s) gives {v} stage(s) per rank; build 2 PipelineStages per rank with "
                             f"num_stages={2 * p}")
        try:
            limit_kind = parse_mem_limit(mem_limit)[0]
        except ValueError as exc:
            raise ValueError(f"zbpp.{name}: {exc}") from None
        if isinstance(costs, (str, bytes, os.PathLike)):
            costs = StageCosts.load(costs)
        elif costs is not None and not isinstance(costs, StageCosts):
            raise TypeError(f"zbpp.{name}: costs must be a zbpp.StageCosts or the path of a zbpp-costs JSON "
                            f"file, got {type(costs).__name__}")
        # zb-auto plans loop- or V-placed stages, whichever the rank was given: torch's interleaved
        # schedules (ScheduleInterleavedZeroBubble) place stage s on rank s mod p, any number per rank.
        self._placement_arg = None
        if csv is None and kind is not None and _kind_name(kind) == "zb-auto" and v >= 2:
            mine = sorted(st.stage_index for st in stages) if self._runnable else None
            loop = [c * p + self.rank for c in range(v)]
            # Without real stages (torch's mocks): the class's own placement (torch's interleaved
            # classes place in a loop); with them, what the rank was given.
            loop_class = mine is None and getattr(self, "_loop_placement", False)
            self._placement_arg = "loop" if (loop_class or mine == loop) and (v > 2 or p > 1) else None
        if costs is not None:
            costs.check_shape(p, v, what=f"this pipeline ({name})")
        self._kind_arg = kind
        # What the handshake compares as "the schedule" (_agree.py).
        self._kind_label = ("a schedule from CSV" if csv is not None else
                            "an order set through pipeline_order" if kind is None else _kind_name(kind))
        self._plan_kind = _kind_name(kind) if csv is None and kind is not None else None
        if self._plan_kind not in PLANNED_KINDS:
            self._plan_kind = None
        self._offload_arg = _offload_choice(name, offload, S)
        self._vp = None  # _vocab.VocabRun with vocab_parallel=
        self._vocab_args = {}  # Schedule.generate's vocab arguments
        if vocab_parallel is not None:
            from ._vocab import VocabRun, check_config

            check_config(name, vocab_parallel, loss_fn, csv, _kind_name(kind) if kind is not None else None, offload,
                         costs, plan_from_measured, _PY_KINDS)
            # Its own replan (from the passes' times too): not the stages' profile below.
            measure = plan_from_measured is not False and times is None and not vocab_parallel.times_given
            plan_from_measured = False
            self._vp = VocabRun(self, vocab_parallel, measure=measure)
            self._vocab_args = self._vp.spec()
        if offload_modelled and (self._cuda or self._offload_arg is None):
            raise ValueError(f"zbpp.{name}: offload_modelled=True models a PCIe link for offload= on CPU stages; "
                             f"this pipeline has {'CUDA stages' if self._cuda else 'no offload'}")
        self._offload_modelled = bool(offload_modelled)
        if offload_paired and self._offload_arg is None:
            raise ValueError(f"zbpp.{name}: offload_paired=True says how ranks share their link to host memory; "
                             "it goes with offload=")
        self._offload_paired = bool(offload_paired)
        # A fixed order with offload= and no copy times: its first steps are profiled as a planned
        # kind's are, for the op and copy times its copies are placed on (_plan.py); its compute
        # order stays as it is.
        self._offload_profile = (self._plan_kind is None and self._offload_arg is not None and times is None
                                 and costs is None and (kind is not None or csv is not None))
        self._profile = _profile_window(name, self._plan_kind or ("fixed" if self._offload_profile else None),
                                        kind if csv is None else "a CSV schedule",
                                        plan_from_measured, profile_steps, times, costs)
        self._offload_profile = self._offload_profile and self._profile is not None
        if limit_kind == "bytes" and self._profile is None and (costs is None or costs.mem_f_bytes is None):
            raise ValueError(f"zbpp.{name}: mem_limit={mem_limit!r} is in bytes, which needs the activation memory "
                             "of a microbatch: leave plan_from_measured on (a zero-bubble kind measures it in its "
                             "first steps), pass costs= with mem_f_bytes, or give the limit in microbatches")
        if limit_kind == "bytes":
            # Until the memory is measured: the kind's own limit (zb-auto: p, 1F1B's memory).
            limit = costs.mem_limit(mem_limit) if costs is not None and costs.mem_f_bytes is not None else None
        else:
            limit = mem_limit
        self._mem_limit_arg = mem_limit
        self._times_arg = times
        self.costs = costs
        self._save_dir = save_plan_dir if save_plan_dir is not None else (os.environ.get("ZBPP_PLAN_DIR") or None)
        cost_times = dict(times=costs.times(), comm=costs.time_comm, w_share=costs.w_share) if costs else {}
        self._cost_args = dict(cost_times or {"times": times}, mem_limit=None if limit_kind == "bytes" else limit)
        self._order = None  # torch's pipeline_order (see the pipeline_order property)
        self._order_user = False  # set by the user (else made from the plan)
        self._order_seen = None  # a user's order as last run (_sync_order)
        self._order_comms = None  # pipeline_order_with_comms, made on first use or set
        self._order_comms_from = None  # (schedule, order) it was made from; None when the user set it
        self._order_schedule = None
        if csv is not None:
            self.schedule = Schedule.from_csv(csv, mem_limit=None if self._offload_profile else limit,
                                              **(cost_times or {"times": times}))
            info = (self.schedule.ranks, self.schedule.stages, self.schedule.microbatches)
            if info != (p, S, m):
                raise ValueError(f"zbpp: the CSV schedule has {info[0]} ranks, {info[1]} stages and {info[2]} "
                                 f"microbatches; this pipeline has {p}, {S} and n_microbatches={m}")
            self.schedule.validate()
        elif kind is None:
            # PipelineScheduleMulti and _PipelineScheduleRuntime themselves: the order comes from the
            # user (pipeline_order, _load_csv, _prepare_schedule_with_comms) before the first step.
            self.schedule = None
        elif costs is not None and kind not in _PY_KINDS:
            self.schedule = refined(costs.plan(kind, m, mem_limit if limit_kind == "bytes" else limit))
        else:
            # A fixed order profiled for its copies runs its first steps without them, so without
            # the limit, which only the copies can reach (_plan.py places them under it).
            self.schedule = self._generate(kind, p, m, v, times, None if self._offload_profile else limit)
        if self.schedule is not None and self._offload_arg is not None:
            if _copy_times_in(self.schedule):
                if self._offload_profile:  # a CSV schedule that brings its copy times: nothing to measure
                    self._profile, self._offload_profile = None, False
                self.schedule = self._with_offload(self.schedule, name, limit)
            elif self._profile is None:
                given = "times=" if times is not None else "costs=" if costs is not None else None
                how = (f"{given} has none: add them to it, or leave times= and costs= out to have the first steps "
                       "measure them" if given else
                       "leave plan_from_measured on (not False) to have the first steps measure them")
                raise ValueError(f"zbpp.{name}: offload={self._offload_arg!r} needs the copy times, 'offload' and "
                                 "'reload' (the time to copy one microbatch's activations through all of a rank's "
                                 "layers to host memory and back, in the unit of 'f'; zbpp.costs.measure_copy_time "
                                 f"measures them); {how}")
            # else: the profiled steps run without copies; the plan after them has them (_plan.py)
        self._offloader = None  # _offload.Offloader, made with the runner when the schedule has copies
        self.loss_stage = S - 1
        self.holds_loss = self.holds_first = False
        self._by_index = {}
        if self.schedule is not None:
            self._check_stages()
        self._meta = {}       # boundary b -> [(dtype, shape)] of the activation from stage b to b+1
        self._meta_given = False  # a subclass that knows the shapes fills _meta and sets this
        self._mb_args = self._mb_kwargs = self._mb_target = None  # this step's microbatches (_step_split)
        self._runner = None
        self._transport = None
        self._nccl = None
        self._store = default_store(self.device if self._cuda else None) if self._runnable else None
        self._dviews = cuda.DeviceViews(self.device) if self._cuda else None
        # Zero-copy stages (the runner's release_cb): outputs lent to the runner, by token, and the
        # typed tensors over each lent buffer, by address (a lent buffer that comes back as this
        # rank's next stage's input is that stage's input, as it is).
        self._lending = False
        self._lent, self._lent_at, self._lend_ids = {}, {}, itertools.count(1)
        self._host_views = {}  # (runner buffer address, boundary) -> (metadata, typed views); _views
        self._msg = None  # (group, device) of shape inference and the NCCL unique id; see _messages
        self._last_times = None
        self._last_schedule = None  # the schedule the last step ran (timeline() draws it)
        self._shapes_known = False  # _meta holds what a training inference found (a replan's runner reuses it)
        self._inferred_for = None  # whether the last shape inference was for training (_SetUp._infer_for)
        self._profiling = False
        # (schedule CSV, starts, ends, whether it ran the plan fused: _plan.fused_variant) of this
        # rank in each profiled step
        self._profile_runs = []
        self._held_plan = None  # the plan in force while a profiled step runs its fused variant
        self._profile_mem = {}  # stage -> (saved bytes, W-only bytes, CUDA bytes) of one microbatch
        self.plan_info = None
        self.steps = 0
        # Agreement and failures between the ranks (_agree.py): the pipeline's key in the job's
        # store, made here so that every rank names its n-th pipeline over a group the same way
        # whatever each was given (its gloo and NCCL transports publish failures under it too).
        self._store_c10d = None
        self._failed = self._failed_step = None
        self._looked_at = None  # the step count at which _check_open last read the failure key
        self._exchanges = 0
        self._agreed, self._agreed_on, self._loss_anywhere = False, None, None
        self._post_validation = None  # what PostValidatedOptimizer.for_schedule wraps (its _agreement)
        self._infer_running = False
        self._setup_waiter = None
        self._ping_waiters = None
        self._key = (pipeline_key(group, _group_ranks) if self._runnable and p > 1 and dist.is_available()
                     and dist.is_initialized() else None)

    # torch's custom functions: _PipelineScheduleRuntime takes them (_custom.py); the others run
    # their own work in the runner's callbacks.
    _custom = {}
    _scaled = frozenset()

    def _runner_pairs(self):
        return ()

    def _on_forward(self, s, i, in_addr, out_addr):
        return self._forward(s, i, in_addr, out_addr)

    def _on_backward(self, s, i, gout_addr, gin_addr):
        return self._backward(s, i, gout_addr, gin_addr)

    @property
    def _stages(self):
        """torch's name for this rank's stages."""
        return self.stages

    def _with_offload(self, schedule, name, limit, close=True):
        """schedule with PipeOffload's copies where they pay (Schedule.plan_offload): the stages
        offload= chose, the copy times of the schedule's times, a step at most OFFLOAD_SLOWDOWN
        longer, and the memory limit (in microbatches) as the device limit when one is given."""
        old = schedule
        if _has_copies(old):
            return old  # a CSV schedule with its copies already placed
        chosen = None if self._offload_arg == "auto" else list(self._offload_arg)
        device_limit = limit if isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0 else None
        options = dict(device_limit=device_limit, slowdown=OFFLOAD_SLOWDOWN, stages=chosen,
                       paired_lanes=self._offload_paired)
        if old.kind == "zb-auto" or (old.kind in ("v-min", "v-half") and device_limit):
            # zb-auto plans its order and the copies together (Schedule.generate's offload=): orders
            # for more memory, taken down to the limit by copies, where that steps shorter. So do
            # v-min and v-half under a limit, over the V orders that hold more.
            new = Schedule.generate(old.kind, p=old.ranks, m=old.microbatches, v=old.chunks, times=_stage_times(old),
                                    comm=old.time_comm, w_share=old.w_share, mem_limit=old.mem_limit or None,
                                    placement=old.placement, offload=options)
        else:
            new = old.plan_offload(**options)
        if close:
            old.close()
        return new

    def _generate(self, kind, p, m, v, times, limit):
        """The schedule of a kind for this pipeline (a subclass with its own order overrides it);
        the memory-tight V kinds refined (_plan.refined)."""
        plan = Schedule.generate(kind, p=p, m=m, v=v, times=times, mem_limit=limit, placement=self._placement_arg,
                                 **self._vocab_args)
        # The local search does not move Vocabulary Parallelism's passes (zb_schedule_refine).
        return plan if self._vocab_args else refined(plan)

    def _check_stages(self):
        """Checks that this rank was given the stages the schedule puts on it, and notes which of
        them hold the first and the loss stage."""
        if not self._runnable:
            return
        p, S = self.ranks, self._num_stages
        v = S // p
        mine = [s.stage_index for s in self.stages]
        want = self.schedule.rank_stages(self.rank)
        if mine != want:
            placement = self.schedule.placement
            hint = (f"a V schedule needs 2 stages per rank: rank r holds stages r and {2 * p - 1}-r"
                    if placement == "v" else
                    f"a loop schedule puts stage s on rank s mod {p}" if placement == "loop" else
                    "the order's stage-to-rank map decides")
            raise ValueError(f"zbpp.{type(self).__name__} ({self.schedule.kind}): rank {self.rank} was given "
                             f"stage(s) {mine} but the schedule puts {want} on it; {hint} "
                             f"(num_stages={S}, {p} ranks, {v} stage(s) per rank)")
        self.holds_loss = self.loss_stage in mine
        self.holds_first = 0 in mine
        self._by_index = {s.stage_index: s for s in self.stages}
        mapping = {s: self.schedule.stage_rank(s) for s in range(S)}
        self.stage_index_to_group_rank = mapping
        for s in self.stages:
            s.stage_index_to_group_rank = mapping

    # ---- the runner's callbacks ------------------------------------------------------------------

    # Hooks a subclass (the Megatron adapter) overrides: where stage 0's inputs come from, how a
    # stage runs, and how the loss is computed and differentiated.

    def _first_inputs(self, i):
        if self._vp is not None:  # the embedding, split over the ranks, in place of the tokens
            return (self._vp.embedding_of(i),) + tuple(self._mb_args[i][1:]), self._mb_kwargs[i]
        return self._mb_args[i], self._mb_kwargs[i]

    def _run_stage(self, s, i, inputs, kwargs):
        if s > 0 and not kwargs and self._mb_kwargs:
            kwargs = self._mb_kwargs[i]  # torch hands a rank's keyword arguments to each of its stages
        return self._by_index[s].submod(*inputs, **kwargs)

    def _compute_loss(self, i, out):
        if self._loss_fn is None:
            raise ValueError("zbpp: the loss stage has no loss_fn; pass loss_fn=... to the "
                             "schedule on the rank holding the last stage")
        loss = self._loss_fn(out, self._mb_target[i], **self._loss_kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("zbpp: loss_fn must return a tensor with one element")
        self._outputs[i] = out.detach() if isinstance(out, torch.Tensor) else out
        self._losses[i] = loss.detach()
        return loss

    def _loss_backward(self, loss):
        loss.backward()

    def _forward(self, s, i, in_addr, out_addr):
        if s == 0:
            inputs, kwargs = self._first_inputs(i)
        else:
            inputs = []
            for t in self._in_views(in_addr, s - 1):
                # Lending: the runner keeps the buffer until this microbatch's W, as long as autograd
                # needs it; a fresh tensor object still, for requires_grad and .grad of its own.
                t = t.detach() if self._lending else t.clone()
                if t.is_floating_point():
                    t.requires_grad_(True)
                inputs.append(t)
            inputs, kwargs = tuple(inputs), {}
        meter = self._meter(s) if self._profiling and i == 0 else None
        # Split layers run as nn.Linear where B defers nothing: a fused backward (no W op apart),
        # or a splitting stage with no input gradient to send, whose whole backward runs at W
        # (_wsplit; with split_backward=False its B runs and the split layers defer their W).
        fused = fused_forward((s, i) not in self._apart()[1] or (not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in itertools.chain(inputs, kwargs.values()))
            and self._stage_splits(self._by_index[s])))
        offload = self._offloader.capture(s, i, inputs) if self._offloader is not None else contextlib.nullcontext()
        with torch.enable_grad(), fused, (meter or contextlib.nullcontext()), offload:
            out = self._run_stage(s, i, inputs, kwargs)
            if s == self.loss_stage and self._vp is not None:
                # The output layer is split over the ranks: its input goes to every rank; the
                # backward pairs this output with the gradient its passes send back (hidden_grad).
                self._vp.hidden(i, out)
                self._outputs[i] = out.detach()
                self._ctx[(s, i)] = (inputs, (out,), None)
                return out
            if s == self.loss_stage:
                loss = self._compute_loss(i, out)
                if self._lending and s > 0 and isinstance(self._outputs[i], torch.Tensor) and \
                        _shares_storage(self._outputs[i], inputs):
                    # An output that is its input (or a view of it) would be a runner buffer, reused
                    # after this microbatch's W: the merged output keeps a copy.
                    self._outputs[i] = self._outputs[i].clone()
                self._ctx[(s, i)] = (inputs, None, loss)
                if meter is not None:
                    meter.roots = [loss]
                return out
            if meter is not None:
                meter.roots = [t for t in _as_tuple(out) if isinstance(t, torch.Tensor)]
        outs = _as_tuple(out)
        self._check_boundary(s, i, outs)
        if self._lending:
            self._lend(s, [t.detach() for t in outs], inputs)
        else:
            for view, t in zip(self._views(out_addr, s), outs):
                view.copy_(t.detach())
        self._ctx[(s, i)] = (inputs, outs, None)
        return out

    def _meter(self, s):
        """Measures the activations one microbatch's forward of stage s keeps (microbatch 0 of a
        profiled step; costs.ActivationMeter), keeping the largest figures of the profiled steps."""
        def done(meter):
            got = (meter.saved_bytes, meter.w_only_bytes, meter.cuda_bytes or 0)
            old = self._profile_mem.get(s, (0, 0, 0))
            self._profile_mem[s] = tuple(max(a, b) for a, b in zip(old, got))

        return ActivationMeter(self._by_index[s].submod, self.device if self._cuda else None, done)

    def _backward(self, s, i, gout_addr, gin_addr):
        inputs, outs, loss = self._ctx.pop((s, i))
        store = self._store
        stage = self._by_index.get(s)
        dw_builder = getattr(stage, "dw_builder", None)
        split = self._splits(s, i, stage, dw_builder)
        pairs = []
        # Whether this B left W work (for _check_w_work's warning): asked only until one B of the
        # step did, since one is enough to know the W ops are not all empty.
        track = split is not None and not self._w_seen and not self._w_empty_warned
        before = store.live_entries() if track else 0
        store.capturing = True
        try:
            if loss is not None:
                if split:
                    self._split_backward(stage, [loss], [None], inputs)
                else:
                    self._loss_backward(loss)
            else:
                gouts = ([self._vp.hidden_grad(i, outs[0])] if self._vp is not None and s == self.loss_stage
                         else self._in_views(gout_addr, s))
                pairs = [(o, g) for o, g in zip(outs, gouts) if o.requires_grad]
                if pairs:
                    # Lending: the gradients stay valid until this microbatch's W (the W store reads
                    # them there). They are held in `pairs` meanwhile, so autograd cannot take one
                    # over as a parameter's .grad.
                    grads = [g if self._lending else g.clone() for _, g in pairs]
                    if split:
                        self._split_backward(stage, [o for o, _ in pairs], grads, inputs)
                    else:
                        torch.autograd.backward([o for o, _ in pairs], grads)
            if dw_builder is not None:
                # torch's dw_builder: the stage's weight gradients are this function's work, run
                # at the W op of this microbatch (at once for a fused backward).
                store.push_action(_marked(dw_builder()))
        finally:
            store.capturing = False
        if split is not None:
            if track and store.live_entries() > before:
                self._w_seen = True
            self._w_work[s] = True
            if (s, i) == self._split_for[2]:
                self._check_w_work()
        if s == 0 and self._vp is not None:
            self._vp.input_grad(i, inputs[0].grad)  # for IB
        if s > 0 and self._lending:
            self._lend(s - 1, [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs],
                       [g for _, g in pairs] if loss is None else ())
        elif s > 0:
            for view, x in zip(self._views(gin_addr, s - 1), inputs):
                if x.grad is not None:
                    view.copy_(x.grad)
                else:
                    view.zero_()

    @property
    def transport(self):
        """This rank's transport over torch.distributed (None with one rank); the optimizer's
        post-validation shares it (on channels of its own). CPU stages: the runner's transport too.
        CUDA stages: host messages only, over a group that takes CPU tensors (cpu_group); on first
        use every rank must ask for it, since making a gloo group is a collective."""
        if self._transport is None and self.ranks > 1:
            self._transport = TorchTransport(self._host_group(), self.timeout, name=self._key)
        return self._transport

    def _host_group(self):
        """The group host messages go over: the pipeline's own (CPU stages), or, with CUDA stages,
        cpu_group= or a gloo group over the pipeline's ranks (made on first use, a collective)."""
        if not self._cuda:
            return self.group
        if self._cpu_group_given is not None:
            return self._cpu_group_given
        return distributed.cpu_group(self.group)

    def _device_scope(self):
        return torch.cuda.device(self.device) if self._cuda else contextlib.nullcontext()

    def _start(self):
        if not self._cuda:
            self.transport  # noqa: B018 - created here at the latest: it is the runner's
        S = self.stages[0].num_stages
        sizes = [(_layout(self._meta[b])[1] if b in self._meta else 0) for b in range(S - 1)]
        if self._cuda:
            if self.ranks > 1 and self._nccl is None:
                self._nccl = self._make_nccl()
            transport = self._nccl
        else:
            transport = self._transport.transport if self._transport else None
        pairs = self._runner_pairs()
        self._prepare_split()
        for st in self.stages:
            st._zb_schedule = weakref.ref(self)  # what the stage's torch calls run (forward_one_chunk, ...)
        # On CUDA the runner's message buffers are torch's memory (its caching allocator).
        allocator = cuda.torch_allocator(self.device) if self._cuda else None
        # Zero-copy stages: the runner sends the tensors the stages produced and keeps each input
        # until its microbatch's W, so nothing is copied on the way (not with OVERLAP_F_B pairs,
        # whose callbacks the runner cannot tell apart: those copy).
        self._lending = not pairs
        self._host_views = {}  # the old runner's buffers go with it
        copies = any(op.type in ("OFFLOAD", "RELOAD") for op in self.schedule.rank_ops(self.rank))
        if copies and self._offloader is None:
            from ._offload import Offloader

            self._offloader = Offloader({st.stage_index: st.submod for st in self.stages}, self.device)
        elif not copies:
            self._offloader = None
        if self._offloader is not None:
            self._offloader.plan(self.schedule, self.rank)
        self._runner = runtime.Runner(self.schedule, self.rank, self._store.backend, self._store.store,
                                      transport, sizes, self._stage_callback(self._on_forward, "F"),
                                      self._stage_callback(self._on_backward, "B"),
                                      timeout_s=self.timeout, pairs=pairs, allocator=allocator,
                                      release=self._release_lent if self._lending else None,
                                      copy=self._offloader.copy if self._offloader is not None else None,
                                      copy_inline=not self._offload_modelled,
                                      copy_time_scale=1e-3 if self._offload_modelled else 0.0,
                                      vocab=self._vocab_callback() if self._vp is not None else None)

    def _vocab_callback(self):
        """The runner's vocab callback: a pass that raises is published as the pipeline's first
        failure, naming it, and the lanes' peers are told (as _stage_callback does for stages)."""
        def call(kind, mb):
            try:
                self._vp.on_pass(kind, mb)
            except Exception as exc:
                exc._zbpp_in_stage = True
                self._note_failure(exc, f"{kind}(mb {mb})")
                self._vp.abort(f"rank {self.rank}: {kind}(mb {mb}) failed")
                raise

        return call

    def _make_nccl(self):
        """The NCCL transport: rank 0 makes the unique id and sends it to every rank (with a flag,
        so that a rank 0 that failed makes the others fail at once instead of at their timeout).
        Where ranks share a GPU (NCCL refuses them), the host transport staged through host memory
        instead, with a warning."""
        group, device = self._messages()
        # Asked before NCCL is (cuda.shared_gpus says why); bounded by the schedule's timeout.
        ids = self._exchange(cuda.gpu_identity(self.device), "finding the ranks that share a GPU")
        shared = cuda.shared_gpus(ids)
        if shared is not None:  # every rank finds the same, so every rank takes this path
            if device.type != "cpu":  # no host group to stage over
                raise _lib.ZbError(runtime.ZB_ERR_INVALID_ARGUMENT,
                                   f"rank {self.rank}: {shared}, and NCCL allows no two ranks of a communicator on "
                                   "one GPU. Give each rank its own GPU (torch.cuda.set_device(local_rank), or "
                                   "CUDA_VISIBLE_DEVICES), or pass cpu_group= (a gloo group over the pipeline's "
                                   "ranks) to the schedule so their messages can go through host memory")
            if not _SHARED_GPU_WARNED:
                _SHARED_GPU_WARNED.append(True)
                _log.warning("zbpp: %s. NCCL allows no two ranks of a communicator on one GPU, so their "
                             "activations and gradients go through host memory instead (the staged transport: "
                             "a copy to the host, a stream sync and a copy back per message), which is slower. "
                             "Give each rank its own GPU (torch.cuda.set_device(local_rank), or "
                             "CUDA_VISIBLE_DEVICES) for NCCL.", shared)
            return runtime.Transport.staged(self.transport.transport)
        uid = self._shared_nccl_id(group, device, "")
        # A failure of any rank reaches the others within a second through the job's c10d store,
        # under this pipeline's key (the one its gloo transport uses too).
        store = distributed._default_store()
        name = self._key if store is not None else None
        return runtime.Transport.nccl(self.rank, self.ranks, uid, self._store.backend, self.schedule,
                                      timeout=self.timeout, abort_store=store,
                                      abort_key=distributed.abort_key(name) if name else None)

    def _shared_nccl_id(self, group, device, what):
        """An NCCL unique id pipeline rank 0 makes and sends over `group` (messages on `device`) to
        every rank, with a flag, so that a rank 0 that could not make one makes the others fail at
        once instead of at their timeout. `what`: the communicator's name in that failure."""
        uid, failure = bytes(runtime.NCCL_UNIQUE_ID_BYTES), None
        if self.rank == 0:
            try:
                uid = runtime.nccl_unique_id()
            except _lib.ZbError as exc:
                failure = exc
        got = distributed.broadcast_bytes(bytes([failure is None]) + uid, _global(self.group, 0), group, device)
        if failure is not None:
            raise failure
        if got[0] != 1:
            raise _lib.ZbError(runtime.ZB_ERR_REMOTE, f"rank {self.rank}: pipeline rank 0 could not make an NCCL "
                                                      f"unique id{what} (its error says why)")
        return got[1:]

    def close(self):
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._vp is not None:
            self._vp.close()
        if self._dviews is not None:
            self._dviews.clear()  # views of the runner's buffers, which are gone now
        if self._nccl is not None:
            self._nccl.close()
            self._nccl = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._last_schedule is not None and self._last_schedule is not self.schedule:
            self._last_schedule.close()
        self.schedule.close()


# The schedule classes (_classes.py) subclass PipelineSchedule, so they are imported after it; its
# methods use _kind_name, _PY_KINDS, _group_ranks and _global from there, at call time only. Each
# name is a name of this package as before the split (schedules.py and scripts import them here).
from ._classes import (  # noqa: E402, F401
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleFromCSV,
    ScheduleGPipe,
    ScheduleGroupInterleaved1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleVHalf,
    ScheduleVMin,
    ScheduleZBAuto,
    ScheduleZBH1,
    ScheduleZBH2,
    ScheduleZBV,
    ScheduleZBVZeroBubble,
    get_schedule_class,
    _CLASSES,
    _global,
    _group_ranks,
    _Interleaved,
    _kind_class,
    _kind_name,
    _PipelineScheduleRuntime,
    _PY_KINDS,
    _ScheduleForwardOnly,
    _TORCH_NAMES,
)


# ---- torch.distributed.pipelining's other names -----------------------------------------------------
# The tracer frontend is torch's own (zbpp/pipelining/stage.py says why); build_stage makes zbpp
# stages from what it produces. The submodules schedules, stage and microbatch hold the rest.

def __getattr__(name):
    """The tracer's names (torch's Pipe, pipe_split, SplitPoint, pipeline) and the submodules'
    torch-compatible names, loaded on first use (importing zbpp.pipelining stays cheap)."""
    if name in ("schedules", "stage", "microbatch", "_utils"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in ("Pipe", "pipe_split", "SplitPoint", "pipeline"):
        from ._torch import need

        return getattr(need("_IR"), name)
    if name == "build_stage":
        from .stage import build_stage

        return build_stage
    if name in ("TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks"):
        from . import microbatch

        return getattr(microbatch, name)
    if name in ("PipeliningMetadataError", "generate_stage_to_rank_mapping"):
        from . import _utils

        return getattr(_utils, name)
    raise AttributeError(f"module 'zbpp.pipelining' has no attribute {name!r}")

