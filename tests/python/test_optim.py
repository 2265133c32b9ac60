"""PostValidatedOptimizer: torch's AdamW/SGD stepped with post-validation equals the synchronous
path bit for bit, rolls back when the full state disagrees, skips on inf/NaN and backs the loss
scale off, for fp32, bf16 and fp16 parameters.

The ranks are threads of this process joined by the C in-process transport (the C calls release
the GIL while they wait), so the whole protocol runs without starting processes. The synchronous
path is also checked against an independent reference computed here: the global norm in float64,
torch's clip_grad_norm_ coefficient max_norm / (norm + 1e-6), the loss scale divided out.
"""

import math
import threading

import pytest

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
from zbpp import runtime  # noqa: E402
from zbpp.optim import PostValidatedOptimizer  # noqa: E402

SHAPES = [(4, 3), (3,)]


def stage_params(s, dtype):
    g = torch.Generator().manual_seed(100 + s)
    return [torch.nn.Parameter(torch.randn(*sh, generator=g).to(dtype)) for sh in SHAPES]


def stage_grads(s, step, scale, nan=False):
    g = torch.Generator().manual_seed(1000 * step + s)
    out = [torch.randn(*sh, generator=g) * (0.5 + s) * scale for sh in SHAPES]
    if nan:
        out[0][1, 1] = float("nan")
    return out


def placement_stages(p, placement):
    if placement == "loop":
        return p, {r: [r] for r in range(p)}
    return 2 * p, {r: [r, 2 * p - 1 - r] for r in range(p)}


def run(p, placement, post_validation, dtype=torch.float32, opt="adamw", clip=0.0, nan_at=None, steps=3,
        loss_scale=1.0, growth_interval=0, fused=False, undo_memory="device", states=None):
    """Trains per-stage parameters with made-up gradients on p threads; returns
    ({stage: [params]}, {rank: [StepResult]})."""
    S, held = placement_stages(p, placement)
    group = runtime.InprocGroup(p)
    params = {s: stage_params(s, dtype) for s in range(S)}
    results, errors = {}, []

    def rank_main(r):
        try:
            transport = runtime.Transport.inproc(group, r) if p > 1 else None
            mine = {s: params[s] for s in held[r]}
            flat = [q for s in held[r] for q in params[s]]
            optimizer = (torch.optim.AdamW(flat, lr=0.05, weight_decay=0.01, foreach=False) if opt == "adamw"
                         else torch.optim.SGD(flat, lr=0.1, momentum=0.9, foreach=False))
            pv = PostValidatedOptimizer(optimizer, mine, S, rank=r, ranks=p, placement=placement,
                                        transport=transport, clip_grad=clip, loss_scale=loss_scale,
                                        growth_interval=growth_interval, post_validation=post_validation,
                                        timeout=20.0, fused=fused, undo_memory=undo_memory)
            out = []
            for step in range(steps):
                scale = pv.loss_scale
                for s in held[r]:
                    for q, g in zip(params[s], stage_grads(s, step, scale, nan=(nan_at == step and s == S - 1))):
                        q.grad = g.to(dtype)
                out.append(pv.step())
                pv.zero_grad()
            results[r] = out
            if states is not None:
                states[r] = optimizer.state_dict()
            pv.close()
            if transport is not None:
                transport.close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    group.close()
    return params, results


def assert_same(a, b):
    for s in a:
        for x, y in zip(a[s], b[s]):
            assert torch.equal(x, y), f"stage {s}: differs by {(x.float() - y.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("placement", ["loop", "v"])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_post_validation_equals_the_synchronous_path(placement, opt):
    for clip in (0.0, 1.0):
        pv, pv_res = run(3, placement, True, opt=opt, clip=clip)
        sync, sync_res = run(3, placement, False, opt=opt, clip=clip)
        assert_same(pv, sync)
        rolled = sum(r.rolled_back for rs in pv_res.values() for r in rs)
        clipped_steps = sum(r.clipped for r in sync_res[0])
        # With clipping on every step, each rank that speculated (all but the chain's last) used a
        # partial norm and must undo: (p - 1) per clipped step. Without clipping nothing is undone.
        assert rolled == (3 - 1) * clipped_steps
        assert clipped_steps == (3 if clip else 0)
        assert not any(r.rolled_back for rs in sync_res.values() for r in rs)


def test_synchronous_path_matches_an_independent_reference():
    clip, steps, S = 1.0, 3, 3
    params, results = run(3, "loop", False, opt="sgd", clip=clip, steps=steps)
    ref = {s: stage_params(s, torch.float32) for s in range(S)}
    opt = torch.optim.SGD([q for s in range(S) for q in ref[s]], lr=0.1, momentum=0.9, foreach=False)
    for step in range(steps):
        grads = {s: stage_grads(s, step, 1.0) for s in range(S)}
        total = math.sqrt(sum(float(g.double().pow(2).sum()) for s in range(S) for g in grads[s]))
        coef = clip / (total + 1e-6) if total > clip else 1.0
        assert results[0][step].grad_norm == pytest.approx(total, rel=1e-12)
        for s in range(S):
            for q, g in zip(ref[s], grads[s]):
                q.grad = g * coef
        opt.step()
    for s in range(S):
        for a, b in zip(params[s], ref[s]):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"stage {s}"


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_nan_in_the_last_stage_skips_everywhere_and_backs_off(placement):
    params, results = run(3, placement, True, nan_at=1, loss_scale=1024.0, steps=3)
    sync, sync_res = run(3, placement, False, nan_at=1, loss_scale=1024.0, steps=3)
    assert_same(params, sync)
    for r, rs in results.items():
        assert [x.skipped for x in rs] == [False, True, False], f"rank {r}"
        assert rs[1].grad_norm == math.inf
        assert [x.loss_scale for x in rs] == [1024.0, 512.0, 512.0], "backoff 0.5 after the skip"
    # The last stage's rank is the chain's end: it never speculates, so never rolls back.
    last = 2 if placement == "loop" else 0
    assert [x.rolled_back for x in results[last]] == [False, False, False]
    assert all(results[r][1].rolled_back for r in results if r != last)


def test_loss_scale_grows_after_good_steps():
    _, results = run(2, "loop", True, loss_scale=8.0, growth_interval=2, steps=5)
    assert [x.loss_scale for x in results[0]] == [8.0, 16.0, 16.0, 32.0, 32.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_step_through_fp32_masters(dtype):
    # torch 1.13 has no fp16 AdamW on CPU: the masters are what make fp16 work at all.
    params, results = run(2, "loop", True, dtype=dtype, clip=1.0, loss_scale=256.0, nan_at=2, steps=4)
    sync, _ = run(2, "loop", False, dtype=dtype, clip=1.0, loss_scale=256.0, nan_at=2, steps=4)
    assert_same(params, sync)
    assert all(q.dtype == dtype for s in params for q in params[s])
    assert [x.skipped for x in results[0]] == [False, False, True, False]
    start = {s: stage_params(s, dtype) for s in params}
    assert any(not torch.equal(a, b) for s in params for a, b in zip(params[s], start[s])), "the model moved"


def test_misuse_gets_clear_errors():
    p = torch.nn.Parameter(torch.zeros(3))
    q = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p, q], lr=0.1)
    with pytest.raises(ValueError, match="belong to no stage"):
        PostValidatedOptimizer(opt, {0: [p]}, 1)
    with pytest.raises(ValueError, match="not in the optimizer"):
        PostValidatedOptimizer(torch.optim.SGD([p], lr=0.1), {0: [p, q]}, 1)
    with pytest.raises(ValueError, match="needs a transport"):
        PostValidatedOptimizer(opt, {0: [p, q]}, 2, ranks=2)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        PostValidatedOptimizer(object(), {0: [p]}, 1)
    with pytest.raises(zbpp.ZbError, match="rank"):
        PostValidatedOptimizer(opt, {0: [p, q]}, 1, rank=3)


# ---- tensor parallelism ---------------------------------------------------------------------------


def _tp_worker(rank, key, out_dir, bad_rank):
    """Two tensor-parallel ranks of one stage: a weight split in rows (Megatron's shard attribute
    tensor_model_parallel) and a bias copied on both."""
    import datetime
    import pickle

    import torch.distributed as dist

    import pipeline_worker

    dist.init_process_group("gloo", init_method=pipeline_worker.store_url(key), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        full_w, full_b, g_w, g_b = _tp_full()
        w = torch.nn.Parameter(full_w.chunk(2)[rank].clone())
        w.tensor_model_parallel = True
        b = torch.nn.Parameter(full_b.clone())
        w.grad, b.grad = g_w.chunk(2)[rank].clone(), g_b.clone()
        if bad_rank == rank:
            w.grad[0, 0] = float("inf")
        post = zbpp.PostValidatedOptimizer(torch.optim.SGD([w, b], lr=1.0), {0: [w, b]}, 1, clip_grad=0.5,
                                           tensor_parallel_group=dist.group.WORLD)
        r = post.step()
        with open(f"{out_dir}/{rank}.pkl", "wb") as f:
            pickle.dump((r, w.detach().clone(), b.detach().clone()), f)
        # Both ranks done before either tears gloo down: a rank that destroys its group while the
        # other still reads the last all_reduce's connection makes gloo abort that one.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _tp_full():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(4, 3, generator=g), torch.randn(3, generator=g), torch.randn(4, 3, generator=g),
            torch.randn(3, generator=g))


@pytest.mark.parametrize("bad_rank", [None, 1], ids=["clipped", "inf-on-one-tp-rank"])
def test_tensor_parallel_ranks_take_the_full_models_decision(tmp_path, bad_rank):
    """Each tensor-parallel rank sees the norm of the whole layer (shards summed, the copied bias
    once) and takes the decision one unsplit model would; an inf on one rank skips the step on both."""
    import pickle

    import torch.multiprocessing as mp

    import pipeline_worker

    mp.spawn(_tp_worker, args=(pipeline_worker.fresh_key("tp"), str(tmp_path), bad_rank), nprocs=2, join=True)
    full_w, full_b, g_w, g_b = _tp_full()
    W, B = torch.nn.Parameter(full_w.clone()), torch.nn.Parameter(full_b.clone())
    W.grad, B.grad = g_w.clone(), g_b.clone()
    if bad_rank is not None:
        W.grad[2, 0] = float("inf")  # rank 1's row 0
    ref = zbpp.PostValidatedOptimizer(torch.optim.SGD([W, B], lr=1.0), {0: [W, B]}, 1, clip_grad=0.5).step()
    norm = float(torch.sqrt(g_w.double().pow(2).sum() + g_b.double().pow(2).sum()))
    for rank in range(2):
        with open(tmp_path / f"{rank}.pkl", "rb") as f:
            r, w, b = pickle.load(f)
        assert (r.skipped, r.clipped) == (ref.skipped, ref.clipped) == (bad_rank is not None, bad_rank is None)
        if bad_rank is None:
            assert r.grad_norm == pytest.approx(norm, rel=1e-12) and r.grad_norm == pytest.approx(ref.grad_norm)
        assert torch.equal(w, W.detach().chunk(2)[rank]) and torch.equal(b, B.detach()), f"rank {rank}"


# ---- the fused path: the library's norm and AdamW/SGD kernels (here their C reference) -------------

@pytest.mark.parametrize("placement", ["loop", "v"])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_fused_post_validation_equals_its_synchronous_path(placement, opt):
    for clip in (0.0, 1.0):
        pv, pv_res = run(3, placement, True, opt=opt, clip=clip, fused=True)
        sync, sync_res = run(3, placement, False, opt=opt, clip=clip, fused=True)
        assert_same(pv, sync)
        rolled = sum(r.rolled_back for rs in pv_res.values() for r in rs)
        assert rolled == (3 - 1) * (3 if clip else 0), "every speculating rank undoes each clipped step"
        assert [r.grad_norm for r in pv_res[0]] == [r.grad_norm for r in sync_res[0]]


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_fused_path_steps_as_torchs_optimizer(opt):
    """The kernels' update is torch's AdamW/SGD (to rounding), clipping and loss scale included."""
    fused, fres = run(3, "loop", True, opt=opt, clip=1.0, loss_scale=4.0, fused=True, steps=4)
    plain, pres = run(3, "loop", True, opt=opt, clip=1.0, loss_scale=4.0, fused=False, steps=4)
    for s in plain:
        for a, b in zip(fused[s], plain[s]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"stage {s}: {(a - b).abs().max().item():.3g}"
    for a, b in zip(fres[0], pres[0]):
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-9)
        assert (a.clipped, a.skipped, a.loss_scale) == (b.clipped, b.skipped, b.loss_scale)


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_fused_nan_skips_everywhere_and_backs_off(placement):
    params, results = run(3, placement, True, nan_at=1, loss_scale=1024.0, steps=3, fused=True)
    sync, _ = run(3, placement, False, nan_at=1, loss_scale=1024.0, steps=3, fused=True)
    assert_same(params, sync)
    for r, rs in results.items():
        assert [x.skipped for x in rs] == [False, True, False], f"rank {r}"
        assert [x.loss_scale for x in rs] == [1024.0, 512.0, 512.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_half_precision_reads_gradients_in_their_dtype(dtype):
    params, results = run(2, "loop", True, dtype=dtype, clip=1.0, loss_scale=256.0, nan_at=2, steps=4, fused=True)
    sync, _ = run(2, "loop", False, dtype=dtype, clip=1.0, loss_scale=256.0, nan_at=2, steps=4, fused=True)
    assert_same(params, sync)
    assert all(q.dtype == dtype for s in params for q in params[s])
    assert [x.skipped for x in results[0]] == [False, False, True, False]
    plain, _ = run(2, "loop", True, dtype=dtype, clip=1.0, loss_scale=256.0, nan_at=2, steps=4)
    for s in plain:
        for a, b in zip(params[s], plain[s]):  # one rounding to the half type apart at most
            assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2), f"stage {s}"


def test_fused_undo_record_in_host_memory_steps_alike():
    a, ares = run(3, "v", True, clip=1.0, fused=True)
    b, bres = run(3, "v", True, clip=1.0, fused=True, undo_memory="host")
    assert_same(a, b)
    assert sum(r.rolled_back for rs in bres.values() for r in rs) == (3 - 1) * 3


def test_fused_state_is_torchs_state_dict():
    """AdamW's state keeps torch's keys and counts only the steps that stood (a skipped one not)."""
    states = {}
    run(2, "loop", True, nan_at=1, loss_scale=8.0, steps=3, fused=True, states=states)
    for r, sd in states.items():
        for k, st in sd["state"].items():
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"}, (r, k, set(st))
            assert float(st["step"]) == 2.0
        # and the optimizer itself can carry on from it
        q = [torch.nn.Parameter(torch.zeros(*sh)) for sh in SHAPES]
        opt = torch.optim.AdamW(q, lr=0.05, weight_decay=0.01, foreach=False)
        opt.load_state_dict(sd)


def test_fused_misuse_gets_clear_errors():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"fused=True.*Adam \(the kernels implement torch.optim.AdamW and SGD\)"):
        PostValidatedOptimizer(torch.optim.Adam([p]), {0: [p]}, 1, fused=True)
    with pytest.raises(ValueError, match=r"AdamW with amsgrad=True"):
        PostValidatedOptimizer(torch.optim.AdamW([p], amsgrad=True), {0: [p]}, 1, fused=True)
    with pytest.raises(ValueError, match=r"undo_memory applies to the fused path"):
        PostValidatedOptimizer(torch.optim.SGD([p], lr=0.1), {0: [p]}, 1, undo_memory="host")
    with pytest.raises(ValueError, match=r"undo_memory must be 'device' or 'host'"):
        PostValidatedOptimizer(torch.optim.SGD([p], lr=0.1), {0: [p]}, 1, fused=True, undo_memory="disk")
    # CPU parameters keep torch's step unless asked; an optimizer the kernels lack falls back.
    assert not PostValidatedOptimizer(torch.optim.SGD([p], lr=0.1), {0: [p]}, 1).fused
    assert PostValidatedOptimizer(torch.optim.SGD([p], lr=0.1), {0: [p]}, 1, fused=True).fused


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_fused_steps_a_parameter_that_missed_a_gradient_as_torch_does(opt):
    """A parameter without a gradient in one step is left alone (as torch's optimizers do) and is a
    step behind its group afterwards; the fused kernels then step it with its own count."""
    def make():
        g = torch.Generator().manual_seed(7)
        ps = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]
        o = (torch.optim.AdamW(ps, lr=0.05, weight_decay=0.01, foreach=False) if opt == "adamw"
             else torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False))
        return ps, o
    fused_ps, fused_opt = make()
    ref_ps, ref_opt = make()
    pv = PostValidatedOptimizer(fused_opt, {0: fused_ps}, 1, fused=True)
    g = torch.Generator().manual_seed(8)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=g) for p in fused_ps]
        for k, (a, b) in enumerate(zip(fused_ps, ref_ps)):
            missing = step == 1 and k == 1
            a.grad = None if missing else grads[k].clone()
            b.grad = None if missing else grads[k].clone()
        pv.step()
        ref_opt.step()
        pv.zero_grad()
        ref_opt.zero_grad()
    for a, b in zip(fused_ps, ref_ps):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max().item()
    pv.close()
