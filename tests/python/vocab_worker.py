"""The model and process bodies of test_vocab_pipeline.py (torch.multiprocessing.spawn needs them in
an importable module). Nothing here asserts: each rank saves what it got, the test compares.

The model: a token embedding [V, H], `layers` blocks (Linear + Tanh), an output layer [V, H]
without bias and the cross entropy, built from one seed on every rank and in the reference. With
vocab_parallel the stages hold the blocks only; the schedule holds the embedding and output layer
split over the ranks. The reference runs the same microbatches one after the other in one
process: loss = mean cross entropy over a microbatch's tokens, gradients summed over the
microbatches and divided by their number (what scale_grads does), SGD on every parameter.
"""

import contextlib
import os

import torch
import torch.distributed as dist

import pipeline_worker

H = 8


def build(V, layers, tied=False, seed=0):
    """(embedding, output layer, blocks): the whole model, the same bits wherever it is built."""
    g = torch.Generator().manual_seed(seed)
    emb, out = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    blocks = [torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh()) for _ in range(layers)]
    with torch.no_grad():
        for prm in [emb.weight, out.weight] + [q for b in blocks for q in b.parameters()]:
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.5)
    if tied:
        out.weight = emb.weight
    return emb, out, blocks


def batches(V, m, steps, rows=2, seq=3, seed=1, ignore=False):
    """steps x (tokens, targets), each [m * rows, seq]; ignore: about a fifth of the targets are
    -100 (F.cross_entropy's ignore_index: padding a loss skips)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x, y = torch.randint(0, V, (m * rows, seq), generator=g), torch.randint(0, V, (m * rows, seq), generator=g)
        if ignore:
            y = torch.where(y % 5 == 0, torch.full_like(y, -100), y)
        out.append((x, y))
    return out


def reference(case):
    """What one process gets: per step the microbatches' losses; at the end every parameter, and
    the eval step's losses."""
    V, m, layers = case["V"], case["m"], case["layers"]
    emb, out, blocks = build(V, layers, case.get("tied", False))
    params = list({id(q): q for q in [emb.weight, out.weight] + [q for b in blocks for q in b.parameters()]}.values())
    opt = torch.optim.SGD(params, lr=case.get("lr", 0.5))
    smoothing = case.get("label_smoothing", 0.0)

    def run(x, y):
        h = emb(x)
        for b in blocks:
            h = b(h)
        return torch.nn.functional.cross_entropy(out(h).reshape(-1, V), y.reshape(-1), label_smoothing=smoothing)

    steps = []
    data = batches(V, m, case["steps"] + 1, ignore=case.get("ignore", False))
    for x, y in data[:-1]:
        losses = []
        for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
            loss = run(xi, yi)
            loss.backward()
            losses.append(float(loss.detach()))
        for q in params:
            q.grad.div_(m)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(losses)
    with torch.no_grad():
        x, y = data[-1]
        evals = [float(run(xi, yi)) for xi, yi in zip(x.tensor_split(m), y.tensor_split(m))]
    return {"losses": steps, "eval": evals, "embedding": emb.weight.detach().clone(),
            "output": out.weight.detach().clone(), "blocks": [b[0].weight.detach().clone() for b in blocks]}


def _guard(case):
    """case["meta_default"]: the steps, eval() and gather() run with torch's default device set to
    "meta", so a tensor the schedule's passes make without naming its device lands there and the
    step fails (mixing meta and real tensors): what, on CUDA stages, would be a CPU tensor among
    the GPU's. The host check that the passes make every tensor where the stages are."""
    return torch.device("meta") if case.get("meta_default") else contextlib.nullcontext()


def train(rank, world, case, device="cpu"):
    import zbpp

    V, m, layers, kind, chunks = case["V"], case["m"], case["layers"], case["kind"], case["chunks"]
    device = case.get("device", device)
    if device == "cuda:each":  # a GPU per rank
        device = f"cuda:{rank % torch.cuda.device_count()}"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    emb, out, blocks = build(V, layers, case.get("tied", False))
    probe = zbpp.Schedule.generate(kind, p=world, m=m, v=chunks)
    S, mine = probe.stages, probe.rank_stages(rank)
    probe.close()
    per = layers // S
    stages = [zbpp.PipelineStage(torch.nn.Sequential(*blocks[s * per:(s + 1) * per]).to(device), s, S, device)
              for s in mine]
    vp = zbpp.VocabParallel(out, emb, fused=case.get("fused", True), label_smoothing=case.get("label_smoothing", 0.0),
                            pad_multiple=case.get("pad_multiple", 1), times=case.get("vocab_times"))
    sched = zbpp.get_schedule_class(kind)(stages, m, vocab_parallel=vp, timeout=60.0)
    params = [q for st in stages for q in st.submod.parameters()] + vp.parameters()
    opt = torch.optim.SGD(params, lr=case.get("lr", 0.5))
    data = batches(V, m, case["steps"] + 1, ignore=case.get("ignore", False))
    steps, outputs = [], None
    for x, y in data[:-1]:
        got = []
        x, y = x.to(device), y.to(device)
        args = (x,) if sched.holds_first else ()
        kw = {"target": y, "losses": got} if sched.holds_loss else {}
        with _guard(case):
            outputs = sched.step(*args, **kw)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append([float(v) for v in got])
    # After a training step the lanes hold nothing of it (their results are microbatches of hidden
    # states and gradients).
    lanes_empty = all(not lane.results and not lane.started for lane in sched._vp.lanes.values())
    x, y = (t.to(device) for t in data[-1])
    evals = []
    with _guard(case):
        sched.eval(*((x,) if sched.holds_first else ()), **({"target": y, "losses": evals} if sched.holds_loss else {}))
        whole = vp.gather()
    bubble = sched.timeline().measured.bubble_rate
    kinds = sorted({op.type for op in sched.schedule.rank_ops(rank)})
    sched.close()
    return {"losses": [s for s in steps if s], "eval": [float(v) for v in evals], "stages": mine,
            "blocks": {s * per + i: blocks[s * per + i][0].weight.detach().cpu() for s in mine for i in range(per)},
            "embedding": whole["embedding.weight"].cpu(), "output": whole["output.weight"].cpu(),
            "shard_device": str(vp.parameters()[0].device),
            "outputs_shape": tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else None,
            "op_types": kinds, "bubble": bubble, "shard_rows": vp.parameters()[0].shape[0],
            "replanned": sched._vp.replanned,
            "collectives": sched._vp.collectives,
            "lanes_empty": lanes_empty}


def run_cases(rank, world, key, cases, out_dir):
    pipeline_worker.run_each(rank, world, key, cases, out_dir, lambda case: train(rank, world, case))


class _Fails(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("a stage failed on purpose")


def run_failure(rank, world, key, mode, out_dir):
    """The last rank's stage raises ("stage"), or its first T pass ("pass": the other ranks then
    wait in a collective of the passes, not in a transfer), or stage 0's rank passes float tokens
    ("tokens"), or the last rank gives no target ("no-target": it fails before the lanes connect),
    or rank 0 turns the replan off ("disagree"): every rank records the error it got and how long
    it took."""
    import time

    import zbpp

    pipeline_worker._init(rank, world, key)
    emb, out, blocks = build(16, world)
    S = world
    mod = _Fails() if (rank == world - 1 and mode == "stage") else blocks[rank]
    stage = zbpp.PipelineStage(mod, rank, S, "cpu")
    extra = {"plan_from_measured": False} if mode == "disagree" and rank == 0 else {}
    sched = zbpp.Schedule1F1B(stage, 4, vocab_parallel=zbpp.VocabParallel(out, emb), timeout=60.0, **extra)
    if mode == "pass" and rank == world - 1:
        def fail(mb):
            raise RuntimeError("a pass failed on purpose")

        sched._vp._pass_T = fail
    x, y = batches(16, 4, 1)[0]
    if mode == "tokens":
        x = x.float()
    t0 = time.monotonic()
    give_target = sched.holds_loss and mode != "no-target"
    try:
        sched.step(*((x,) if sched.holds_first else ()), **({"target": y} if give_target else {}))
        err = None
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        err = f"{type(exc).__name__}: {exc}"
    torch.save({"error": err, "seconds": time.monotonic() - t0}, os.path.join(out_dir, f"rank{rank}.pt"))
    # Alive, its transports open, until every rank has its error: a rank that failed and stays
    # (a notebook, a loop that catches) must not leave its peers waiting on its sockets.
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out_dir, f"rank{r}.pt"))
                                                  for r in range(world)):
        time.sleep(0.1)
    try:
        sched.close()
    except Exception:  # noqa: BLE001 - a failed pipeline's close may refuse
        pass
    os._exit(0)  # a failed gloo pipeline cannot be torn down cleanly (a posted receive stays posted)


def run_csv_grads(rank, world, key, csv, out_dir):
    """One step of the model with its embedding and output layer on the end stages (no vocabulary
    parallelism), under a schedule from CSV: each rank saves its blocks' weight gradients."""
    import zbpp

    pipeline_worker._init(rank, world, key)
    V, m, layers = 37, 4, 8
    emb, out, blocks = build(V, layers)
    plan = zbpp.Schedule.from_csv(csv)
    S, mine = plan.stages, plan.rank_stages(rank)
    plan.close()
    per = layers // S
    mods = {s: torch.nn.Sequential(*([emb] if s == 0 else []), *blocks[s * per:(s + 1) * per],
                                   *([out] if s == S - 1 else [])) for s in mine}
    stages = [zbpp.PipelineStage(mods[s], s, S, "cpu") for s in mine]
    sched = zbpp.ScheduleFromCSV(stages, m, csv=csv, timeout=60.0,
                                 loss_fn=lambda o, t: torch.nn.functional.cross_entropy(o.reshape(-1, V), t.reshape(-1)))
    x, y = batches(V, m, 1)[0]
    sched.step(*((x,) if sched.holds_first else ()), **({"target": y} if sched.holds_loss else {}))
    sched.close()
    torch.save({s * per + i: blocks[s * per + i][0].weight.grad.clone() for s in mine for i in range(per)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
