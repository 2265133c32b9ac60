"""Process bodies for the multi-process pipeline tests (torch.multiprocessing.spawn needs them in an
importable module). Each writes its findings to a file the test reads; nothing here asserts.

- `run_kinds`: trains the GPT of zbpp.examples.gpt with several schedule kinds, one after the
  other in the same process group, and saves each kind's final parameters (whole-model order),
  losses and whether the W store was empty after every step.
- `run_failure`: a 2-rank pipeline in which rank 1 dies or goes silent in a forward; rank 0
  records the error it got.
"""

import datetime
import os
import time
import traceback

import torch
import torch.distributed as dist


def store_url(key):
    """A file:// rendezvous unique to this spawn (the parent's pid and a key it chose, see
    fresh_key). A TCP port picked in the parent can be taken by another socket before rank 0 binds
    it, which made runs fail now and then with "Address already in use"; a file cannot be taken."""
    import tempfile

    return "file://" + os.path.join(tempfile.gettempdir(), f"zbpp-store-{os.getppid()}-{key}")


_KEYS = iter(range(1, 1 << 62))


def fresh_key(prefix="job"):
    """A rendezvous key this test process never handed out before, its file removed if one is
    left. Keys were once free TCP port numbers, which the kernel hands out again: a rank that a
    failure test killed leaves its file (and its listening address) behind, and a later spawn that
    drew the same number met that dead address and failed with "Connection refused"."""
    import tempfile

    key = f"{prefix}-{next(_KEYS)}"
    path = os.path.join(tempfile.gettempdir(), f"zbpp-store-{os.getpid()}-{key}")
    if os.path.exists(path):
        os.remove(path)
    return key


def _init(rank, world, port, timeout=60.0):
    dist.init_process_group("gloo", init_method=store_url(port), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    torch.set_num_threads(1)


def model_config(layers=4):
    from zbpp.examples import gpt

    return gpt.GPTConfig(vocab=32, seq=8, d_model=16, n_head=2, n_layer=layers, ffn=2)


def train_kind(rank, world, kind, chunks, m, batch, steps, seed, csv=None, lr=1e-2, layers=4, placement=None,
               offload=None, times=None, mem_limit=None, offload_paired=False, revert_margin=None):
    import zbpp
    from zbpp.examples import gpt
    from zbpp.split import default_store

    if revert_margin is not None:  # a replan's trial reverts when it measures slower by this share
        from zbpp.pipelining import _plan

        _plan.REVERT_MARGIN = revert_margin

    S = world * chunks
    modules = gpt.build_stages(model_config(layers), S, seed=seed)
    cls = zbpp.get_schedule_class(kind) if csv is None else zbpp.ScheduleFromCSV
    if placement == "loop":  # as torch users build interleaved stages: stage s on rank s mod p
        mine = [c * world + rank for c in range(chunks)]
    else:
        probe = zbpp.Schedule.generate(kind, p=world, m=m, v=chunks) if csv is None else zbpp.Schedule.from_csv(csv)
        mine = probe.rank_stages(rank)
        probe.close()
    stages = [zbpp.PipelineStage(zbpp.split_linear(modules[s]), s, S, "cpu") for s in mine]
    extra = {"csv": csv} if csv is not None else {}
    if offload is not None:
        extra.update(offload=offload, times=times, mem_limit=mem_limit, offload_paired=offload_paired)
    sched = cls(stages, m, loss_fn=gpt.loss_fn, timeout=60.0, **extra)
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, foreach=False)
    data = gpt.Batches(8, batch, seed=seed)
    losses, store_empty = [], True
    for _ in range(steps):
        x, y = data.next()
        got = []
        args = (x,) if sched.holds_first else ()
        kw = {"target": y, "losses": got} if sched.holds_loss else {}
        sched.step(*args, **kw)
        st = default_store()
        store_empty &= st.store.pending(-1) == 0 and st.live_entries() == 0
        opt.step()
        opt.zero_grad(set_to_none=True)
        if got:
            losses.append([float(v) for v in got])
    bubble = sched.timeline().measured.bubble_rate
    report = sched.offload_report() if offload is not None else None
    sched_copy_times = [sched.schedule.op_time("OFFLOAD", st) > 0 for st in range(sched.schedule.stages)]
    copies = sum(op.type == "OFFLOAD" for op in sched.schedule.rank_ops(rank)) if offload is not None else 0
    sched.close()
    return {
        "kind": kind,
        "stages": mine,
        "params": {s: [p.detach().clone() for p in modules[s].parameters()] for s in mine},
        "losses": losses,
        "store_empty": store_empty,
        "bubble": bubble,
        "offload": report,
        "offloads": copies,
        "copy_times": offload is not None and any(sched_copy_times),
        "plan_offloaded": getattr(sched.plan_info, "offloaded", 0) if sched.plan_info is not None else 0,
        "reverted": sched.plan_info is not None and sched.plan_info.reverted,
    }


def run_each(rank, world, port, cases, out_dir, train):
    """train(case) for every case in one process group; the results (or the first failure's
    traceback, last) saved as rank<r>.pt in out_dir."""
    _init(rank, world, port)
    results = []
    try:
        for case in cases:
            results.append(train(case))
    except BaseException:  # noqa: BLE001 - the test reads the traceback
        results.append({"error": traceback.format_exc()})
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_kinds(rank, world, port, cases, out_dir):
    run_each(rank, world, port, cases, out_dir, lambda case: train_kind(rank, world, **case))


class _Saboteur(torch.nn.Module):
    """Passes its input through; on the given forward call it kills the process ("die"), sleeps
    ("silent") or raises ("raise": the process stays alive)."""

    def __init__(self, mode, at_call):
        super().__init__()
        self.mode, self.at_call, self.calls = mode, at_call, 0
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at_call:
            if self.mode == "die":
                os._exit(17)
            if self.mode == "raise":
                raise ValueError("the stage's own error")
            time.sleep(4.0)
        return self.lin(x)


def run_failure(rank, world, port, mode, out_dir):
    """1F1B on `world` ranks; the last rank's module fails on a forward as `mode` says. "die" and
    "silent" run with a 1 s timeout; "raise" with the default (300 s), and the raising process then
    stays alive for 20 s, so no connection closes: the others must learn of the failure from zbpp's
    abort signal. Saves each rank's seconds to fail and its error."""
    import zbpp

    _init(rank, world, port)
    torch.manual_seed(0)
    last = rank == world - 1
    stage_mod = _Saboteur(mode, at_call=2 if mode == "raise" else 4) if last else torch.nn.Linear(4, 4)
    stage = zbpp.PipelineStage(stage_mod, rank, world, "cpu")
    sched = zbpp.Schedule1F1B(stage, 4, loss_fn=lambda out, y: ((out - y) ** 2).mean(),
                              timeout=300.0 if mode == "raise" else 1.0)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    text, started = "no error", time.time()
    try:
        for _ in range(3):
            if rank == 0:
                sched.step(x)
            elif last:
                sched.step(target=y)
            else:
                sched.step()
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        text = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{time.time() - started:.2f}\n{text}")
    if mode == "raise" and last:
        time.sleep(20)  # alive and silent: its pairs stay open
    os._exit(0)  # the process group is broken; do not wait for it at exit


def chain(n):
    """The small model and batch the torch-API tests train: n Linear(8, 8)+Tanh layers from seed 0,
    and (x, y) of 4 rows from seed 1."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(n)]
    g = torch.Generator().manual_seed(1)
    return layers, torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def run_torch_orders(rank, world, port, out_dir):
    """2 ranks: user orders as PyTorch's CustomSchedulesTest writes them (PipelineScheduleMulti
    subclasses that set pipeline_order): a V over 4 stages, and an unbalanced map (stages 0, 1, 4
    on rank 0; 2, 3 on rank 1) with two microbatches, split I/W on one stage; also eval() and a
    LoopedBFS step on the unbalanced stages' neighbours. Saves each case's gradients and losses."""
    from zbpp.pipelining import PipelineStage
    from zbpp.pipelining.schedules import B, F, I, PipelineScheduleMulti, W, _Action

    _init(rank, world, port)
    out = {}
    try:
        _, x, y = chain(0)

        def A(text):
            return [_Action.from_str(c) if c else None for c in text.split()]

        cases = {
            "v": (4, {0: [0, 3], 1: [1, 2]}, 1, {
                0: A("0F0 3F0 3B0 0B0"),
                1: A("1F0 2F0 2B0 1B0")}),
            "unbalanced": (5, {0: [0, 1, 4], 1: [2, 3]}, 2, {
                0: A("0F0 1F0 0F1 1F1 4F0 4I0 4F1 4I1 4W0 4W1 1B0 0B0 1B1 0B1"),
                1: A("2F0 3F0 2F1 3F1 3B0 2B0 3B1 2B1")}),
        }
        for name, (S, rank_stages, m, order) in cases.items():
            mods = chain(S)[0]
            stages = [PipelineStage(mods[s], s, S, "cpu") for s in rank_stages[rank]]

            class Custom(PipelineScheduleMulti):
                def __init__(self, stages, n, loss_fn=None):
                    super().__init__(stages, n, loss_fn=loss_fn)
                    self.pipeline_order = order

            sched = Custom(stages, m, loss_fn=torch.nn.MSELoss())
            losses = []
            evaluated = []
            if rank == 0:
                got = sched.eval(x, target=y, losses=evaluated)
                sched.step(x, target=y, losses=losses)
            else:
                got = sched.eval()
                sched.step()
            out[name] = {"grads": {s: [p.grad.clone() for p in mods[s].parameters()] for s in rank_stages[rank]},
                         "losses": [float(v) for v in losses], "eval_losses": [float(v) for v in evaluated],
                         "eval_out": got, "placement": sched.schedule.placement,
                         "stage_ranks": [sched.schedule.stage_rank(s) for s in range(S)]}
        # zbpp needs a loss_fn only where the loss is computed (torch wants it on every rank): the
        # ranks agree at the first step that the pipeline trains.
        from zbpp.pipelining import Schedule1F1B

        mods = chain(2)[0]
        stage = PipelineStage(mods[rank], rank, 2, "cpu")
        sched = Schedule1F1B(stage, 2, loss_fn=torch.nn.MSELoss() if rank == 1 else None)
        losses = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        out["loss-on-last-only"] = {"grads": {rank: [p.grad.clone() for p in mods[rank].parameters()]},
                                    "losses": [float(v) for v in losses]}
    except BaseException:  # noqa: BLE001 - the test reads the traceback
        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(out_dir, f"orders{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_torch_runtime_on_zbpp_plan(rank, world, port, csv_path, num_stages, m, out_dir):
    """torch's own _PipelineScheduleRuntime runs a plan zbpp wrote in torch's compute_comms CSV
    (Schedule.to_csv(comms=True)); saves this rank's gradients and losses."""
    from torch.distributed import pipelining as tp

    from zbpp.schedule import Schedule

    _init(rank, world, port)
    out = {}
    try:
        with open(csv_path) as f:
            plan = Schedule.from_csv(f.read())
        mine = plan.rank_stages(rank)
        mods, x, y = chain(num_stages)
        stages = [tp.PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
        sched = tp.schedules._PipelineScheduleRuntime(stages, m, loss_fn=torch.nn.MSELoss())
        sched._load_csv(csv_path, format="compute_comms")
        losses = []
        kwargs = {}
        if num_stages - 1 in mine:
            kwargs = {"target": y, "losses": losses}
        sched.step(*((x,) if 0 in mine else ()), **kwargs)
        out = {"grads": {s: [p.grad.clone() for p in mods[s].parameters()] for s in mine},
               "losses": [float(v) for v in losses]}
    except BaseException:  # noqa: BLE001 - the test reads the traceback
        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(out_dir, f"runtime{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_custom_functions(rank, world, port, out_dir, backward_first):
    """2 ranks, DualPipeV over a V of 4 stages (0, 3 | 1, 2), 4 microbatches, two steps, with custom
    functions for FORWARD and OVERLAP_F_B written as a torch user writes them against torch's
    runtime (schedule.fwd_recv_ops and torch's _wait_batch_p2p, stage.forward_one_chunk,
    _maybe_compute_loss, set_local_fwd_input, bwd_recv_ops, _maybe_get_loss, backward_counter,
    backward_one_chunk, scale_grads, set_local_bwd_input / get_local_bwd_output). backward_first:
    the pair's function runs its backward before its forward (both inputs are there, both
    outputs leave after). Saves gradients, losses, output and the calls made."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    from zbpp.pipelining import PipelineStage
    from zbpp.pipelining.schedules import FORWARD, OVERLAP_F_B, ScheduleDualPipeV, _PipelineScheduleRuntime

    _init(rank, world, port)
    out = {"forward": [], "overlap": []}
    try:
        S, m = 4, 4
        mods, x, y = chain(S)
        mine = [0, 3] if rank == 0 else [1, 2]
        stages = [PipelineStage(mods[s], s, S, "cpu") for s in mine]
        sched = ScheduleDualPipeV(stages, m, loss_fn=torch.nn.MSELoss(), scale_grads=False)
        sched._prepare_schedule_with_comms(sched.pipeline_order)

        def by_index(schedule):
            return {st.stage_index: st for st in schedule._stages}

        def forward(action, ctx):
            schedule = ctx.schedule_ref
            assert isinstance(schedule, _PipelineScheduleRuntime)
            here = by_index(schedule)
            stage, mb = here[action.stage_index], action.microbatch_index
            out["forward"].append((stage.stage_index, mb))
            if not stage.is_first and stage.stage_index - 1 not in here:
                assert (stage.stage_index, mb) in schedule.fwd_recv_ops, f"{action} before its input"
                _wait_batch_p2p(schedule.fwd_recv_ops.pop((stage.stage_index, mb)))
            output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb] if ctx.arg_mbs else (),
                                             ctx.kwarg_mbs[mb] if ctx.kwarg_mbs else {})
            schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
            if stage.stage_index + 1 in here:
                here[stage.stage_index + 1].set_local_fwd_input(output, mb)

        def backward(action, ctx):
            schedule = ctx.schedule_ref
            here = by_index(schedule)
            stage, mb = here[action.stage_index], action.microbatch_index
            if not stage.is_last and stage.stage_index + 1 not in here:
                assert (stage.stage_index, mb) in schedule.bwd_recv_ops, f"{action} before its input"
                _wait_batch_p2p(schedule.bwd_recv_ops.pop((stage.stage_index, mb)))
            loss = schedule._maybe_get_loss(stage, mb)
            schedule.backward_counter[stage.stage_index] += 1
            last = schedule.backward_counter[stage.stage_index] == schedule._n_microbatches
            stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
            if last:
                stage.scale_grads(schedule._n_microbatches if schedule.scale_grads else 1)
            if stage.stage_index - 1 in here:
                here[stage.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

        def overlap(action, ctx):
            f, b = action.sub_actions
            out["overlap"].append((f.stage_index, f.microbatch_index, b.stage_index, b.microbatch_index))
            for sub in ((b, f) if backward_first else (f, b)):
                (forward if sub is f else backward)(sub, ctx)

        sched.register_custom_function(FORWARD, forward)
        sched.register_custom_function(OVERLAP_F_B, overlap)
        losses, got = [], None
        for _ in range(2):
            for mod in mods:
                mod.zero_grad(set_to_none=True)
            if rank == 0:
                got = sched.step(x, target=y, losses=losses)
            else:
                sched.step()
        out.update(grads={s: [p.grad.clone() for p in mods[s].parameters()] for s in mine},
                   losses=[float(v) for v in losses], out=got)
    except BaseException:  # noqa: BLE001 - the test reads the traceback
        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(out_dir, f"custom{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_close_order(rank, world, port, out_dir):
    """2 ranks: a schedule and the post-validated optimizer that shares its transport, closed in
    either order: the one closed first leaves the transport to the other (the library refuses to
    free a transport in use), and the transport is freed once both are closed."""
    import zbpp

    _init(rank, world, port)
    out = {}
    try:
        for order in ("schedule-first", "optimizer-first"):
            torch.manual_seed(0)
            stage = zbpp.PipelineStage(torch.nn.Linear(4, 4), rank, world, "cpu")
            sched = zbpp.Schedule1F1B(stage, 2, loss_fn=lambda o, y: ((o - y) ** 2).mean())
            opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
            post = zbpp.PostValidatedOptimizer.for_schedule(opt, sched)
            x, y = torch.randn(4, 4), torch.randn(4, 4)
            sched.step(x) if rank == 0 else sched.step(target=y)
            post.step()
            transport = sched.transport
            first, second = (sched, post) if order == "schedule-first" else (post, sched)
            first.close()
            pending_between = bool(transport.close_pending)
            second.close()
            out[order] = {"pending_between": pending_between, "freed": not transport.transport._h}
    except BaseException:  # noqa: BLE001 - the test reads the traceback
        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(out_dir, f"close{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_pass_through(rank, world, port, out_dir):
    """3 ranks over gloo: Linear, Identity, Identity. The middle stage hands on its input and the
    last returns its input: both are views of the runner's receive buffers, which zero-copy stages
    reuse after the microbatch's W. Saves the merged output and the first stage's gradients."""
    import zbpp

    _init(rank, world, port)
    out = {}
    try:
        torch.manual_seed(0)
        mods = [torch.nn.Linear(6, 6), torch.nn.Identity(), torch.nn.Identity()]
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 6, generator=g)
        stage = zbpp.PipelineStage(mods[rank], rank, world, "cpu")
        sched = zbpp.ScheduleZBH1(stage, 8, loss_fn=torch.nn.MSELoss()) if hasattr(zbpp, "ScheduleZBH1") else \
            zbpp.get_schedule_class("zb-h1")(stage, 8, loss_fn=torch.nn.MSELoss())
        for _ in range(2):
            mods[rank].zero_grad()
            got = sched.step(x) if rank == 0 else sched.step(target=y) if rank == world - 1 else sched.step()
        out["output"] = got
        out["x"], out["y"] = x, y
        if rank == 0:
            out["grads"] = [p.grad.clone() for p in mods[0].parameters()]
            out["params"] = [p.detach().clone() for p in mods[0].parameters()]
    except BaseException:  # noqa: BLE001 - the test reads the traceback
        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(out_dir, f"pass{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()



def run_offload_memory(rank, world, port, kind, chunks, m, times, out_dir, csv=None):
    """Equal MLP stages (the plan's memory model counts every stage alike), trained 2 steps with
    offload="auto" (or, with `csv`, one stage per rank under ScheduleFromCSV with the copies the
    CSV holds); saves this rank's offload_report, its number of OFFLOAD ops and its stages."""
    import zbpp

    _init(rank, world, port)
    result = {}
    try:
        S = world * chunks
        torch.manual_seed(5)
        modules = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
                   for _ in range(S)]
        probe = zbpp.Schedule.generate(kind, p=world, m=m, v=chunks) if csv is None else zbpp.Schedule.from_csv(csv)
        mine = probe.rank_stages(rank)
        probe.close()
        stages = [zbpp.PipelineStage(modules[s], s, S, "cpu") for s in mine]
        loss = lambda y, t: ((y - t) ** 2).mean()  # noqa: E731
        sched = (zbpp.get_schedule_class(kind)(stages, m, loss_fn=loss, timeout=60.0, offload="auto", times=times)
                 if csv is None else zbpp.ScheduleFromCSV(stages, m, loss_fn=loss, csv=csv, timeout=60.0))
        x, y = torch.randn(m * 32, 64), torch.randn(m * 32, 64)
        for _ in range(2):
            args = (x,) if sched.holds_first else ()
            kw = {"target": y} if sched.holds_loss else {}
            sched.step(*args, **kw)
        result = {"report": sched.offload_report(), "stages": mine,
                  "offloads": sum(op.type == "OFFLOAD" for op in sched.schedule.rank_ops(rank))}
        sched.close()
    except BaseException:  # noqa: BLE001 - the test reads the traceback
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
