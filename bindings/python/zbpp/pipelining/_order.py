"""torch's schedule IR (`pipeline_order`: rank -> list of `_Action` or None) and zbpp's op lists,
both ways.

Why: torch users see and write schedules as `pipeline_order` (a subclass of PipelineScheduleMulti
sets it; `_load_csv` fills it; torch's tests lower it with `_add_send_recv` and simulate it).
zbpp's C core plans and runs op lists (zb_op_t). So every zbpp schedule shows its plan as torch's
IR, and an IR a user sets becomes a zbpp schedule that the C library validates and the C runner
runs. Only compute actions map to ops: the runner does its own transfers, so SEND_F/RECV_F/
SEND_B/RECV_B cells (torch's compute_comms form) are read and dropped, and so is REDUCE_GRAD
(torch >= 2.10 scales a stage's gradients there; zbpp by its own scale_grads); OVERLAP_F_B pairs
run as their sub-actions, one after the other. UNSHARD and RESHARD belong to FSDP-sharded stages,
which zbpp does not run: they are refused with a message.

The stage-to-rank map comes from the order itself (torch's `_validate_schedule` infers it the
same way): loop placement (stage s on rank s mod p), the V (v = 2, stage s on rank s for s < p,
else 2p-1-s), or any other map where every stage lives on one rank and every rank holds a stage
(torch's custom stage ids; ranks may hold different numbers of stages), which the C library keeps
as an explicit map.
"""

from ..schedule import Schedule
from ._torch import need

_s = need("schedules")

# torch's computation type -> zbpp's op type ("B" is torch's full backward, zbpp's "BW").
_TO_ZB = {_s.FORWARD: "F", _s.BACKWARD_INPUT: "B", _s.BACKWARD_WEIGHT: "W", _s.FULL_BACKWARD: "BW"}
_FROM_ZB = {v: k for k, v in _TO_ZB.items()}
# Read and dropped: the runner makes its own transfers, and zbpp scales gradients by its own
# scale_grads where torch >= 2.10 does it at REDUCE_GRAD.
_COMMS = tuple(getattr(_s, n) for n in ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD") if hasattr(_s, n))
_SHARDING = tuple(getattr(_s, n) for n in ("UNSHARD", "RESHARD"))


def to_actions(schedule):
    """The schedule's op lists as torch's pipeline_order: {rank: [_Action, ...]} (no idle steps:
    the C runner waits on its transfers, as torch's runtime skips None)."""
    order = {}
    for r in range(schedule.ranks):
        ops = schedule.rank_ops(r)
        copy = next((op for op in ops if op.type not in _FROM_ZB), None)
        if copy is not None:
            raise ValueError(f"zbpp: rank {r} has {copy}: torch's pipeline_order has no action for zbpp's "
                             "OFFLOAD/RELOAD copies or Vocabulary Parallelism's S/T/IF/IB passes")
        order[r] = [_s._Action(op.stage, _FROM_ZB[op.type], op.mb) for op in ops]
    return order


def _compute(action, rank, step):
    """The zbpp ops of one action: [] for a transfer, its sub-actions for OVERLAP_F_B."""
    if action is None:
        return []
    if not isinstance(action, _s._Action):
        raise TypeError(f"zbpp: pipeline_order[{rank}][{step}] is {action!r}; expected a torch _Action or None")
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [op for sub in subs for op in _compute(sub, rank, step)]
    ctype = action.computation_type
    if ctype in _TO_ZB:
        if action.microbatch_index is None:
            raise ValueError(f"zbpp: pipeline_order[{rank}][{step}] ({action}) has no microbatch index")
        return [(_TO_ZB[ctype], action.stage_index, action.microbatch_index)]
    if ctype in _COMMS:
        return []  # the runner's own transfers take their place
    if ctype in _SHARDING:
        raise NotImplementedError(f"zbpp: pipeline_order[{rank}][{step}] is {action}: {ctype.name} actions manage "
                                  f"FSDP-sharded stages, which zbpp does not run; use unsharded stages and "
                                  f"drop the UNSHARD and RESHARD actions")
    raise ValueError(f"zbpp: pipeline_order[{rank}][{step}] is {action}, which zbpp cannot run; allowed: F, I, W, "
                     f"B (full backward), OVERLAP_F_B and the transfers SEND_F, RECV_F, SEND_B, RECV_B")


def rank_ops(order, p):
    """{rank: [_Action or None]} -> one list of (type, stage, mb) per rank, with a clear error for
    a missing rank."""
    if not isinstance(order, dict):
        raise TypeError(f"zbpp: pipeline_order must be a dict of rank -> list of _Action, got {type(order).__name__}")
    extra = sorted(set(order) - set(range(p)))
    if extra:
        raise ValueError(f"zbpp: pipeline_order has rank(s) {extra}; this pipeline has ranks 0..{p - 1}")
    missing = [r for r in range(p) if r not in order]
    if missing:
        raise ValueError(f"zbpp: pipeline_order has no actions for rank(s) {missing} of the {p} ranks")
    return [[op for step, a in enumerate(order[r]) for op in _compute(a, r, step)] for r in range(p)]


def placement_of(ops, p, num_stages):
    """'loop', 'v' or the stage-to-rank map (a list) that the ops imply; ValueError naming the
    stage when one runs on two ranks or none."""
    where = {}
    for r, lst in enumerate(ops):
        for _, stage, _mb in lst:
            if not 0 <= stage < num_stages:
                raise ValueError(f"zbpp: pipeline_order puts stage {stage} on rank {r}; stages are 0..{num_stages - 1}")
            if where.setdefault(stage, r) != r:
                raise ValueError(f"zbpp: pipeline_order runs stage {stage} on ranks {where[stage]} and {r}; each "
                                 f"stage lives on one rank")
    missing = [s for s in range(num_stages) if s not in where]
    if missing:
        raise ValueError(f"zbpp: pipeline_order has no actions for stage(s) {missing} of the {num_stages} stages")
    if num_stages % p == 0 and all(r == s % p for s, r in where.items()):
        return "loop"
    if num_stages == 2 * p and all(r == (s if s < p else 2 * p - 1 - s) for s, r in where.items()):
        return "v"
    return [where[s] for s in range(num_stages)]  # torch's custom stage ids: an explicit map


def schedule_from_actions(order, p, num_stages, m, **cost_args):
    """A validated zbpp Schedule (kind "custom") for torch's IR; ZbError naming the rank, the
    position and the rule when the order cannot run (a missing op, a deadlock, ...)."""
    ops = rank_ops(order, p)
    placement = placement_of(ops, p, num_stages)
    v = num_stages // p if isinstance(placement, str) else None
    schedule = Schedule.from_ops(ops, m, placement=placement, v=v, **cost_args)
    try:
        schedule.validate()
    except BaseException:
        schedule.close()
        raise
    return schedule


def looped_bfs(p, v, m):
    """Breadth-first pipelining (Lamy-Poirier, 2022; torch's ScheduleLoopedBFS): each rank runs
    every microbatch forward through its first chunk, then its next chunk, ...; then the fused
    backwards, last chunk first, microbatches in reverse. Loop placement; memory v * m."""
    ops = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        lst = [("F", s, i) for s in stages for i in range(m)]
        lst += [("BW", s, i) for s in reversed(stages) for i in reversed(range(m))]
        ops.append(lst)
    return ops


def with_comms(order, schedule, ranks, num_stages, m):
    """The order with torch's transfer actions added by torch's own lowering (REDUCE_GRAD where
    this torch has it, then _add_send_recv), as torch's runtime makes pipeline_order_with_comms,
    for _dump_csv(format="compute_comms"). The stage-to-rank map is the schedule's, or (before
    one is made) the one the order implies."""
    compute = {r: [a for a in order.get(r, []) if a is not None and a.is_compute_op] for r in range(ranks)}
    if hasattr(_s, "_add_reduce_grad"):
        lowered = {r: _s._add_reduce_grad(acts, m) for r, acts in compute.items()}
    else:
        lowered = compute
    if schedule is not None:
        where = schedule.stage_rank
    else:
        placement = placement_of(rank_ops(compute, ranks), ranks, num_stages)
        if placement == "loop":
            def where(s):
                return s % ranks
        elif placement == "v":
            def where(s):
                return s if s < ranks else 2 * ranks - 1 - s
        else:
            where = placement.__getitem__
    return _s._add_send_recv(lowered, stage_to_rank=where, num_stages=num_stages)


def dualpipe_v(p, m):
    """DeepSeek's DualPipeV (DualPipe folded onto the V placement; torch's ScheduleDualPipeV) as
    torch's IR, with its overlapped forward/backward pairs as OVERLAP_F_B actions. Rank r holds
    stages r (the V's way down, "s0") and 2p-1-r (its way up, "s1"). In eight phases: forwards
    of s0 to fill the pipe, then of both stages; split backwards of s1 with their W's behind;
    the steady phase of pairs F(s0)+B(s1) and F(s1)+B(s0); then the drain, where the last
    backwards split into I and W again so W's fill the holes. m >= 2p."""
    A, F, I, W, B = _s._Action, _s.FORWARD, _s.BACKWARD_INPUT, _s.BACKWARD_WEIGHT, _s.FULL_BACKWARD
    order = {}
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        acts, nf, nb, pending_w = [], {s0: 0, s1: 0}, {s0: 0, s1: 0}, []

        def forward(s, out=acts, nf=nf):
            out.append(A(s, F, nf[s]))
            nf[s] += 1

        def backward(s, split, out=acts, nb=nb, pending_w=pending_w):
            mb = nb[s]
            nb[s] += 1
            out.append(A(s, I if split else B, mb))
            if split:
                pending_w.append((s, mb))

        def weight(out=acts, pending_w=pending_w):
            if pending_w:
                s, mb = pending_w.pop(0)
                out.append(A(s, W, mb))

        def pair(fs, bs, out=acts, nf=nf, nb=nb):
            f, b = A(fs, F, nf[fs]), A(bs, B, nb[bs])
            nf[fs] += 1
            nb[bs] += 1
            out.append(A(-1, _s.OVERLAP_F_B, None, (f, b)))

        for _ in range(2 * (p - r - 1)):
            forward(s0)
        for _ in range(r + 1):
            forward(s0)
            forward(s1)
        for _ in range(p - r - 1):
            backward(s1, True)
            weight()
            forward(s1)
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:  # the bottom of the V: no pair yet, which shortens the bubble
                forward(s0)
                backward(s1, False)
            else:
                pair(s0, s1)
            pair(s1, s0)
        for _ in range(p - r - 1):
            backward(s1, False)
            pair(s1, s0)
        split, half = False, (r + 1) // 2
        for i in range(r + 1):
            split = split or (i == half and r % 2 == 1)
            backward(s1, split)
            split = split or (i == half and r % 2 == 0)
            backward(s0, split)
        for _ in range(p - r - 1):
            weight()
            backward(s0, split)
        for _ in range(r + 1):
            weight()
        order[r] = acts
    return order
