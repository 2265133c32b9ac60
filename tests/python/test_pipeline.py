"""The pipelining API over gloo: every schedule kind trains the GPT bit for bit like a sequential
loop in one process; misuse and dead or silent peers give clear errors.

The reference is written here, independently of zbpp's schedule code: the same model (built from
the same seed, its Linear layers split so W runs through the same C GEMM at once), each
microbatch's forward and backward in order, gradients divided by the number of microbatches (as
torch.distributed.pipelining's scale_grads does), then AdamW. Bit-for-bit equality holds because
every op sees the same inputs in the same order; the test says which parameter differs if not.
"""

import socket

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

import pipeline_worker  # noqa: E402

import zbpp  # noqa: E402
from zbpp.examples import gpt  # noqa: E402

M, BATCH, STEPS, SEED = 4, 8, 2, 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(steps=STEPS, m=M, batch=BATCH, seed=SEED, lr=1e-2, layers=4, device="cpu"):
    """Sequential training of the whole model in this process, on `device` (W run at once):
    (per-step losses, parameters on the CPU)."""
    torch.set_num_threads(1)
    modules = [zbpp.split_linear(mod).to(device)
               for mod in gpt.build_stages(pipeline_worker.model_config(layers), 1, seed=seed)]
    params = [p for mod in modules for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, foreach=False)
    data = gpt.Batches(8, batch, seed=seed)
    losses = []
    for _ in range(steps):
        x, y = (t.to(device) for t in data.next())
        step = []
        for xi, yi in zip(x.chunk(m), y.chunk(m)):
            h = xi
            for mod in modules:
                h = mod(h)
            loss = gpt.loss_fn(h, yi)
            loss.backward()
            step.append(float(loss))
        for p in params:
            p.grad.div_(m)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step)
    return losses, [p.detach().cpu() for p in params]


def spawn(fn, world, *args):
    mp.spawn(fn, args=(world, pipeline_worker.fresh_key(), *args), nprocs=world, join=True)


# Every kind at p=2 with the smallest chunks it takes, plus a schedule loaded from torch's CSV.
CASES = [
    dict(kind="gpipe", chunks=1),
    dict(kind="1F1B", chunks=1),  # torch's spelling
    dict(kind="Interleaved1F1B", chunks=2),
    dict(kind="zb-h1", chunks=1),
    dict(kind="zb-h2", chunks=1),
    dict(kind="ZBVZeroBubble", chunks=2),
    dict(kind="v-half", chunks=2),
    dict(kind="v-min", chunks=2),
    dict(kind="zb-auto", chunks=1),
    dict(kind="InterleavedZeroBubble", chunks=2),
    # torch's ScheduleInterleavedZeroBubble as its users place stages: in a loop, 2 and 3 per rank.
    dict(kind="InterleavedZeroBubble", chunks=2, placement="loop"),
    dict(kind="InterleavedZeroBubble", chunks=3, placement="loop", layers=6),
    dict(kind="group-interleaved-1f1b", chunks=2),  # PipeOffload's base schedule (GIS)
]


@pytest.fixture(scope="module")
def kind_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("kinds")
    csv = zbpp.Schedule.generate("zb-v", p=2, m=M).to_csv()
    cases = [dict(c, m=M, batch=BATCH, steps=STEPS, seed=SEED) for c in CASES]
    cases.append(dict(kind="csv", chunks=2, m=M, batch=BATCH, steps=STEPS, seed=SEED, csv=csv))
    spawn(pipeline_worker.run_kinds, 2, cases, str(out))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        if r and "error" in r[-1]:
            pytest.fail("a rank failed:\n" + r[-1]["error"], pytrace=False)
    return cases, ranks


@pytest.mark.parametrize("index", range(len(CASES) + 1), ids=[c["kind"] + (f"-loop{c['chunks']}" if c.get("placement") else "") for c in CASES] + ["csv"])
def test_every_kind_trains_bit_for_bit_like_one_process(kind_results, index):
    cases, ranks = kind_results
    ref_losses, ref_params = reference(layers=cases[index].get("layers", 4))
    per_stage = {}
    for r in ranks:
        per_stage.update(r[index]["params"])
    params = [p for s in sorted(per_stage) for p in per_stage[s]]
    assert len(params) == len(ref_params)
    for k, (got, want) in enumerate(zip(params, ref_params)):
        assert torch.equal(got, want), (
            f"{cases[index]['kind']}: parameter {k} differs from the sequential run by up to "
            f"{(got - want).abs().max().item():.3g}")
    losses = [r[index]["losses"] for r in ranks if r[index]["losses"]]
    assert len(losses) == 1, "exactly one rank holds the loss stage"
    assert losses[0] == ref_losses, f"{cases[index]['kind']}: losses {losses[0]} != {ref_losses}"
    assert all(r[index]["store_empty"] for r in ranks), "the W store must be empty after every step"
    assert all(0.0 <= r[index]["bubble"] < 1.0 for r in ranks)


# Three ranks: one more process, a partition with an inner rank, and m = 6 (not a power of two,
# so the division of the gradients by m is not exact and must happen as torch does it).
CASES3 = [dict(kind="1f1b", chunks=1), dict(kind="zb-h1", chunks=1), dict(kind="zb-v", chunks=2),
          dict(kind="interleaved-1f1b", chunks=2)]


def test_three_ranks_train_bit_for_bit_like_one_process(tmp_path):
    m, batch, layers = 6, 12, 6
    cases = [dict(c, m=m, batch=batch, steps=STEPS, seed=SEED, layers=layers) for c in CASES3]
    cases[3]["m"], cases[3]["batch"] = 3, 6  # interleaved needs m to be a multiple of p
    spawn(pipeline_worker.run_kinds, 3, cases, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for r in ranks:
        if r and "error" in r[-1]:
            pytest.fail("a rank failed:\n" + r[-1]["error"], pytrace=False)
    for k, case in enumerate(cases):
        ref_losses, ref_params = reference(m=case["m"], batch=case["batch"], layers=layers)
        per_stage = {}
        for r in ranks:
            per_stage.update(r[k]["params"])
        params = [p for s in sorted(per_stage) for p in per_stage[s]]
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), case["kind"]
        assert [r[k]["losses"] for r in ranks if r[k]["losses"]] == [ref_losses], case["kind"]
        assert all(r[k]["store_empty"] for r in ranks)


def test_loss_stage_is_rank0_for_v_and_last_rank_for_loop(kind_results):
    cases, ranks = kind_results
    for k, case in enumerate(cases):
        holder = [r for r in range(2) if ranks[r][k]["losses"]]
        # zb-auto with 2 chunks (InterleavedZeroBubble) places them in a V too, unless the stages
        # were given in a loop (torch's interleaved placement).
        v_kind = (case["kind"] in ("ZBVZeroBubble", "v-half", "v-min", "csv", "InterleavedZeroBubble")
                  and case.get("placement") != "loop")
        assert holder == ([0] if v_kind else [1]), case["kind"]


# ---- one process: misuse -------------------------------------------------------------------------

def _stage(index=0, num=1):
    return zbpp.PipelineStage(torch.nn.Linear(4, 4), index, num, "cpu")


def test_batch_that_does_not_split_into_microbatches():
    # Fewer rows than microbatches (uneven sizes split as torch splits them: test_torch_behaviours.py).
    sched = zbpp.Schedule1F1B(_stage(), 4, loss_fn=lambda o, y: o.sum())
    with pytest.raises(ValueError, match=r"batch size 3.*n_microbatches=4"):
        sched.step(torch.randn(3, 4), target=torch.randn(3, 4))


def test_stage_index_out_of_range():
    with pytest.raises(ValueError, match=r"stage_index 5 is out of range.*\[0, 3\]"):
        zbpp.PipelineStage(torch.nn.Linear(4, 4), 5, 4, "cpu")


def test_v_schedule_with_one_stage_per_rank():
    with pytest.raises(ValueError, match=r"V schedule.*2 stages.*num_stages=2"):
        zbpp.ScheduleZBVZeroBubble(_stage(), 4, loss_fn=lambda o, y: o.sum())


def test_no_loss_fn_anywhere_means_forward_only_as_in_torch():
    stage = _stage()
    sched = zbpp.Schedule1F1B(stage, 2)
    x = torch.randn(4, 4)
    out = sched.step(x, target=torch.randn(4, 4))
    torch.testing.assert_close(out, stage.submod(x).detach())
    assert all(p.grad is None for p in stage.submod.parameters())


def test_unknown_schedule_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown schedule 'ZeroBubbleX'.*zb-v.*ZBVZeroBubble"):
        zbpp.get_schedule_class("ZeroBubbleX")
    assert zbpp.get_schedule_class("zbvzerobubble") is zbpp.ScheduleZBVZeroBubble
    assert zbpp.get_schedule_class("ScheduleInterleaved1F1B") is zbpp.ScheduleInterleaved1F1B
    assert zbpp.get_schedule_class("ZB_H1") is zbpp.ScheduleZBH1


def test_single_process_pipeline_with_two_stages_matches_the_loop():
    """p = 1 with both stages of a V on the one rank: no transport, same bits as the loop."""
    torch.set_num_threads(1)
    config = pipeline_worker.model_config()
    modules = [zbpp.split_linear(mod) for mod in gpt.build_stages(config, 2, seed=SEED)]
    stages = [zbpp.PipelineStage(mod, s, 2, "cpu") for s, mod in enumerate(modules)]
    sched = zbpp.ScheduleZBVZeroBubble(stages, M, loss_fn=gpt.loss_fn)
    opt = torch.optim.AdamW([p for mod in modules for p in mod.parameters()], lr=1e-2, foreach=False)
    data = gpt.Batches(8, BATCH, seed=SEED)
    losses = []
    for _ in range(STEPS):
        x, y = data.next()
        got = []
        out = sched.step(x, target=y, losses=got)
        assert out.shape == (BATCH, 8, 32), "the loss stage returns the merged output"
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append([float(v) for v in got])
    ref_losses, ref_params = reference()
    assert losses == ref_losses
    params = [p for mod in modules for p in mod.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    svg = sched.timeline().to_svg()
    assert "<svg" in svg
    sched.close()


# ---- failures across processes ------------------------------------------------------------------

@pytest.mark.parametrize("mode,expect", [("die", r"rank 1"), ("silent", r"(?i)timed out.*rank 1|rank 1.*timed out")])
def test_dead_or_silent_peer_fails_with_its_rank(tmp_path, mode, expect):
    ctx = mp.get_context("spawn")
    port = pipeline_worker.fresh_key()
    procs = [ctx.Process(target=pipeline_worker.run_failure, args=(r, 2, port, mode, str(tmp_path))) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode is not None, "a rank hung"
    seconds, text = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert "ZbError" in text, text
    import re

    assert re.search(expect, text), text
    assert float(seconds) < 30.0, f"rank 0 needed {seconds} s to notice"


def test_a_rank_whose_stage_raises_makes_every_other_rank_fail_at_once(tmp_path):
    """3 ranks, default timeout (300 s): the last rank's module raises and its process stays alive,
    so no connection closes; ranks 0 and 1 (rank 0 not even its neighbour) fail within seconds
    through zbpp's abort signal, with the message of the rank and op that failed first. The
    failing rank raises its own exception."""
    ctx = mp.get_context("spawn")
    port = pipeline_worker.fresh_key()
    procs = [ctx.Process(target=pipeline_worker.run_failure, args=(r, 3, port, "raise", str(tmp_path)))
             for r in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(90)
        assert proc.exitcode is not None, "a rank hung"
    for r in range(2):
        seconds, text = (tmp_path / f"rank{r}.txt").read_text().split("\n", 1)
        assert "ZbError" in text and "rank 2 failed first" in text and "F(stage 2, mb" in text, text
        assert float(seconds) < 15.0, f"rank {r} needed {seconds} s to notice"
    _, text = (tmp_path / "rank2.txt").read_text().split("\n", 1)
    assert text.startswith("ValueError: the stage's own error"), text


def test_schedule_and_post_validated_optimizer_close_in_either_order(tmp_path):
    """They share the schedule's transport, which the library will not free while the optimizer
    uses it: whichever closes first leaves it to the other, and nothing raises."""
    spawn(pipeline_worker.run_close_order, 2, str(tmp_path))
    for r in range(2):
        got = torch.load(tmp_path / f"close{r}.pt")
        assert "error" not in got, got.get("error")
        assert got["schedule-first"] == {"pending_between": True, "freed": True}
        assert got["optimizer-first"] == {"pending_between": False, "freed": True}


# ---- torch's step() semantics ---------------------------------------------------------------------

class _Scaled(torch.nn.Module):
    """Takes features along dim 0 and the batch along dim 1, and a scale keyword: needs chunk specs."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, scale=1.0):
        return self.lin(x.t()).t() * scale  # [3, batch]


def test_step_keywords_as_torchs():
    from zbpp.pipelining.microbatch import TensorChunkSpec, _Replicate

    torch.manual_seed(0)
    mod = _Scaled()
    seen = []

    def loss_fn(out, y, weight=1.0):
        seen.append(weight)
        return (out.t() - y).square().mean() * weight  # the target splits along dim 0, as torch's

    sched = zbpp.Schedule1F1B(zbpp.PipelineStage(mod, 0, 1, "cpu"), 4, loss_fn=loss_fn,
                              args_chunk_spec=(TensorChunkSpec(1),),
                              kwargs_chunk_spec={"scale": _Replicate()},
                              output_merge_spec=TensorChunkSpec(1))
    x, y = torch.randn(4, 8), torch.randn(8, 3)
    losses = [123.0]
    out = sched.step(x, scale=2.0, target=y, losses=losses, loss_kwargs={"weight": 0.5})
    # The batch went through along dim 1, whole, in the same order; losses were cleared, then filled.
    # loss_fn ran once more at the first step, where torch's shape inference runs it too.
    assert out.shape == (3, 8) and torch.allclose(out, mod(x, scale=2.0))
    assert len(losses) == 4 and 123.0 not in losses and seen == [0.5] * 5
    assert sched.step(x, scale=2.0, target=y, return_outputs=False) is None
    with torch.no_grad(), pytest.raises(RuntimeError, match="eval"):
        sched.step(x, scale=2.0, target=y)
    # 10 columns in 4 microbatches: 3, 3, 2, 2 along dim 1, as torch's split_args_kwargs_into_chunks
    x = torch.randn(4, 10)
    assert torch.allclose(sched.step(x, scale=2.0, target=torch.randn(10, 3)), mod(x, scale=2.0))
    sched.close()


def test_stages_that_pass_their_input_on_give_the_loops_results(tmp_path):
    """Zero-copy stages over gloo: an Identity in the middle and one as the loss stage return views
    of the runner's receive buffers; the output the schedule returns and the gradients are still
    the sequential loop's (the pass-through outputs are copied, not lent or kept as views)."""
    spawn(pipeline_worker.run_pass_through, 3, str(tmp_path))
    got = [torch.load(tmp_path / f"pass{r}.pt") for r in range(3)]
    for r, g in enumerate(got):
        assert "error" not in g, g.get("error")
    x, y = got[0]["x"], got[0]["y"]
    lin = torch.nn.Linear(6, 6)
    with torch.no_grad():
        for p, q in zip(lin.parameters(), got[0]["params"]):
            p.copy_(q)
        want = lin(x)
    torch.testing.assert_close(got[2]["output"], want)
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 6)
    for xi, yi in zip(x.chunk(8), y.chunk(8)):
        torch.nn.functional.mse_loss(ref(xi), yi).backward()
    for a, b in zip(got[0]["grads"], ref.parameters()):
        torch.testing.assert_close(a, b.grad / 8)
