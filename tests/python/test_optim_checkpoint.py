"""Checkpoint and resume with PostValidatedOptimizer (issue 24): a run interrupted after step K and
resumed in a new process's way (a new model built from another seed, a new optimizer, the wrap,
then the model's and the optimizer's state dicts, both through torch.save/torch.load on a file)
ends bit for bit where the uninterrupted run ends: every parameter, the optimizer's state (the fp32
masters of bf16/fp16 parameters included), the loss scale and its growth tracker, the step counts,
and the per-step results after the resume.

The runs are built so that each part of the state matters after the resume: an inf gradient at
step INF_AT backs the scale off (1024 -> 512); growth_interval 3 then grows it after step 5, after
the resume at K = 4, only if the tracker (one good step at the checkpoint) came back; clip_grad 1
clips some steps and not others. Both load orders are checked (model then optimizer, optimizer
then model), and loading the model before the wrap. One rank (two stages in one process) and two
gloo ranks (a zbpp pipeline with PostValidatedOptimizer.for_schedule; rank 0 speculates, so it
rolls back). Also: the masters follow a model loaded after the wrap without optimizer state, the
state dict keeps torch's layout, and for_schedule accepts frozen parameters left out of the
optimizer.
"""

import math
import os

import pytest

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
from zbpp.optim import PostValidatedOptimizer  # noqa: E402

STEPS, K, INF_AT, CLIP = 8, 4, 2, 1.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ORDERS = ["model-then-optimizer", "optimizer-then-model", "model-before-wrap"]


def build(dtype, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).to(dtype)


def make_optimizer(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.02, weight_decay=0.01, foreach=False)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)


def loss_of(out, y, scale):
    return ((out.float() - y) ** 2).mean() * scale


def wrap(model, kind, fused):
    stages = {0: list(model[0].parameters()), 1: list(model[2].parameters())}
    return PostValidatedOptimizer(make_optimizer(kind, model.parameters()), stages, 2, clip_grad=CLIP,
                                  loss_scale=1024.0, growth_interval=3, fused=fused)


def train(model, pv, first, last, dtype):
    results = []
    for step in range(first, last):
        x, y = batch(step)
        loss_of(model(x.to(dtype)), y, pv.loss_scale).backward()
        if step == INF_AT:
            model[2].weight.grad[0, 0] = math.inf
        results.append(pv.step())
        pv.zero_grad()
    return results


def resume(path, dtype, kind, fused, order, build_fn, wrap_fn):
    """A new model and optimizer, loaded from the checkpoint at `path` in the given order."""
    ck = torch.load(path, weights_only=True)
    model = build_fn(dtype, seed=1)
    if order == "model-before-wrap":
        model.load_state_dict(ck["model"])
    pv = wrap_fn(model, kind, fused)
    if order == "model-then-optimizer":
        model.load_state_dict(ck["model"])
    pv.load_state_dict(ck["optim"])
    if order == "optimizer-then-model":
        model.load_state_dict(ck["model"])
    return model, pv


def first_difference(a, b, path="state_dict"):
    """Where two nested state dicts differ (tensors bit for bit, dtype included), or None."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dtype != b.dtype or not torch.equal(a, b):
            return f"{path}: {a!r} != {b!r}"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            d = first_difference(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def outcome(model, pv, results):
    """Everything that must match, as plain data (torch.save-able); the state dict holds the
    optimizer's state, the masters, the scaler and the step counts."""
    return {"params": [p.detach().clone() for p in model.parameters()], "loss_scale": pv.loss_scale,
            "results": [tuple(r) for r in results], "state_dict": pv.state_dict()}


def assert_same_outcome(got, want, what):
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        assert torch.equal(a, b), f"{what}: parameter {i} differs by {(a.float() - b.float()).abs().max().item():.3g}"
    assert got["loss_scale"] == want["loss_scale"], f"{what}: loss scale {got['loss_scale']} != {want['loss_scale']}"
    assert got["results"] == want["results"], f"{what}: step results after the resume differ"
    d = first_difference(got["state_dict"], want["state_dict"])
    assert d is None, f"{what}: {d}"


# ---- one rank ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_resume_equals_the_uninterrupted_run(tmp_path, dtype_name, fused, kind):
    dtype = DTYPES[dtype_name]
    model = build(dtype, seed=0)
    pv = wrap(model, kind, fused)
    full = train(model, pv, 0, STEPS, dtype)
    want = outcome(model, pv, full[K:])
    # The run is one where each part of the state matters (see the module docstring).
    assert [r.skipped for r in full] == [s == INF_AT for s in range(STEPS)]
    assert [r.loss_scale for r in full] == [1024, 1024, 512, 512, 512, 1024, 1024, 1024]
    clipped = sum(r.clipped for r in full)
    assert 0 < clipped < STEPS - 1, [r.clipped for r in full]
    pv.close()

    model = build(dtype, seed=0)
    pv = wrap(model, kind, fused)
    train(model, pv, 0, K, dtype)
    torch.save({"model": model.state_dict(), "optim": pv.state_dict()}, tmp_path / "ck.pt")
    pv.close()
    for order in ORDERS:
        model, pv = resume(tmp_path / "ck.pt", dtype, kind, fused, order, build, wrap)
        got = outcome(model, pv, train(model, pv, K, STEPS, dtype))
        pv.close()
        assert_same_outcome(got, want, f"{dtype_name} {'fused' if fused else 'unfused'} {kind}, {order}")
    assert want["state_dict"]["zbpp"]["stats"] == {"steps": STEPS, "skipped": 1, "clipped": clipped, "rolled_back": 0}


def test_masters_follow_a_model_loaded_after_the_wrap(tmp_path):
    """Fine-tuning from a model checkpoint (no optimizer state, or a plain torch one from before
    zbpp kept masters): the model loaded after the wrap is what the first step starts from, exactly
    as if it had been loaded before the wrap."""
    trained = build(torch.bfloat16, seed=5)
    plain = make_optimizer("adamw", trained.parameters())
    x, y = batch(0)
    loss_of(trained(x.to(torch.bfloat16)), y, 1.0).backward()
    plain.step()  # a torch optimizer state dict for bf16 parameters, as any torch run writes one
    torch.save({"model": trained.state_dict(), "optim": plain.state_dict()}, tmp_path / "ck.pt")
    runs = {}
    for when in ("before", "after"):
        for with_optim in (False, True):
            # Loaded for each run: torch's load_state_dict shares AdamW's step tensors, not copies.
            ck = torch.load(tmp_path / "ck.pt", weights_only=True)
            model = build(torch.bfloat16, seed=1)
            if when == "before":
                model.load_state_dict(ck["model"])
            pv = wrap(model, "adamw", False)
            if when == "after":
                model.load_state_dict(ck["model"])
            if with_optim:
                pv.load_state_dict(ck["optim"])
            train(model, pv, 0, 3, torch.bfloat16)
            runs[when, with_optim] = [p.detach().clone() for p in model.parameters()]
            pv.close()
    for with_optim in (False, True):
        for i, (a, b) in enumerate(zip(runs["after", with_optim], runs["before", with_optim])):
            assert torch.equal(a, b), (f"optimizer state {with_optim}: parameter {i} differs by "
                                       f"{(a.float() - b.float()).abs().max().item():.3g}")


def test_state_dict_keeps_torchs_layout():
    """torch's keys stay at the top level (a tool reading a torch optimizer state dict, or torch's
    optimizer itself, still can); zbpp's part is one more key."""
    model = build(torch.bfloat16, seed=0)
    pv = wrap(model, "adamw", False)
    results = train(model, pv, 0, 3, torch.bfloat16)
    sd = pv.state_dict()
    assert set(sd) == {"state", "param_groups", "zbpp"}
    z = sd["zbpp"]
    assert set(z) == {"version", "masters", "scaler", "stats"}
    assert z["scaler"] == {"scale": 512.0, "_growth_tracker": 0}
    assert z["stats"] == {"steps": 3, "skipped": 1, "clipped": sum(r.clipped for r in results), "rolled_back": 0}
    assert pv.stats == (3, 1, sum(r.clipped for r in results), 0)
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    assert sorted(z["masters"]) == ids, "one fp32 master per bf16 parameter, under torch's ids"
    for i, p in zip(ids, model.parameters()):
        m = z["masters"][i]
        assert m.dtype == torch.float32 and m.shape == p.shape
        assert torch.equal(m.to(torch.bfloat16), p.detach()), "the model is its master rounded"
    torch.optim.AdamW([torch.nn.Parameter(m.clone()) for m in z["masters"].values()]).load_state_dict(sd)
    pv.close()
    assert first_difference(pv.state_dict(), sd) is None, "a checkpoint after close() is the same"


# ---- for_schedule: frozen parameters ------------------------------------------------------------------

def _two_stage_schedule(freeze):
    torch.manual_seed(0)
    m0 = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh())
    m1 = torch.nn.Linear(8, 4)
    if freeze:
        m0[0].bias.requires_grad_(False)  # fine-tuning: frozen, and left out of the optimizer
    stages = [zbpp.PipelineStage(m, s, 2, "cpu") for s, m in enumerate([m0, m1])]
    sched = zbpp.ScheduleZBVZeroBubble(stages, 2, loss_fn=lambda o, y: ((o - y) ** 2).mean())
    return m0, m1, sched


def test_for_schedule_accepts_frozen_parameters_left_out_of_the_optimizer():
    m0, m1, sched = _two_stage_schedule(freeze=True)
    frozen = m0[0].bias.detach().clone()
    trained = [p for m in (m0, m1) for p in m.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trained]
    pv = PostValidatedOptimizer.for_schedule(torch.optim.SGD(trained, lr=0.1), sched)
    x, y = batch(0)
    sched.step(x, target=y)
    assert not pv.step().skipped
    assert torch.equal(m0[0].bias, frozen), "the frozen parameter stays"
    assert all(not torch.equal(a, b) for a, b in zip(trained, before)), "the others trained"
    pv.close()
    sched.close()


def test_for_schedule_names_a_trainable_parameter_missing_from_the_optimizer():
    m0, m1, sched = _two_stage_schedule(freeze=True)
    left_out = [p for m in (m0, m1) for p in m.parameters() if p.requires_grad and p is not m1.weight]
    with pytest.raises(ValueError, match=r"trainable parameter \(4, 8\) of stage 1 is not in the optimizer"):
        PostValidatedOptimizer.for_schedule(torch.optim.SGD(left_out, lr=0.1), sched)
    sched.close()


# ---- two gloo ranks ---------------------------------------------------------------------------------------

CASES2 = [(d, f, k) for d in DTYPES for f in (False, True) for k in ("adamw", "sgd")]


def _stage_module(rank, dtype, seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh()) if rank == 0 else torch.nn.Linear(8, 4)
    return m.to(dtype)


def _worker(rank, key, out_dir):
    """Each case: the uninterrupted run, the run up to K with its checkpoint (this rank's own
    file), and the resumed runs in both orders, all on a 2-rank 1F1B pipeline; the outcomes go to a
    file the test compares."""
    import datetime

    import torch.distributed as dist

    import pipeline_worker

    dist.init_process_group("gloo", init_method=pipeline_worker.store_url(key), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    out = {}
    try:
        for dtype_name, fused, kind in CASES2:
            dtype = DTYPES[dtype_name]
            scale = [1.0]

            def run(module, pv, sched, first, last):
                res = []
                for step in range(first, last):
                    x, y = batch(step)
                    scale[0] = pv.loss_scale
                    sched.step(x.to(dtype)) if rank == 0 else sched.step(target=y)
                    if step == INF_AT and rank == 1:
                        module.weight.grad[0, 0] = math.inf
                    res.append(pv.step())
                    pv.zero_grad()
                return res

            def setup(module):
                stage = zbpp.PipelineStage(module, rank, 2, "cpu")
                sched = zbpp.Schedule1F1B(stage, 2, loss_fn=lambda o, y: loss_of(o, y, scale[0]), timeout=60.0)
                pv = PostValidatedOptimizer.for_schedule(make_optimizer(kind, module.parameters()), sched,
                                                         clip_grad=CLIP, loss_scale=1024.0, growth_interval=3,
                                                         fused=fused)
                return sched, pv

            def done(sched, pv):
                pv.close()
                sched.close()

            case = f"{dtype_name}-{'fused' if fused else 'unfused'}-{kind}"
            module = _stage_module(rank, dtype, 0)
            sched, pv = setup(module)
            full = run(module, pv, sched, 0, STEPS)
            found = {"full": outcome(module, pv, full[K:]), "all_results": [tuple(r) for r in full]}
            done(sched, pv)

            module = _stage_module(rank, dtype, 0)
            sched, pv = setup(module)
            run(module, pv, sched, 0, K)
            path = os.path.join(out_dir, f"ck-{case}-{rank}.pt")
            torch.save({"model": module.state_dict(), "optim": pv.state_dict()}, path)
            done(sched, pv)
            for order in ORDERS[:2]:
                ck = torch.load(path, weights_only=True)
                module = _stage_module(rank, dtype, 1)
                sched, pv = setup(module)
                first, second = (module, pv) if order == "model-then-optimizer" else (pv, module)
                first.load_state_dict(ck["model"] if first is module else ck["optim"])
                second.load_state_dict(ck["model"] if second is module else ck["optim"])
                found[order] = outcome(module, pv, run(module, pv, sched, K, STEPS))
                done(sched, pv)
            out[case] = found
    except BaseException:  # noqa: BLE001 - the test reads the traceback
        import traceback

        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(out_dir, f"out{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_two_gloo_ranks_resume_bit_for_bit(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    import pipeline_worker

    key = pipeline_worker.fresh_key("ckpt")
    procs = [ctx.Process(target=_worker, args=(r, key, str(tmp_path))) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(240)
    hung = [r for r, proc in enumerate(procs) if proc.exitcode is None]
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    assert not hung, f"rank(s) {hung} still running after 240 s"
    for r in range(2):
        out = torch.load(tmp_path / f"out{r}.pt", weights_only=False)
        assert "error" not in out, f"rank {r}: {out['error']}"
        for case, found in out.items():
            res = found["all_results"]
            assert [x[0] for x in res] == [s == INF_AT for s in range(STEPS)], (r, case)
            assert [x[4] for x in res] == [1024, 1024, 512, 512, 512, 1024, 1024, 1024], (r, case)
            for order in ORDERS[:2]:
                assert_same_outcome(found[order], found["full"], f"rank {r} {case}, {order}")
            stats = found["full"]["state_dict"]["zbpp"]["stats"]
            # The chain's first rank speculates with its own stage's norm: the clipped steps and the
            # one with rank 1's inf roll back there. The last rank never speculates.
            clipped = sum(x[1] for x in res)
            assert stats == {"steps": STEPS, "skipped": 1, "clipped": clipped,
                             "rolled_back": clipped + 1 if r == 0 else 0}, (r, case, stats)
