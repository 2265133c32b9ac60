"""zbpp.megatron, the Megatron-LM drop-in, against the Megatron stand-in (megatron_standin.py;
Megatron itself cannot be installed here).

The multi-rank tests start 2 processes once (torch.multiprocessing.spawn, gloo) and run every case
there; each rank trains through the stand-in's train_step with the patched
get_forward_backward_func, computes the single-process sequential reference itself (forward and
backward per microbatch in order, loss / num_microbatches, the same split model and optimizer) and
sends both back, and the tests compare them bit for bit. The rest (patching, flags, misuse errors)
runs in this process with a one-rank pipeline.
"""

import datetime
import os
import pickle
import socket
import sys
import traceback

import pytest

torch = pytest.importorskip("torch")

import megatron_standin as standin  # noqa: E402 - tests/python is on sys.path under pytest

RANKS = 2
M = 4            # microbatches per step
SEQ, MBS = 6, 2  # sequence length and micro batch size (the stand-in's --seq-length / --micro-batch-size)
STEPS = 2
SEED = 7
TIMEOUT = 60.0


# ---- the single-process reference -----------------------------------------------------------------------

def _reference_step(stages, step_fn, its, optimizer, m, per_token=False, grad_scale=None, finalize=None):
    """One training step of the whole model in one process: every microbatch forward through all
    stages and backward at once, in order, with Megatron's loss rule written out."""
    for s in stages:
        if hasattr(s, "zero_grad_buffer"):
            s.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)
    dicts = []
    for i in range(m):
        x = None
        for s, chunk in enumerate(stages):
            getattr(chunk, "module", chunk).set_input_tensor([x])
            x, loss_fn = step_fn(its[s], chunk)
        outputs = loss_fn(x)
        if len(outputs) == 3:
            loss, num_tokens, reduced = outputs
            if not per_token:
                loss = loss / torch.clamp(num_tokens, min=1)
                loss = loss / m
        else:
            loss, reduced = outputs
            loss = loss / m
        if grad_scale is not None:
            loss = grad_scale(loss)
        loss.backward()
        dicts.append(reduced)
    if finalize is not None:
        finalize(stages)
    for s in stages:
        for p in s.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad
    optimizer.step()
    return dicts


def _reference_forward(stages, step_fn, its, m, collect=False):
    out = []
    with torch.no_grad():
        for i in range(m):
            x = None
            for s, chunk in enumerate(stages):
                getattr(chunk, "module", chunk).set_input_tensor([x])
                x, loss_fn = step_fn(its[s], chunk)
            out.append(loss_fn(x, non_loss_data=True) if collect else loss_fn(x)[1])
    return out


# ---- one case on one rank --------------------------------------------------------------------------------

def _setup_args(argv):
    args = standin.parse(["--seq-length", str(SEQ), "--micro-batch-size", str(MBS)] + list(argv))
    sys.modules["megatron.training"].set_args(args)
    return args


def _run_case(rank, *, argv=(), configure=None, placement="loop", chunks=1, main_grad=False, tokens=False,
              grad_scale=None, optimizer="adamw", evaluate=False):
    """Trains STEPS steps through the stand-in's train_step (patched) and the reference; returns
    this rank's parameters, loss dicts and (with evaluate) forward-only results from both."""
    import zbpp
    import zbpp.megatron as zm

    _setup_args(argv)
    zm.configure(timeout=TIMEOUT, **(configure or {}))
    S = RANKS * chunks
    config = standin.Config(hidden_size=16, num_layers=4)
    finalize = standin.MainGradDDP.finalize if main_grad else None
    config.finalize_model_grads_func = finalize
    config.grad_scale_func = grad_scale
    step_fn = standin.forward_step_tokens if tokens else standin.forward_step

    def build():
        stages = [zbpp.split_linear(s) for s in standin.build_stages(config, S, seed=SEED)]
        return [standin.MainGradDDP(s) for s in stages] if main_grad else stages

    def make_opt(modules):
        params = [p for mod in modules for p in mod.parameters()]
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
        return torch.optim.AdamW(params, lr=1e-2, foreach=False)

    def iterator():
        return standin.StepIterator(SEED, MBS, SEQ, config.vocab)

    # The pipeline: this rank's chunks, one iterator each.
    mine = standin.rank_chunks(build(), rank, RANKS, placement)
    initial = {f"chunk{c}.{n}": p.detach().clone() for c, mod in enumerate(mine) for n, p in mod.named_parameters()}
    its = [iterator() for _ in mine]
    opt = make_opt(mine)
    training = sys.modules["megatron.training.training"]
    got_dicts = []
    for _ in range(STEPS):
        _avg, dicts = training.train_step(step_fn, its if chunks > 1 else its[0], mine, opt, M)
        got_dicts.append(dicts)
    sched = zm.current_schedule()
    result = {"kind": sched.schedule.kind, "holds_loss": sched.holds_loss, "got_dicts": got_dicts,
              "vp_ranks": [sorted(set(getattr(c, "module", c).seen_vp_ranks), key=str) for c in mine]}

    # The reference: all stages in one process, one iterator per stage on the same stream.
    ref_all = build()
    ref_its = [iterator() for _ in ref_all]
    ref_opt = make_opt(ref_all)
    ref_dicts = [_reference_step(ref_all, step_fn, ref_its, ref_opt, M, grad_scale=grad_scale, finalize=finalize)
                 for _ in range(STEPS)]
    ref_mine = standin.rank_chunks(ref_all, rank, RANKS, placement)
    result["ref_dicts"] = ref_dicts
    result["params"] = {f"chunk{c}.{n}": p.detach().clone() for c, mod in enumerate(mine)
                        for n, p in mod.named_parameters()}
    result["unchanged"] = [k for k, v in result["params"].items() if torch.equal(v, initial[k])]
    result["ref_params"] = {f"chunk{c}.{n}": p.detach().clone() for c, mod in enumerate(ref_mine)
                            for n, p in mod.named_parameters()}

    if evaluate:
        # Gradients as a user leaves them before evaluation: .grad None, main_grad zero.
        for mod in mine:
            if hasattr(mod, "zero_grad_buffer"):
                mod.zero_grad_buffer()
        opt.zero_grad(set_to_none=True)
        losses, collected = training.evaluate(step_fn, its if chunks > 1 else its[0], mine, M,
                                              collect_non_loss_data=True)
        result["eval"], result["collected"] = losses, collected
        result["grads_after_eval"] = [
            f"chunk{c}.{n}" for c, mod in enumerate(mine) for n, p in mod.named_parameters()
            if p.grad is not None or (getattr(p, "main_grad", None) is not None and bool(p.main_grad.any()))]
        result["ref_eval"] = _reference_forward(ref_all, step_fn, ref_its, M)
        result["ref_collected"] = _reference_forward(ref_all, step_fn, ref_its, M, collect=True)
    return result


def _case_small_m(rank):
    """interleaved-1f1b needs m a multiple of p: the C library's message reaches the caller (both
    ranks fail while building the schedule, before any transfer)."""
    import zbpp
    import zbpp.megatron as zm

    _setup_args([])
    zm.configure(timeout=TIMEOUT)
    config = standin.Config(hidden_size=16, num_layers=4)
    mine = standin.rank_chunks([zbpp.split_linear(s) for s in standin.build_stages(config, 4)], rank, RANKS, "loop")
    its = [standin.StepIterator(SEED, MBS, SEQ, config.vocab) for _ in mine]
    opt = torch.optim.SGD([p for c in mine for p in c.parameters()], lr=0.1)
    try:
        sys.modules["megatron.training.training"].train_step(standin.forward_step, its, mine, opt, 3)
    except zbpp.ZbError as exc:
        return {"error": str(exc), "type": type(exc).__name__, "read": [it.read for it in its]}
    return {"error": None}


CASES = {
    # no flag, one chunk per rank: 1F1B; plain .grad, AdamW; then forward only.
    "1f1b": dict(evaluate=True),
    # --zero-bubble-v-schedule: ZB-V, two chunks per rank in a V; main_grad (Megatron's DDP), SGD.
    "zb-v": dict(argv=["--zero-bubble-v-schedule"], placement="v", chunks=2, main_grad=True,
                 optimizer="sgd", evaluate=True),
    # --enable-zero-bubble: zb-auto at memory p; newer Megatron's (loss, num_tokens, dict) and a
    # grad_scale_func.
    "zb-auto": dict(argv=["--enable-zero-bubble"], tokens=True, grad_scale=lambda loss: loss * 8.0,
                    optimizer="sgd"),
    "zb-h1": dict(configure={"kind": "zb-h1"}),
    # no flag, two chunks per rank: interleaved 1F1B.
    "interleaved-1f1b": dict(chunks=2, optimizer="sgd"),
}


def _worker(rank, port, out_dir):
    import torch.distributed as dist

    from pipeline_worker import store_url

    dist.init_process_group("gloo", init_method=store_url(port), rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    torch.set_num_threads(1)  # the ranks share the cores; results must not depend on threads
    results = {}
    try:
        ps = standin.install()
        group = dist.new_group(list(range(RANKS)))
        ps.initialize_model_parallel(rank, RANKS, group=group)
        import zbpp.megatron as zm
        zm.patch()
        for name, kwargs in CASES.items():
            try:
                results[name] = _run_case(rank, **kwargs)
            except Exception:  # noqa: BLE001 - reported to the test, which prints it
                results[name] = {"exception": traceback.format_exc()}
        try:
            results["small-m"] = _case_small_m(rank)
        except Exception:  # noqa: BLE001
            results["small-m"] = {"exception": traceback.format_exc()}
        zm.reset()
    finally:
        # A file, not a queue: the results (tensors) are larger than a pipe holds before the parent
        # reads it, and the parent reads after join.
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    out_dir = str(tmp_path_factory.mktemp("megatron"))
    mp.spawn(_worker, args=(_free_port(), out_dir), nprocs=RANKS, join=True)
    results = {}
    for rank in range(RANKS):
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
            results[rank] = pickle.load(f)
    return results


def _case(ranks, name):
    out = []
    for r in range(RANKS):
        res = ranks[r][name]
        assert "exception" not in res, f"rank {r}, case {name}:\n{res['exception']}"
        out.append(res)
    return out


def _assert_dicts_equal(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} entries, reference {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"{what}[{i}]: keys {sorted(g)} vs reference {sorted(w)}"
        for k in g:
            assert torch.equal(g[k], w[k]), f"{what}[{i}][{k!r}]: {g[k]} vs reference {w[k]}"


def _assert_params_equal(res, rank, name):
    # Equal to the reference and moved by training: a step that left every gradient empty would
    # match too.
    assert res["unchanged"] == [], f"{name}, rank {rank}: training did not change {res['unchanged']}"
    assert res["params"].keys() == res["ref_params"].keys()
    bad = [(k, float((res["params"][k] - res["ref_params"][k]).abs().max())) for k in res["params"]
           if not torch.equal(res["params"][k], res["ref_params"][k])]
    assert not bad, f"{name}, rank {rank}: parameters differ from the sequential reference (max |diff|): {bad}"


@pytest.mark.parametrize("name, kind, loss_rank", [
    ("1f1b", "1f1b", 1),
    ("zb-v", "zb-v", 0),
    ("zb-auto", "zb-auto", 1),
    ("zb-h1", "zb-h1", 1),
    ("interleaved-1f1b", "interleaved-1f1b", 1),
])
def test_training_matches_sequential_reference(ranks, name, kind, loss_rank):
    for rank, res in enumerate(_case(ranks, name)):
        assert res["kind"] == kind, f"{name}: rank {rank} ran {res['kind']}, expected {kind}"
        _assert_params_equal(res, rank, name)
        if rank == loss_rank:
            assert res["holds_loss"]
        if rank in (loss_rank, RANKS - 1):
            # Megatron's train_step reads the loss dicts on the last pipeline rank: under V the loss
            # stage's rank (0) sends them there, and both return them.
            want_dicts = _case(ranks, name)[loss_rank]["ref_dicts"]
            for step, (got, want) in enumerate(zip(res["got_dicts"], want_dicts)):
                _assert_dicts_equal(got, want, f"{name} step {step} loss dicts on rank {rank}")
        else:
            assert res["got_dicts"] == [[]] * STEPS, f"{name}: rank {rank} returned {res['got_dicts']}"


@pytest.mark.parametrize("name", ["zb-v", "interleaved-1f1b"])
def test_virtual_rank_is_set_per_chunk(ranks, name):
    """Each chunk runs under parallel_state's virtual pipeline rank = its chunk index."""
    for rank, res in enumerate(_case(ranks, name)):
        assert res["vp_ranks"] == [[0], [1]], f"{name}, rank {rank}: virtual ranks seen per chunk {res['vp_ranks']}"


@pytest.mark.parametrize("name, loss_rank", [("1f1b", 1), ("zb-v", 0)])
def test_forward_only_matches_reference_and_leaves_grads(ranks, name, loss_rank):
    for rank, res in enumerate(_case(ranks, name)):
        assert res["grads_after_eval"] == [], f"{name}, rank {rank}: forward_only touched {res['grads_after_eval']}"
        if rank in (loss_rank, RANKS - 1):  # under V also the last rank, where evaluate reads them
            want = _case(ranks, name)[loss_rank]["ref_eval"]
            _assert_dicts_equal(res["eval"], want, f"{name} forward-only loss dicts on rank {rank}")
        else:
            assert res["eval"] == [], f"{name}: rank {rank} returned {res['eval']}"


@pytest.mark.parametrize("name, loss_rank", [("1f1b", 1), ("zb-v", 0)])
def test_collect_non_loss_data(ranks, name, loss_rank):
    for rank, res in enumerate(_case(ranks, name)):
        if rank in (loss_rank, RANKS - 1):
            want = _case(ranks, name)[loss_rank]["ref_collected"]
            _assert_dicts_equal(res["collected"], want, f"{name} non-loss data on rank {rank}")
        else:
            assert res["collected"] == [], f"{name}: rank {rank} returned {res['collected']}"


def test_too_few_microbatches_gives_the_library_message(ranks):
    for rank, res in enumerate(_case(ranks, "small-m")):
        assert res["error"] is not None, f"rank {rank}: interleaved-1f1b with m=3 on 2 ranks did not fail"
        assert "multiple of p" in res["error"], f"rank {rank}: {res['error']}"
        assert res["read"] == [0, 0], f"rank {rank}: the failed call read {res['read']} items"


def _dead_peer_worker(rank, port, out_dir):
    """Rank 1 exits before the step; rank 0's train_step must fail with the binding's ZbError naming
    the peer, not hang and not raise something else."""
    import torch.distributed as dist

    import zbpp

    from pipeline_worker import store_url

    dist.init_process_group("gloo", init_method=store_url(port), rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    torch.set_num_threads(1)
    ps = standin.install()
    ps.initialize_model_parallel(rank, RANKS)
    import zbpp.megatron as zm
    zm.patch()
    _setup_args([])
    zm.configure(timeout=20.0)
    config = standin.Config(hidden_size=16, num_layers=2)
    mine = standin.rank_chunks([zbpp.split_linear(s) for s in standin.build_stages(config, RANKS)], rank, RANKS, "loop")
    it = standin.StepIterator(SEED, MBS, SEQ, config.vocab)
    opt = torch.optim.SGD([p for c in mine for p in c.parameters()], lr=0.1)
    dist.barrier()
    if rank == 1:
        os._exit(0)  # a peer that dies: its gloo pairs close
    result = {"error": None}
    try:
        sys.modules["megatron.training.training"].train_step(standin.forward_step, it, mine, opt, M)
    except Exception as exc:  # noqa: BLE001 - the test asserts the type and text
        result = {"error": str(exc), "type": type(exc).__name__}
    with open(os.path.join(out_dir, "dead-peer.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)  # the process group cannot be torn down cleanly without its peer


def test_dead_peer_gives_zberror(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_dead_peer_worker, args=(_free_port(), str(tmp_path)), nprocs=RANKS, join=True)
    with open(tmp_path / "dead-peer.pkl", "rb") as f:
        res = pickle.load(f)
    assert res["error"] is not None, "train_step succeeded without its peer"
    assert res["type"] == "ZbError", res
    assert "rank 1" in res["error"], res["error"]


# ---- in this process: a one-rank pipeline ----------------------------------------------------------------

@pytest.fixture
def megatron():
    """The stand-in, installed for one test (pipeline of 1 rank), then removed."""
    import zbpp.megatron as zm

    ps = standin.install()
    ps.initialize_model_parallel(0, 1)
    _setup_args([])
    zm.configure()
    yield sys.modules
    zm.unpatch()
    zm.configure()
    standin.uninstall()


def test_patch_replaces_the_three_lookups_and_unpatch_restores(megatron):
    import zbpp.megatron as zm

    names = ("megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules",
             "megatron.training.training")
    originals = {n: megatron[n].get_forward_backward_func for n in names}
    assert len(set(map(id, originals.values()))) == 1  # one function, imported under three names
    assert zm.patch() == list(names)
    for n in names:
        assert megatron[n].get_forward_backward_func is zm.get_forward_backward_func, n
    assert megatron["megatron.training.training"].get_forward_backward_func() is zm.forward_backward_func
    assert zm.patch() == list(names)  # idempotent: the originals are kept from the first call
    assert sorted(zm.unpatch()) == sorted(names)
    for n in names:
        assert megatron[n].get_forward_backward_func is originals[n], n
    assert zm.unpatch() == []


def test_patch_without_megatron_says_so(monkeypatch):
    import zbpp.megatron as zm

    standin.uninstall()
    # A real megatron-core may be installed: hide it (None in sys.modules makes its import fail).
    for name in ("megatron", "megatron.core", "megatron.core.pipeline_parallel",
                 "megatron.core.pipeline_parallel.schedules", "megatron.training", "megatron.training.training"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="Megatron-LM was not found"):
        zm.patch()


def test_add_arguments_parses_the_five_flags(megatron, capsys):
    import zbpp.megatron as zm

    args = standin.parse(["--enable-zero-bubble", "--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup",
                          "half", "--zero-bubble-max-pending-backward", "6", "--enable-optimizer-post-validation"])
    assert (args.enable_zero_bubble, args.zero_bubble_v_schedule, args.zero_bubble_v_schedule_mem_setup,
            args.zero_bubble_max_pending_backward, args.enable_optimizer_post_validation) == (True, True, "half", 6, True)
    defaults = standin.parse([])
    assert (defaults.enable_zero_bubble, defaults.zero_bubble_v_schedule, defaults.zero_bubble_v_schedule_mem_setup,
            defaults.zero_bubble_max_pending_backward, defaults.enable_optimizer_post_validation) == (
                False, False, "zb", "auto", False)
    zm.configure(args)
    assert zm.options().enable_optimizer_post_validation is True
    for bad, text in ((["--zero-bubble-v-schedule-mem-setup", "tiny"], "invalid choice: 'tiny'"),
                      (["--zero-bubble-max-pending-backward", "0"], "'auto' or an integer >= 1")):
        with pytest.raises(SystemExit):
            standin.parse(bad)
        err = capsys.readouterr().err
        assert text in err, err
    # A parser that already has the flags (the reference fork's Megatron) keeps its own.
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-zero-bubble", action="store_true")
    zm.add_arguments(parser)
    assert parser.parse_args(["--enable-zero-bubble", "--zero-bubble-v-schedule"]).zero_bubble_v_schedule


def test_fork_flags_are_accepted_or_refused_by_name(megatron):
    """The reference fork's other flags parse; those selecting something zbpp does not run are an error
    that names the flag (never silently ignored); the rest change nothing."""
    import zbpp.megatron as zm

    accepted = standin.parse(["--enable-zb-runtime", "--enable-exactly-numeric-match",
                              "--no-pre-communication-optimization", "--zero-bubble-pipeline-timers-start-iter", "5",
                              "--zero-bubble-pipeline-timers-end-iter", "9", "--offload-time", "2.0",
                              "--zero-bubble-adaptive-memory-limit-percentile", "70", "--enable-zero-bubble"])
    zm.configure(accepted)
    assert zm.options().zero_bubble_adaptive_memory_limit_percentile == 70
    assert zm.schedule_for(1, 4, zm.options()) == ("zb-auto", 4)
    for argv, flag in ((["--enable-1f1b-v"], "--enable-1f1b-v"), (["--num-seq-splits", "2"], "--num-seq-splits"),
                       (["--interleave-group-size", "2"], "--interleave-group-size"),
                       (["--cpu-offload"], "--cpu-offload"), (["--offload-chunk-num", "1"], "--offload-chunk-num")):
        with pytest.raises(ValueError, match=flag):
            zm.configure(standin.parse(argv))
    with pytest.raises(ValueError, match="percentile"):
        zm.configure(standin.parse(["--zero-bubble-adaptive-memory-limit-percentile", "0"]))


def test_flags_choose_the_schedule():
    import zbpp.megatron as zm

    O = zm.Options
    assert zm.schedule_for(1, 4, O()) == ("1f1b", None)
    assert zm.schedule_for(2, 4, O()) == ("interleaved-1f1b", None)
    assert zm.schedule_for(1, 4, O(enable_zero_bubble=True)) == ("zb-auto", 4)
    assert zm.schedule_for(1, 4, O(enable_zero_bubble=True, zero_bubble_max_pending_backward=8)) == ("zb-auto", 8)
    assert zm.schedule_for(2, 4, O(zero_bubble_v_schedule=True)) == ("zb-v", None)
    assert zm.schedule_for(2, 4, O(zero_bubble_v_schedule=True, zero_bubble_v_schedule_mem_setup="half")) == ("v-half", None)
    assert zm.schedule_for(2, 4, O(zero_bubble_v_schedule=True, enable_zero_bubble=True,
                                   zero_bubble_v_schedule_mem_setup="min")) == ("v-min", None)
    assert zm.schedule_for(1, 4, O(kind="ZB-H1", enable_zero_bubble=True)) == ("zb-h1", None)
    assert zm.schedule_for(1, 4, O(kind="zb-2p")) == ("zb-auto", 8.0)
    with pytest.raises(ValueError, match="--enable-zero-bubble schedules one model chunk"):
        zm.schedule_for(2, 4, O(enable_zero_bubble=True))
    with pytest.raises(ValueError, match="needs --zero-bubble-v-schedule"):
        zm.schedule_for(1, 4, O(zero_bubble_v_schedule_mem_setup="half"))
    with pytest.raises(ValueError, match="1f1b .* takes 1 model chunk"):
        zm.schedule_for(2, 4, O(kind="1f1b"))


def _one_rank_model(chunks=1):
    import zbpp

    config = standin.Config(hidden_size=8, num_layers=2)
    stages = [zbpp.split_linear(s) for s in standin.build_stages(config, chunks)]
    its = [standin.StepIterator(SEED, MBS, SEQ, config.vocab) for _ in stages]
    return stages, its


def test_v_schedule_with_one_chunk_is_a_clear_error(megatron):
    import zbpp.megatron as zm

    _setup_args(["--zero-bubble-v-schedule"])
    stages, its = _one_rank_model(1)
    with pytest.raises(ValueError, match=r"zb-v \(--zero-bubble-v-schedule\) needs 2 model chunks per pipeline "
                                         r"rank.*has 1 chunk"):
        zm.forward_backward_func(forward_step_func=standin.forward_step, data_iterator=its[0], model=stages,
                                 num_microbatches=4, seq_length=SEQ, micro_batch_size=MBS)
    assert its[0].index == 0, "the failed call read the data iterator"


def test_missing_loss_func_is_a_clear_error(megatron):
    import zbpp.megatron as zm

    stages, its = _one_rank_model(1)

    def no_loss(data_iterator, model):
        out, _ = standin.forward_step(data_iterator, model)
        return out, None

    with pytest.raises(ValueError, match=r"forward_step_func returned no loss_func \(None\) for microbatch 0 on "
                                         r"the loss stage") as info:
        zm.forward_backward_func(forward_step_func=no_loss, data_iterator=its[0], model=stages, num_microbatches=2,
                                 seq_length=SEQ, micro_batch_size=MBS)
    assert "F(stage 0, mb 0)" in str(info.value.__cause__), info.value.__cause__  # the runner names the op
    # The next call starts from a fresh schedule and works.
    got = zm.forward_backward_func(forward_step_func=standin.forward_step, data_iterator=its[0], model=stages,
                                   num_microbatches=2, seq_length=SEQ, micro_batch_size=MBS)
    assert len(got) == 2 and all("lm loss" in d for d in got), got


def test_collect_non_loss_data_needs_forward_only(megatron):
    import zbpp.megatron as zm

    stages, its = _one_rank_model(1)
    with pytest.raises(ValueError, match="collect_non_loss_data needs forward_only=True"):
        zm.forward_backward_func(forward_step_func=standin.forward_step, data_iterator=its[0], model=stages,
                                 num_microbatches=2, seq_length=SEQ, micro_batch_size=MBS, collect_non_loss_data=True)


def test_optimizer_call_steps_and_reads_no_data(megatron):
    """The reference fork's second call, forward_backward_func(..., optimizer=...): a stock optimizer
    steps once and the call returns (update_successful, grad_norm, rolled_back) without a pass."""
    import zbpp.megatron as zm

    stages, its = _one_rank_model(1)

    class Stock:
        steps = 0

        def step(self):
            Stock.steps += 1
            return True, 1.5, 3  # Megatron's (update_successful, grad_norm, num_zeros_in_grad)

    got = zm.forward_backward_func(forward_step_func=standin.forward_step, data_iterator=its[0], model=stages,
                                   num_microbatches=4, seq_length=SEQ, micro_batch_size=MBS, optimizer=Stock())
    assert got == (True, 1.5, False) and Stock.steps == 1
    assert its[0].index == 0, "the optimizer= call read the data iterator"


@pytest.mark.parametrize("rank, size, calls", [
    (0, 3, ["recv_post_validation", "post_validation"]),
    (1, 3, ["recv_post_validation", "send_post_validation", "post_validation"]),
    (2, 3, ["send_post_validation", "post_validation"]),
    (0, 1, ["post_validation"]),
])
def test_fork_post_validation_protocol_order(rank, size, calls):
    """With the fork's optimizer (post-validation on), each rank finishes the fork's protocol: the
    fully reduced state comes back from the last rank to the first, then every rank validates."""
    from zbpp.megatron.hooks import optimizer_step

    class Fork:
        post_validation_enabled = True

        def __init__(self):
            self.calls = []

        def recv_post_validation(self):
            self.calls.append("recv_post_validation")

        def send_post_validation(self):
            self.calls.append("send_post_validation")

        def post_validation(self, free_buffers):
            free_buffers()
            self.calls.append("post_validation")
            return False, 2.0, True, False  # found inf: not updated, rolled back

        def step(self):
            raise AssertionError("the fork's optimizer already stepped in pre_step")

    opt = Fork()
    assert optimizer_step(opt, rank, size) == (False, 2.0, True)
    assert opt.calls == calls
