"""zbpp.megatron under Megatron-LM's own training loop functions, on CPU.

1. ZBPP_MEGATRON_LM: the root of a stock Megatron-LM checkout (tag core_v0.16.1, matching the
   installed megatron-core). Megatron's train_step and evaluate (megatron/training/training.py) with
   pretrain_gpt.py's forward_step, get_model / setup_model_and_optimizer (Megatron's DDP, Adam from
   get_megatron_optimizer with grad clipping, the learning-rate scheduler) train a tiny GPT on two
   pipeline ranks over gloo: once with Megatron's own 1F1B, and with zbpp.megatron.patch() under
   zbpp's 1F1B, ZB-H1, zb-auto (--enable-zero-bubble) and ZB-V (--zero-bubble-v-schedule, chunks
   built by v_model_provider, embedding group from v_embedding_ranks). The loss dicts train_step
   returns on the last pipeline rank, the losses evaluate returns, the grad norms, learning rates,
   gradients and parameters after every step agree bit for bit (Megatron's linear layers split by
   zbpp.split_linear in every run, so each weight gradient is the same GEMM; and with the W store's
   "torch" kernel, which runs Megatron's own ops, every split run equals stock Megatron, no layer
   split, bit for bit too). ZB-V places other
   layers on each rank than Megatron's 1F1B: there, everything but the grad norm is bit for bit
   without clipping (the norm is Megatron's sum of per-rank partial sums: last bit), and close with
   clipping. The worker code and its shims and CPU patches: megatron_training.py.

2. ZBPP_ZB_FORK: the root of the reference fork (sail-sg/zero-bubble-pipeline-parallelism). Its
   training loop cannot run on CPU (see test_zb_fork_training_loop_blockers); instead zbpp's
   optimizer= call is checked against the fork's post-validation methods: their signatures, the
   4-tuple post_validation returns and the 3-tuple the fork's runtime makes of it, the order the
   fork's own scheduler gives the post-validation nodes on each stage, and a two-process run of the
   fork's real recv_post_validation / send_post_validation / post_validation driven by zbpp.

Both skip, with the reason, without their variable.

    ZBPP_MEGATRON_LM=/path/to/Megatron-LM ZBPP_ZB_FORK=/path/to/zero-bubble-pipeline-parallelism \\
        python -m pytest tests/python/test_megatron_training.py
"""

import importlib.metadata
import os
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import megatron_real as mr  # noqa: E402 - tests/python is on sys.path under pytest; imports no Megatron

MEGATRON_LM_ENV = "ZBPP_MEGATRON_LM"
ZB_FORK_ENV = "ZBPP_ZB_FORK"
TIMEOUT = 60


def _checkout_version(root):
    """(major, minor, patch) of a checkout's megatron/core/package_info.py, or None."""
    try:
        text = (Path(root) / "megatron" / "core" / "package_info.py").read_text()
    except OSError:
        return None
    parts = [re.search(rf"^{name}\s*=\s*(\d+)", text, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        return None
    return tuple(int(p.group(1)) for p in parts)


def _megatron_lm_checkout():
    """The checkout from ZBPP_MEGATRON_LM, or pytest.skip with the reason."""
    root = os.environ.get(MEGATRON_LM_ENV)
    if not root:
        pytest.skip(f"{MEGATRON_LM_ENV} is not set (the root of a Megatron-LM checkout at core_v0.16.1, "
                    "whose megatron/training and pretrain_gpt.py are run)")
    root = Path(root)
    for needed in ("megatron/training/training.py", "pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        if not (root / needed).is_file():
            pytest.skip(f"{MEGATRON_LM_ENV}={root} has no {needed}: not a Megatron-LM checkout of core_v0.16.x")
    if not mr.megatron_core_installed():
        pytest.skip("megatron-core is not installed")
    try:
        installed = tuple(int(x) for x in importlib.metadata.version("megatron-core").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        installed = None
    checkout = _checkout_version(root)
    if installed is None or checkout is None or checkout[:2] != installed:
        pytest.skip(f"the checkout's megatron.core is {checkout} and the installed megatron-core {installed}: "
                    "megatron.training runs on the installed megatron.core, so they must be the same release")
    return str(root)


# =====================================================================================================
# 1. Megatron-LM's train_step / evaluate
# =====================================================================================================

V_FLAGS = ("--zero-bubble-v-schedule",)
VOCAB_FLAGS = ("--enable-vocab-parallel",)
UNTIED = ("--untie-embeddings-and-output-weights",)
CASES = {
    "megatron-stock": dict(split=False),                                # nothing split
    "megatron": dict(),
    "zbpp-1f1b": dict(use_zbpp=True),                                   # no flag: 1F1B
    "zbpp-zb-h1": dict(use_zbpp=True, zbpp_kind="zb-h1"),
    "zbpp-zb-auto": dict(use_zbpp=True, flags=("--enable-zero-bubble",)),
    # ZB-V against Megatron's 1F1B on the same 4 layers, without grad clipping (--clip-grad 0; the
    # norm is still computed and returned) and with Megatron's default clipping.
    "megatron-noclip": dict(clip_grad=0.0),
    "zbpp-zb-v-noclip": dict(use_zbpp=True, v_order=True, flags=V_FLAGS, clip_grad=0.0),
    "zbpp-zb-v": dict(use_zbpp=True, v_order=True, flags=V_FLAGS),
    # PipeOffload through the fork's flags: ZB-V planned for copies an eighth of F + B each way
    # (--offload-time, since nothing is profiled here), which move rank 0's activations.
    "zbpp-zb-v-offload-noclip": dict(use_zbpp=True, v_order=True, clip_grad=0.0, plan_from_measured=False,
                                     flags=V_FLAGS + ("--cpu-offload", "--offload-time", "0.125")),
    # Vocabulary Parallelism (sail-sg/VocabularyParallelism's flags), tied embeddings (Megatron's
    # default) and untied, fused and not, against Megatron's 1F1B with its own layers.
    "megatron-untied": dict(flags=UNTIED),
    "zbpp-vocab-1f1b": dict(use_zbpp=True, vocab=True, flags=VOCAB_FLAGS),
    "zbpp-vocab-1f1b-untied-unfused": dict(use_zbpp=True, vocab=True,
                                           flags=VOCAB_FLAGS + UNTIED + ("--disable-backward-fusion",)),
    "zbpp-vocab-zb-auto": dict(use_zbpp=True, vocab=True, flags=VOCAB_FLAGS + ("--enable-zero-bubble",)),
    "zbpp-vocab-v-half-untied": dict(use_zbpp=True, vocab=True, v_order=True,
                                     flags=VOCAB_FLAGS + UNTIED + V_FLAGS + ("--zero-bubble-v-schedule-mem-setup", "half")),
}
KINDS = {"zbpp-vocab-1f1b": "1f1b", "zbpp-vocab-1f1b-untied-unfused": "1f1b", "zbpp-vocab-zb-auto": "zb-auto",
         "zbpp-vocab-v-half-untied": "v-half", "zbpp-1f1b": "1f1b", "zbpp-zb-h1": "zb-h1", "zbpp-zb-auto": "zb-auto", "zbpp-zb-v-noclip": "zb-v",
         "zbpp-zb-v": "zb-v", "zbpp-zb-v-offload-noclip": "zb-v"}


@pytest.fixture(scope="module")
def training():
    checkout = _megatron_lm_checkout()
    import megatron_training as mtr  # tests/python is on sys.path under pytest
    names = list(CASES)
    out = mtr.run_cases(checkout, [CASES[n] for n in names], timeout=TIMEOUT)
    return mtr, dict(zip(names, out))


def _get(results, name):
    res = results[name]
    if isinstance(res, BaseException):
        pytest.fail(f"case {name} failed:\n{res}", pytrace=False)
    return res


def test_megatron_train_step_and_evaluate_run_on_cpu(training):
    """The reference run: Megatron's own schedule, optimizer and scheduler did their work."""
    _mtr, results = training
    res = _get(results, "megatron")
    for rank in res["ranks"]:
        assert rank["ran"] == {"megatron.core.pipeline_parallel.schedules."
                               "forward_backward_pipelining_without_interleaving"}
        # Megatron's optimizer (get_megatron_optimizer: a ChainedOptimizer over FP32Optimizer here).
        assert rank["optimizer"] == "ChainedOptimizer"
        assert rank["split"]["split"] and not rank["split"]["not_split"]
        assert rank["gemms_run"] > 0
    assert len(res["losses"]) == 2 and all(set(d) == {"lm loss"} for d in res["losses"])
    assert all(torch.isfinite(d["lm loss"]) for d in res["losses"] + res["eval_losses"])
    assert len(res["eval_losses"]) == 2 and all(set(d) == {"lm loss"} for d in res["eval_losses"])
    assert res["skipped"] == [0, 0]
    # Grad clipping at Megatron's default 1.0 ran in the first step (the norm is above it).
    assert res["grad_norm"][0] > 1.0
    # The scheduler decays the learning rate linearly from --lr over --train-iters.
    assert res["lr"][0] < 0.01 and res["lr"][1] < res["lr"][0]
    names = set(res["init_params"])
    assert {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.3.mlp.linear_fc2.weight",
            "decoder.final_layernorm.weight"} <= names
    for step in range(2):
        assert set(res["params"][step]) == names == set(res["grads"][step])
        assert any(g.abs().sum() > 0 for g in res["grads"][step].values())
        before = res["init_params"] if step == 0 else res["params"][step - 1]
        assert any(not torch.equal(before[n], res["params"][step][n]) for n in names)
    # Tied embeddings (Megatron's default): the last stage's copy equals the word embeddings.
    for params in [res["init_params"]] + res["params"]:
        assert torch.equal(params["output_layer.weight"], params["embedding.word_embeddings.weight"])
    # The evaluation loss went down over the two steps.
    assert res["eval_losses"][1]["lm loss"] < res["eval_losses"][0]["lm loss"]


def _check_zbpp_ran(res, name):
    for rank in res["ranks"]:
        assert rank["ran"] == {f"zbpp.megatron.run.forward_backward_func [{KINDS[name]}]"}
        assert rank["split"]["split"] and not rank["split"]["not_split"]
        assert rank["gemms_run"] > 0


@pytest.mark.parametrize("name", ["zbpp-1f1b", "zbpp-zb-h1", "zbpp-zb-auto"])
def test_zbpp_matches_megatron_train_step_and_evaluate(training, name):
    """Same placement: everything bit for bit, grad norm and clipping included."""
    mtr, results = training
    ref, res = _get(results, "megatron"), _get(results, name)
    _check_zbpp_ran(res, name)
    diffs = mtr.differences(ref, res)
    assert not diffs, f"{name} differs from Megatron's schedule in {len(diffs)} places:\n" + "\n".join(diffs[:20])
    # The same batches read by the same chunks in the same order on every rank.
    for r, (a, b) in enumerate(zip(ref["ranks"], res["ranks"])):
        assert a["reads"] == b["reads"], f"rank {r} read different batches under {name}"


@pytest.mark.parametrize("name", ["megatron", "zbpp-1f1b", "zbpp-zb-h1", "zbpp-zb-auto"])
def test_split_runs_match_stock_megatron_bit_for_bit(training, name):
    """Megatron's linear layers split by zbpp (W inside each B under Megatron's schedule, in W passes
    under zbpp's) against stock Megatron with nothing split: bit for bit with the torch kernel."""
    mtr, results = training
    ref, res = _get(results, "megatron-stock"), _get(results, name)
    kernels = {rank["w_kernel"] for rank in res["ranks"]}
    if kernels != {"torch"}:
        pytest.skip(f"the W store ran the library's GEMM ({kernels}), not torch's ops")
    diffs = mtr.differences(ref, res)
    assert not diffs, f"{name} differs from stock Megatron in {len(diffs)} places:\n" + "\n".join(diffs[:20])


def test_zbpp_zb_v_matches_megatron_train_step_and_evaluate(training):
    """ZB-V (rank 0: layers 0 and 3) against Megatron's 1F1B (rank 0: layers 0 and 1) without
    clipping: losses, eval losses, gradients and parameters bit for bit. Only the grad norm may
    differ, in its last bit: Megatron's get_grad_norm_fp32 sums each rank's squares and all-reduces
    the partial sums over the pipeline, and the V placement puts other parameters on each rank, so
    the same gradients are added in another grouping (Megatron's reduction, not zbpp's)."""
    mtr, results = training
    ref, res = _get(results, "megatron-noclip"), _get(results, "zbpp-zb-v-noclip")
    _check_zbpp_ran(res, "zbpp-zb-v-noclip")
    diffs = mtr.differences(ref, res, grad_norm_exact=False)
    assert not diffs, f"ZB-V differs from Megatron's 1F1B in {len(diffs)} places:\n" + "\n".join(diffs[:20])


def test_zbpp_zb_v_with_cpu_offload_matches_megatron(training):
    """--cpu-offload under ZB-V: rank 0 moves activations to host memory and back in every step, and
    the run is what ZB-V without offload is against Megatron's 1F1B (everything bit for bit but the
    grad norm's last bit, see above), and bit for bit ZB-V's own run, grad norm included."""
    mtr, results = training
    ref, res = _get(results, "megatron-noclip"), _get(results, "zbpp-zb-v-offload-noclip")
    _check_zbpp_ran(res, "zbpp-zb-v-offload-noclip")
    assert all(n > 0 for n in res["ranks"][0]["offloads"]), res["ranks"][0]["offloads"]
    diffs = mtr.differences(ref, res, grad_norm_exact=False)
    assert not diffs, f"ZB-V with offload differs from Megatron's 1F1B in {len(diffs)} places:\n" + "\n".join(diffs[:20])
    diffs = mtr.differences(_get(results, "zbpp-zb-v-noclip"), res)
    assert not diffs, f"ZB-V with offload differs from ZB-V in {len(diffs)} places:\n" + "\n".join(diffs[:20])


def test_zbpp_zb_v_with_grad_clipping_is_close_to_megatron(training):
    """ZB-V with Megatron's default clipping (--clip-grad 1.0, which the first step's norm exceeds):
    the clip coefficient is max_norm / grad_norm, so the grad norm's possible last-bit difference
    (see above) reaches every clipped gradient; hence closeness, not bits."""
    mtr, results = training
    ref, res = _get(results, "megatron"), _get(results, "zbpp-zb-v")
    _check_zbpp_ran(res, "zbpp-zb-v")
    assert res["grad_norm"][0] > 1.0
    diffs = _adam_noise_exempt(ref, res, mtr.differences(ref, res, tolerance=(1e-5, 1e-7)))
    assert not diffs, f"ZB-V is not close to Megatron's 1F1B in {len(diffs)} places:\n" + "\n".join(diffs[:20])


def _adam_noise_exempt(ref, res, diffs, noise=1e-6, atol=1e-7):
    """The parameter differences left once elements whose gradient is rounding noise are set aside.
    A gradient that is zero in exact arithmetic (the key part of linear_qkv's bias: a bias added to
    every key shifts a query's logits alike, which softmax ignores) is rounding noise, near Adam's
    eps; Adam turns it into an update of up to lr, so noise that differs in its last bits (the
    clip coefficient's last bit reaches the next step's noise) moves such an element by up to lr
    a step. Elements whose gradients were below `noise` in every step so far may differ by that;
    every other element must still be close."""
    import re

    import torch

    lr = max(ref["lr"])  # the largest learning rate the scheduler set
    kept = []
    for d in diffs:
        m = re.match(r"params\[(\d+)\]\[(.+)\]: not close", d)
        if not m:
            kept.append(d)
            continue
        k, name = int(m.group(1)), m.group(2)
        x, y = ref["params"][k][name], res["params"][k][name]
        bad = ~torch.isclose(x, y, rtol=1e-5, atol=atol)
        quiet = torch.stack([ref["grads"][s][name].abs() for s in range(k + 1)]).amax(0) < noise
        if bool((bad & ~quiet).any()) or float((x - y).abs().max()) > 2 * lr * (k + 1):
            kept.append(d)
    return kept


@pytest.mark.parametrize("name", ["zbpp-zb-v-noclip", "zbpp-zb-v"])
def test_zbpp_zb_v_placement_under_train_step(training, name):
    """ZB-V: rank 0 holds chunks of stages 0 and 3 (layers 0 and 3, the embedding and the loss) and
    reads both chunks' data; rank 1 reads none. train_step returns the loss dict on the last
    pipeline rank, where stock Megatron reads it; on rank 0 (which computed it) train_step's own
    is_pipeline_last_stage() test gives {}."""
    _mtr, results = training
    res = _get(results, name)
    rank0, rank1 = sorted(res["ranks"], key=lambda r: r["coords"]["pp"])
    assert rank0["chunks"] == [0, 1] and rank1["chunks"] == [0, 1]
    layers0 = {n.split(".")[2] for n in rank0["init_params"] if n.startswith("decoder.layers.")}
    layers1 = {n.split(".")[2] for n in rank1["init_params"] if n.startswith("decoder.layers.")}
    assert (layers0, layers1) == ({"0", "3"}, {"1", "2"})
    assert {"embedding.word_embeddings.weight", "output_layer.weight"} <= set(rank0["init_params"])
    for phase, step, logs in rank0["reads"]:
        assert logs == [[(phase, step, i) for i in range(4)]] * 2
    for _phase, _step, logs in rank1["reads"]:
        assert logs == [[], []]
    assert all(d == {} for d in rank0["losses"] + rank0["eval_losses"])
    assert all(set(d) == {"lm loss"} for d in rank1["losses"] + rank1["eval_losses"])
    # Both tied copies on rank 0 step alike (zbpp sums their gradients where Megatron's embedding
    # all-reduce would).
    for params in [res["init_params"]] + res["params"]:
        assert torch.equal(params["output_layer.weight"], params["embedding.word_embeddings.weight"])


# =====================================================================================================
# 2. The reference fork's post-validation against zbpp's optimizer= call
# =====================================================================================================

FORK_WORLD = 3  # a middle rank too: it receives the fully reduced state before it sends it on
# Per iteration, each pipeline rank's squared local grad norm (the fork's local_total_norm); their
# total stays under --clip-grad 1.0, so no step is rolled back (a rollback needs apex, see
# megatron_training.py).
SQUARES = [[0.09, 0.16, 0.04], [0.25, 0.36, 0.01]]


@pytest.fixture(scope="module")
def fork():
    root = os.environ.get(ZB_FORK_ENV)
    if not root:
        pytest.skip(f"{ZB_FORK_ENV} is not set (the root of a checkout of the reference fork, "
                    "sail-sg/zero-bubble-pipeline-parallelism)")
    for needed in ("megatron/core/optimizer/optimizer.py", "megatron/core/pipeline_parallel/zerobubble/runtime.py",
                   "megatron/training/training.py"):
        if not (Path(root) / needed).is_file():
            pytest.skip(f"{ZB_FORK_ENV}={root} has no {needed}: not a checkout of the reference fork")
    import megatron_training as mtr
    report, run = mtr.fork_cases(root, [{"what": "report"},
                                        {"what": "post_validation", "local_squares": SQUARES, "clip_grad": 1.0}],
                                 world=FORK_WORLD, timeout=TIMEOUT)
    for res in (report, run):
        if isinstance(res, BaseException) and "_setup_fork" in str(res):
            pytest.skip(f"the fork's megatron does not import here:\n{res}")
    return report, run


def _report(fork):
    report = fork[0]
    if isinstance(report, BaseException):
        pytest.fail(f"reading the fork failed:\n{report}", pytrace=False)
    return report[0]


class _Recorder:
    """An optimizer with the fork's post-validation methods that records zbpp's calls."""

    post_validation_enabled = True

    def __init__(self):
        self.calls = []

    def recv_post_validation(self, *args, **kwargs):
        self.calls.append(("recv", args, kwargs))

    def send_post_validation(self, *args, **kwargs):
        self.calls.append(("send", args, kwargs))

    def post_validation(self, *args, **kwargs):
        self.calls.append(("post", args, kwargs))
        return ("updated", "grad_norm", "rollback", "succeed")

    def step(self):
        raise AssertionError("zbpp stepped the optimizer although post-validation is enabled")


def _zbpp_calls(rank, p):
    from zbpp.megatron.hooks import optimizer_step

    rec = _Recorder()
    result = optimizer_step(rec, rank, p)
    return rec.calls, result


def test_zb_fork_post_validation_signatures_match_zbpp_calls(fork):
    """The fork's recv_post_validation(self), send_post_validation(self) and
    post_validation(self, free_buffers_callback) -> 4-tuple (MixedPrecisionOptimizer's, and the
    DistributedOptimizer's override of post_validation), called by zbpp with exactly those
    arguments; zbpp reads the fork's post_validation_enabled attribute."""
    report = _report(fork)
    assert report["version"].startswith("0.9"), report["version"]
    methods = report["methods"]
    for cls in ("MixedPrecisionOptimizer", "Float16OptimizerWithFloat16Params", "DistributedOptimizer"):
        for name in ("recv_post_validation", "send_post_validation"):
            m = methods[f"{cls}.{name}"]
            assert m is not None, f"{cls}.{name} is missing"
            assert m["params"] == [("self", "POSITIONAL_OR_KEYWORD", True)], (cls, name, m)
        m = methods[f"{cls}.post_validation"]
        assert m["params"] == [("self", "POSITIONAL_OR_KEYWORD", True),
                               ("free_buffers_callback", "POSITIONAL_OR_KEYWORD", True)], (cls, m)
        assert m["returns"] == [4], (cls, m)
    assert methods["DistributedOptimizer.post_validation"]["defined_in"] == "DistributedOptimizer.post_validation"
    assert report["post_validation_enabled_default"]

    for p in (2, 3, 4):
        for rank in range(p):
            calls, _ = _zbpp_calls(rank, p)
            for name, args, kwargs in calls:
                assert not kwargs, (name, kwargs)
                if name == "post":
                    # One positional argument, the free_buffers_callback, which takes none.
                    assert len(args) == 1 and callable(args[0]), args
                    args[0]()
                else:
                    assert args == (), (name, args)


def test_zb_fork_scheduler_orders_post_validation_as_zbpp_calls_it(fork):
    """On every stage of the fork's own schedules with post-validation (ZB-V, V-Half, V-Min and a
    one-chunk schedule through the same passes; 2 to 4 stages), the post-validation nodes come in
    the order zbpp calls them on that pipeline rank: recv unless last, send unless first, post."""
    report = _report(fork)
    orders = report["orders"]
    assert {kind for kind, _p in orders} == {"1f1b", "zb-v", "v-half", "v-min"}
    for (kind, p), stages in orders.items():
        assert len(stages) == p
        for rank, fork_order in enumerate(stages):
            calls, _ = _zbpp_calls(rank, p)
            assert [name for name, _a, _k in calls] == fork_order, (kind, p, rank)


def test_zb_fork_runtime_and_train_step_take_what_zbpp_returns(fork):
    """The fork's runtime (run_until_post_validation) calls post_validation with one argument,
    unpacks (updated, grad_norm, rollback, succeed) and returns (updated, grad_norm, rollback); its
    train_step calls forward_backward_func(..., optimizer=optimizer) and unpacks three values.
    zbpp returns the first three of post_validation's four."""
    report = _report(fork)
    runtime = report["runtime"]
    assert runtime is not None, "the fork's runtime has no run_until_post_validation"
    assert runtime["post_validation"] and all(
        call == (1, ["updated", "grad_norm", "rollback", "succeed"]) for call in runtime["post_validation"])
    assert runtime["recv_post_validation"] and all(c == (0, None) for c in runtime["recv_post_validation"])
    assert runtime["send_post_validation"] and all(c == (0, None) for c in runtime["send_post_validation"])
    assert runtime["returns"] == [["updated", "grad_norm", "rollback"]]
    step = report["train_step"]
    assert (1, ["update_successful", "grad_norm", "num_zeros_in_grad"]) in step["optimizer_call"]
    assert step["optimizer_kwarg"]
    for p in (2, 3):
        for rank in range(p):
            _calls, result = _zbpp_calls(rank, p)
            assert tuple(result) == ("updated", "grad_norm", "rollback")


def test_zb_fork_post_validation_runs_through_zbpp(fork):
    """Three gloo processes with the fork's megatron (its parallel state and pipeline group): the
    fork's own recv_pre_step / partially_reduce_local_total_norm / send_pre_step carry the partial
    norm down the pipeline, then get_forward_backward_func()(..., optimizer=opt), with
    zbpp.megatron.patch() in place, runs the fork's recv_post_validation / send_post_validation /
    post_validation: every rank ends with the global grad norm, keeps its step and reports no
    rollback, for two iterations in a row (the second waits for the first one's sends)."""
    run = fork[1]
    if isinstance(run, BaseException):
        pytest.fail(f"the fork's post-validation through zbpp failed:\n{run}", pytrace=False)
    assert len(run) == FORK_WORLD
    for it, squares in enumerate(SQUARES):
        total = torch.zeros(1)
        for s in squares:  # the fork's float32 running sum along the pipeline
            total = total + torch.tensor([s])
        expected = total.item() ** 0.5
        for per_rank in run:
            res = per_rank["iterations"][it]
            assert res["fbf"] == "zbpp.megatron.run.forward_backward_func"
            assert res["do_this_step"] is True
            assert res["result"] == (True, expected, False), (per_rank["rank"], it, res)
            assert res["states"]["grad_norm"] == expected
    for per_rank in run:
        assert "megatron.core.pipeline_parallel" in per_rank["patched"]


@pytest.mark.parametrize("name", ["zbpp-vocab-1f1b", "zbpp-vocab-1f1b-untied-unfused", "zbpp-vocab-zb-auto",
                                  "zbpp-vocab-v-half-untied"])
def test_vocab_parallel_matches_megatron(training, name):
    """--enable-vocab-parallel (with --disable-backward-fusion, untied embeddings, zb-auto, V-Half):
    the word embedding and output layer split over both ranks, their passes in the schedule,
    pretrain_gpt's loss_func (loss mask, num_tokens) on the per-token losses. Against Megatron's
    own 1F1B with its own layers: losses, eval losses, grad norms and gradients (the split weights
    gathered whole) within float32 rounding (the softmax's sum is merged from the shards', as the
    reference's is). The parameters after Adam within 2e-4 (2% of lr): Adam divides each gradient
    by its own root mean square, so elements with tiny gradients turn rounding into up to a few
    percent of an update."""
    mtr, results = training
    res = _get(results, name)
    untied = "--untie-embeddings-and-output-weights" in res["case"]["flags"]
    ref = _get(results, "megatron-untied" if untied else "megatron")
    _check_zbpp_ran(res, name)
    diffs = [d for d in mtr.differences(ref, res, tolerance=(1e-5, 1e-6)) if not d.startswith("params[")]
    params = [d for d in mtr.differences(ref, res, tolerance=(1e-5, 2e-4)) if d.startswith("params[")]
    diffs += _adam_noise_exempt(ref, res, params, atol=2e-4)  # (linear_qkv's key bias, see there)
    assert not diffs, f"{name} is not close to Megatron in {len(diffs)} places:\n" + "\n".join(diffs[:20])
    # The layers really were split: every rank holds rows of them, and none holds the whole layers.
    for rank in res["ranks"]:
        local = rank["init_params_local"]
        assert sum(n.startswith("zbpp_vocab.") for n in local) == (1 if not untied else 2), (rank["coords"], local)
        assert not any(n.startswith(("embedding.word_embeddings", "output_layer")) for n in local), local
