"""Vocabulary Parallelism through the schedule classes (vocab_parallel=zbpp.VocabParallel(...)), on
CPU over gloo with 2 and 4 ranks as processes, and on one rank in this process: the losses, the
blocks' weights and the whole embedding and output weights (gather()) after three SGD steps (the
third on the plan made again from the second's measured times), and the
eval() losses after them, equal a single process running the unsharded model within float32
rounding (the softmax's sum merged from the shards' sums), for 1F1B, interleaved 1F1B, ZB-V,
V-Half, ZB-H1 and zb-auto, fused and unfused, tied, label smoothing, ignored targets (-100) and a
padded vocabulary; every
rank runs S, T, IF and IB; bad input fails on every rank, saying what is wrong, and a stage that
fails fails every rank within seconds, not at the timeout."""

import os
import sys
import tempfile
import types

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_worker  # noqa: E402
import vocab_worker  # noqa: E402
import zbpp  # noqa: E402

# float32 rounding after three SGD steps at lr 0.5; the bug this guards against (a gradient off by a
# factor, a microbatch's loss missing) is orders of magnitude larger.
TOL = dict(rtol=1e-4, atol=1e-5)


def _spawn(fn, world, *args):
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(fn, args=(world, pipeline_worker.fresh_key("vp"), *args, out), nprocs=world, join=True)
        return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


def _case(kind, chunks=1, **extra):
    case = dict(kind=kind, chunks=chunks, V=37, m=4, layers=8, steps=3)
    case.update(extra)
    return case


def _check(case, ranks):
    """Every rank's results of one case against the single process's."""
    for r in ranks:
        assert "error" not in r, r["error"]
    ref = vocab_worker.reference(case)
    losses = [r["losses"] for r in ranks if r["losses"]]
    assert len(losses) == 1, "exactly one rank (the last stage's) gets the losses"
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref["losses"]), **TOL)
    evals = [r["eval"] for r in ranks if r["eval"]]
    torch.testing.assert_close(torch.tensor(evals[0]), torch.tensor(ref["eval"]), **TOL)
    for r in ranks:
        for s, w in r["blocks"].items():
            torch.testing.assert_close(w, ref["blocks"][s], **TOL)
        torch.testing.assert_close(r["embedding"], ref["embedding"], **TOL)
        torch.testing.assert_close(r["output"], ref["output"], **TOL)
        assert {"S", "T", "IF", "IB"} <= set(r["op_types"]), r["op_types"]
    held = [s for r in ranks for s in r["blocks"]]
    assert sorted(held) == list(range(case["layers"]))
    # Without given times, step 2 measured every op and pass and planned again on them, the same
    # on every rank; step 3 ran the plan it chose.
    got = [r["replanned"] for r in ranks]
    if case.get("vocab_times"):
        assert all(g is None for g in got)
    else:
        assert all(g is not None and g["step"] == 2 for g in got), got
        assert all(g == got[0] for g in got)
        assert got[0]["vocab_times"]["s"] > 0 and got[0]["vocab_times"]["t"] > 0
        assert all(x > 0 for x in got[0]["stage_times"]["f"])


TWO = [
    _case("1f1b"),
    # meta_default: every tensor the passes make is made where the stages are (vocab_worker._guard)
    _case("1f1b", fused=False, label_smoothing=0.1, pad_multiple=4, meta_default=True),  # 37 rows padded to 40
    _case("interleaved-1f1b", chunks=2),
    _case("zb-v", chunks=2, tied=True, meta_default=True),
    _case("v-half", chunks=2, fused=False),
    _case("zb-h1", label_smoothing=0.1, ignore=True),  # some targets -100: skipped, as F.cross_entropy does
    _case("zb-auto", vocab_times={"s": 0.5, "t": 0.5}),  # given times: no replan
]
FOUR = [
    _case("1f1b", m=8),
    _case("interleaved-1f1b", chunks=2, m=8, fused=False),
    _case("zb-v", chunks=2, m=8),
    _case("v-half", chunks=2, m=8, tied=True, ignore=True, meta_default=True),
]


@pytest.mark.parametrize("world,cases", [(2, TWO), (4, FOUR)], ids=["2-ranks", "4-ranks"])
def test_training_equals_the_unsharded_model(world, cases):
    got = _spawn(vocab_worker.run_cases, world, cases)
    for k, case in enumerate(cases):
        ranks = [g[k] if k < len(g) else g[-1] for g in got]
        _check(case, ranks)
    # Each rank keeps its rows only: the padded vocabulary over the ranks.
    first = [g[0] for g in got]
    assert all(r["shard_rows"] == -(-37 // world) for r in first)


@pytest.mark.gpu
def test_cuda_stages_sharing_a_gpu_train_like_the_unsharded_model():
    """Two ranks as processes on GPU 0, every stage and both shards on it: the passes compute on
    the GPU and their collectives go through host memory (Transport.all_reduce on a CUDA tensor),
    the stages' messages through the staged transport (NCCL refuses two ranks on one GPU). The
    same results as the single process on CPU, within float32 rounding (the GPU's matmuls add in
    another order). The host check of the same code paths: the meta_default cases above."""
    cases = [_case("1f1b", device="cuda:0"),
             _case("zb-v", chunks=2, tied=True, fused=False, device="cuda:0"),
             _case("v-half", chunks=2, label_smoothing=0.1, ignore=True, device="cuda:0")]
    got = _spawn(vocab_worker.run_cases, 2, cases)
    for k, case in enumerate(cases):
        ranks = [g[k] if k < len(g) else g[-1] for g in got]
        _check(case, ranks)
        assert all(r["shard_device"] == "cuda:0" for r in ranks), [r["shard_device"] for r in ranks]
        assert all(r["collectives"] == "host" for r in ranks), "ranks sharing a GPU cannot use NCCL"


@pytest.mark.gpu
def test_cuda_stages_on_a_gpu_each_reduce_over_nccl_like_the_unsharded_model():
    """Two ranks, a GPU each: the lanes' collectives are NCCL group transports on the GPUs (on
    streams of their own, so a lane never waits behind the runner's device-side receive waits);
    the same results within float32 rounding (NCCL's summation order)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    cases = [_case("1f1b", device="cuda:each"), _case("zb-v", chunks=2, tied=True, fused=False, device="cuda:each"),
             _case("interleaved-1f1b", chunks=2, m=8, device="cuda:each")]
    got = _spawn(vocab_worker.run_cases, 2, cases)
    for k, case in enumerate(cases):
        ranks = [g[k] if k < len(g) else g[-1] for g in got]
        _check(case, ranks)
        assert [r["shard_device"] for r in ranks] == ["cuda:0", "cuda:1"]
        assert all(r["collectives"] == "nccl" for r in ranks)


@pytest.mark.parametrize("facts,want", [
    ([(("h", "GPU-a"), False), (("h", "GPU-b"), False)], "nccl"),   # a GPU each: NCCL group transports
    ([(("h", "GPU-a"), False), (("h", "GPU-b"), True)], "host"),    # one rank's ZBPP_VOCAB_COLLECTIVES=host
    ([(("h", "GPU-a"), False), (("h", "GPU-a"), False)], "host"),   # two ranks on one GPU: NCCL refuses
    ([(("h1", "GPU-a"), False), (("h2", "GPU-a"), False)], "nccl"),  # equal UUIDs on two hosts
])
def test_every_rank_chooses_where_the_collectives_run_from_the_same_facts(facts, want, monkeypatch):
    """CUDA stages: the lanes' collectives go over NCCL only when every rank has a GPU of its own
    and no rank asks for host memory; each rank decides from the gathered facts, so all agree."""
    from zbpp import cuda
    from zbpp.pipelining._vocab import VocabRun

    monkeypatch.setattr(cuda, "gpu_identity", lambda device: ("h", "GPU-mine"))
    asked = []

    def exchange(mine, what):
        asked.append((mine, what))
        return facts

    run = types.SimpleNamespace(device=torch.device("cuda", 0), sched=types.SimpleNamespace(_exchange=exchange))
    monkeypatch.setenv("ZBPP_VOCAB_COLLECTIVES", "host")
    assert VocabRun._choose_collectives(run) == want
    assert asked[0][0] == (("h", "GPU-mine"), True), "this rank's wish goes out with its GPU"


def test_one_rank_runs_the_passes_in_process():
    """One rank (no process group): the same flow with nothing to reduce, ZB-V's two stages; after
    a step the lanes hold nothing of it (their results would be microbatches of hidden states)."""
    case = _case("zb-v", chunks=2, tied=True, label_smoothing=0.1, meta_default=True)
    got = vocab_worker.train(0, 1, case)
    _check(case, [got])
    assert got["lanes_empty"]


@pytest.mark.parametrize("bad", ["tokens", "targets"])
def test_ids_outside_the_vocabulary_are_refused_with_the_range(bad):
    """Checked once a step on the host copies every rank has (on a GPU a check in each pass would
    wait for the device), with what is allowed and what came."""
    emb, out, blocks = vocab_worker.build(16, 2)
    stage = zbpp.PipelineStage(torch.nn.Sequential(*blocks), 0, 1, "cpu")
    sched = zbpp.Schedule1F1B(stage, 2, vocab_parallel=zbpp.VocabParallel(out, emb))
    x, y = torch.randint(0, 16, (4, 3)), torch.randint(0, 16, (4, 3))
    if bad == "tokens":
        x[3, 2] = 16  # in the last microbatch: not one the first step's shape inference embeds
        text = r"tokens must be vocabulary ids in 0\.\.15, got \d+\.\.16"
    else:
        y[0, 0] = -5
        text = r"targets must be vocabulary ids in 0\.\.15 or ignore_index \(-100\), got -5\.\."
    with pytest.raises(ValueError, match=text):
        sched.step(x, target=y)
    sched.close()


def test_bad_arguments_say_what_is_allowed():
    emb, out, blocks = vocab_worker.build(16, 2)
    stage = zbpp.PipelineStage(blocks[0], 0, 1, "cpu")
    vp = zbpp.VocabParallel(out, emb)
    with pytest.raises(ValueError, match="computes the loss itself .* drop loss_fn"):
        zbpp.Schedule1F1B(stage, 2, loss_fn=lambda y, t: y.sum(), vocab_parallel=vp)
    with pytest.raises(ValueError, match="does not go with offload="):
        zbpp.Schedule1F1B(stage, 2, vocab_parallel=vp, offload="auto", times={"offload": 1, "reload": 1})
    with pytest.raises(ValueError, match="not in a CSV"):
        zbpp.ScheduleFromCSV(stage, 2, csv=zbpp.Schedule.generate("1f1b", p=1, m=2).to_csv(), vocab_parallel=vp)
    with pytest.raises(TypeError, match="vocab_parallel must be a zbpp.VocabParallel"):
        zbpp.Schedule1F1B(stage, 2, vocab_parallel=(out, emb))
    with pytest.raises(ValueError, match="has a bias"):
        zbpp.VocabParallel(torch.nn.Linear(8, 16), emb)
    with pytest.raises(ValueError, match="both are \\[vocab, hidden\\]"):
        zbpp.VocabParallel(torch.nn.Linear(8, 15, bias=False), emb)
    with pytest.raises(ValueError, match="times keys are"):
        zbpp.VocabParallel(out, emb, times={"x": 1})
    with pytest.raises(ValueError, match="padding_idx=0"):
        zbpp.VocabParallel(out, torch.nn.Embedding(16, 8, padding_idx=0))
    sched = zbpp.Schedule1F1B(stage, 2, vocab_parallel=vp)
    with pytest.raises(ValueError, match="loss_scale must be 1 with vocab_parallel"):
        zbpp.PostValidatedOptimizer.for_schedule(torch.optim.SGD(list(blocks[0].parameters()) + vp.parameters(),
                                                                 lr=0.1), sched, loss_scale=1024.0)
    with pytest.raises(ValueError, match="replan\\(\\) plans without"):
        sched.replan()
    with pytest.raises(ValueError, match="torch's order has no actions for"):
        sched.pipeline_order = {0: []}
    x, y = vocab_worker.batches(16, 2, 1)[0]
    with pytest.raises(ValueError, match="integer tensors of vocabulary ids"):
        sched.step(x.float(), target=y)
    sched.close()
    wide = zbpp.PipelineStage(torch.nn.Linear(8, 5), 0, 1, "cpu")
    sched = zbpp.Schedule1F1B(wide, 2, vocab_parallel=zbpp.VocabParallel(*vocab_worker.build(16, 1)[1::-1]))
    with pytest.raises(ValueError, match=r"the last stage must return the hidden states .* \[\.\.\., 8\]"):
        sched.step(x, target=y)
    sched.close()


@pytest.mark.parametrize("mode", ["stage", "pass", "tokens", "no-target", "disagree"])
def test_a_failure_reaches_every_rank_at_once(mode):
    """A stage or a pass failing, bad tokens, the last rank's step() without a target (before the
    lanes connect), or ranks that disagree about the replan: every rank fails within seconds."""
    got = _spawn(vocab_worker.run_failure, 2, mode)
    want = {"stage": "a stage failed on purpose", "pass": "a pass failed on purpose",
            "tokens": "integer tensors of vocabulary ids", "no-target": "pass target=",
            "disagree": "vocab_parallel is"}[mode]
    for r, res in enumerate(got):
        assert res["error"] is not None, f"rank {r} did not fail"
        assert res["seconds"] < 30, f"rank {r} waited {res['seconds']:.0f} s (the timeout is 60)"
        # The rank that failed says what; the others say so too, or that a peer failed.
        assert want in res["error"] or (r == 0 and mode in ("stage", "pass", "no-target") and "failed" in res["error"]), \
            res["error"]
