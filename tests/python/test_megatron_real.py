"""zbpp.megatron against real Megatron-LM (megatron-core) on CPU: a tiny GPT trained for two steps
over gloo on two pipeline ranks, once with Megatron's own schedule and once with zbpp's behind
zbpp.megatron.patch(); losses, evaluation losses (and collect_non_loss_data's data), gradients and
parameters must agree bit for bit, also with Megatron's linear layers split by zbpp.split_linear
(their weight gradients run in zbpp's W with torch's own ops, the W store's "torch" kernel: every
zero-bubble kind equals stock Megatron's 1F1B at pp 2 and 4 and at tp 2; with the C library's GEMM,
where libzbpp_torch.so is not built, only closely).

Also on real Megatron: the schedule chosen by the zero-bubble flags; the loss dicts on the last
pipeline rank; forward-only passes leaving the gradients alone; each model chunk running under its
virtual pipeline rank; zbpp with one pipeline rank and two data parallel ones; the misuse errors
(a V schedule with one chunk, collect_non_loss_data without forward_only, no loss_func, too few
microbatches for interleaved 1F1B), each leaving zbpp usable; the reference fork's optimizer= call;
a dead peer giving zbpp.ZbError that names it, not a hang.

The harness is megatron_real.py. The two-rank cases run in one pair of worker processes (Megatron's
import takes about 6 s per process), started once for the module (the dead-peer case, which ends
the workers, is last), the four-rank ones in one set of four.

Every case trains the same 4-layer model: pp=2 with 2 layers per rank, or pp=2 with vp=2 and one
layer per model chunk. The weights come from the parameters' global names and the data from
(step, microbatch), so the two layouts train the same model on the same data; that Megatron's own
1F1B and interleaved schedules then agree bit for bit checks the harness itself.
"""

import re

import pytest


import megatron_real as mr  # noqa: E402 - tests/python is on sys.path under pytest; imports no Megatron

if not mr.megatron_core_installed():
    pytest.skip("megatron-core is not installed", allow_module_level=True)
torch = pytest.importorskip("torch")

WORLD = 2
TIMEOUT = 60

PLAIN = dict(pp=2, layers_per_stage=2)                # 1F1B layout: 2 layers per rank
INTERLEAVED = dict(pp=2, vp=2, layers_per_stage=1)    # interleaved: 1 layer per model chunk
# Megatron's features the schedules must carry: tied embeddings (the last stage's copy and the
# embedding-group all-reduce), bf16 with Float16Module, per-token loss (num_tokens to
# finalize_model_grads), overlapped gradient reduction (no_sync_func / grad_sync_func),
# config.grad_scale_func (a loss scale, as Megatron's optimizer sets it).
FEATURES = dict(PLAIN, tied=True, dtype="bf16", per_token=True, overlap_grad_reduce=True, loss_scale=1024.0)
V_LAYOUT = dict(pp=2, vp=2, layers_per_stage=1, v_order=True)
# The older 2-tuple loss_func, no attention mask in the batch, AdamW.
OLD_LOSS = dict(PLAIN, loss_form="mean", attention_mask=False, optimizer="adamw")
# One pipeline rank, two data parallel ones (Megatron's forward_backward_no_pipelining).
PP1 = dict(pp=1, layers_per_stage=4)
# Evaluation with a collect_non_loss_data pass too, and with autograd on (Megatron evaluates under
# no_grad; forward_only must not touch the gradients either way).
EVAL = dict(collect=True, eval_no_grad=False)

CASES = {
    "megatron": dict(PLAIN, collect=True),
    # The schedule from the flags (none: 1F1B); the reference fork's optimizer= call steps the
    # optimizer; two calls that must fail first, which leave zbpp usable.
    "zbpp-1f1b": dict(PLAIN, **EVAL, use_zbpp=True, zbpp_argv=[], optimizer_call=True,
                      misuse=["v-one-chunk", "collect-training"]),
    "zbpp-zb-h1": dict(PLAIN, use_zbpp=True, zbpp_kind="zb-h1"),
    "megatron-interleaved": dict(INTERLEAVED, collect=True),
    # No flag, two chunks: interleaved 1F1B; first a call with m = 3 on 2 ranks, which it cannot run.
    "zbpp-interleaved-1f1b": dict(INTERLEAVED, collect=True, use_zbpp=True, zbpp_argv=[],
                                  misuse=["few-microbatches", "v-loop-chunks"]),
    # --zero-bubble-v-schedule: ZB-V on chunks built in V order (loss stage on rank 0).
    "zbpp-zb-v-flag": dict(V_LAYOUT, **EVAL, use_zbpp=True, zbpp_argv=["--zero-bubble-v-schedule"]),
    "zbpp-zb-h1-split": dict(PLAIN, use_zbpp=True, zbpp_kind="zb-h1", zbpp_split=True),
    "megatron-features": dict(FEATURES),
    "zbpp-zb-h1-features": dict(FEATURES, use_zbpp=True, zbpp_kind="zb-h1"),
    # Megatron's linears split by zbpp: under Megatron's own schedule each W runs inside its B; under
    # zbpp's zero-bubble schedules it runs later, through the same GEMM, so the bits agree.
    "megatron-split": dict(PLAIN, zbpp_split=True),
    "zbpp-zb-h2-split": dict(PLAIN, use_zbpp=True, zbpp_kind="zb-h2", zbpp_split=True),
    "zbpp-zb-auto-split": dict(PLAIN, use_zbpp=True, zbpp_kind="zb-auto", zbpp_split=True),
    # ZB-V: two chunks per rank in a V, built by zbpp.megatron.v_model_provider, against Megatron's
    # 1F1B on the same 4 layers (V: rank 0 holds layers 0 and 3 with the embedding and the loss).
    "zbpp-zb-v-split": dict(V_LAYOUT, use_zbpp=True, zbpp_kind="zb-v", zbpp_split=True),
    "zbpp-zb-v-features": dict(FEATURES, **V_LAYOUT, use_zbpp=True, zbpp_kind="zb-v"),
    # Everything at once, split: W passes writing bf16 models' fp32 main_grad, the tied copies, the
    # per-token count and the overlapped reduction started after each chunk's last W.
    "megatron-features-split": dict(FEATURES, zbpp_split=True),
    "zbpp-zb-h1-features-split": dict(FEATURES, use_zbpp=True, zbpp_kind="zb-h1", zbpp_split=True),
    "zbpp-zb-v-features-split": dict(FEATURES, **V_LAYOUT, use_zbpp=True, zbpp_kind="zb-v", zbpp_split=True),
    # --enable-zero-bubble: zb-auto at memory p, with every feature.
    "zbpp-zb-auto-flag-features": dict(FEATURES, use_zbpp=True, zbpp_argv=["--enable-zero-bubble"]),
    "megatron-old-loss": dict(OLD_LOSS),
    "zbpp-1f1b-old-loss": dict(OLD_LOSS, use_zbpp=True, zbpp_kind="1f1b"),
    # One pipeline rank: a forward_step_func without loss_func first (the error needs no peer to
    # learn of it), then training as usual.
    "megatron-pp1": dict(PP1),
    "zbpp-pp1": dict(PP1, use_zbpp=True, zbpp_argv=[], misuse=["no-loss-func"]),
    # --enable-vocab-parallel (vocabulary_model_provider): the word embedding and output layer
    # split over both ranks, untied (1F1B, fused) and tied with the per-token loss (ZB-V,
    # --disable-backward-fusion), against Megatron with its own layers.
    "zbpp-vocab-1f1b": dict(PLAIN, use_zbpp=True, vocab_parallel=True, zbpp_argv=["--enable-vocab-parallel"]),
    "megatron-tied-per-token": dict(PLAIN, tied=True, per_token=True),
    "zbpp-vocab-zb-v-tied-per-token-unfused": dict(
        V_LAYOUT, tied=True, per_token=True, use_zbpp=True, vocab_parallel=True,
        zbpp_argv=["--enable-vocab-parallel", "--disable-backward-fusion", "--zero-bubble-v-schedule"]),
    # A forward_step_func without loss_func: the last stage's rank finds out on its S lane's thread.
    "zbpp-vocab-misuse": dict(PLAIN, steps=1, use_zbpp=True, vocab_parallel=True,
                              zbpp_argv=["--enable-vocab-parallel"], misuse=["no-loss-func"]),
    # Last (it ends the workers): rank 1 exits before the first step; rank 0's call must fail with
    # ZbError naming it, at once (the zbpp timeout bounds a hang).
    "dead-peer": dict(PLAIN, steps=1, use_zbpp=True, zbpp_kind="1f1b", zbpp_timeout=20,
                      fail_rank=1, fail_mode="exit"),
}


@pytest.fixture(scope="module")
def results():
    names = list(CASES)
    out = mr.run_cases(WORLD, [CASES[n] for n in names], timeout=TIMEOUT)
    return dict(zip(names, out))


def _get(results, name):
    res = results[name]
    if isinstance(res, BaseException):
        pytest.fail(f"case {name} failed:\n{res}", pytrace=False)
    return res


def _assert_same(results, ref_name, name, same_layout=True):
    ref, res = _get(results, ref_name), _get(results, name)
    diffs = mr.differences(ref, res)
    assert not diffs, f"{name} differs from {ref_name} in {len(diffs)} places:\n" + "\n".join(diffs[:20])
    if same_layout:
        # Same batches read by the same chunks in the same order on every rank.
        # (The collect_non_loss_data passes' reads where both cases made them.)
        both = ref["case"]["collect"] and res["case"]["collect"]
        for r, (a, b) in enumerate(zip(ref["ranks"], res["ranks"])):
            ra, rb = ([x for x in rank["reads"] if both or x[0] != "collect"] for rank in (a, b))
            assert ra == rb, f"rank {r} read different batches under {name}"


def _sane(res, steps=2, m=4, kind=None):
    """The run did something, with the schedule it was meant to (kind: when the flags choose it):
    every step has m loss dicts, finite values and gradients."""
    case = res["case"]
    for rank in res["ranks"]:
        if case["use_zbpp"]:
            kind = kind or case["zbpp_kind"]
            assert kind is not None
            assert rank["ran"] == {f"zbpp.megatron.run.forward_backward_func [{kind}]"}
        else:
            which = "with" if case["vp"] else "without"
            assert rank["ran"] == {"megatron.core.pipeline_parallel.schedules."
                                   f"forward_backward_pipelining_{which}_interleaving"}
    assert len(res["losses"]) == steps and all(len(step) == m for step in res["losses"])
    assert len(res["eval_losses"]) == steps and all(len(step) == m for step in res["eval_losses"])
    assert all(torch.isfinite(d["lm loss"]).all() for step in res["losses"] for d in step)
    names = set(res["init_params"])
    # (tp > 1 keys tensor-parallel shards "<name>#tp<rank>")
    assert {"embedding.word_embeddings.weight", "decoder.layers.3.mlp.linear_fc2.weight",
            "decoder.final_layernorm.weight"} <= {n.split("#tp")[0] for n in names}
    for step in range(steps):
        assert set(res["grads"][step]) == names and set(res["params"][step]) == names
        assert any(g.abs().sum() > 0 for g in res["grads"][step].values())


def test_megatron_layouts_agree(results):
    """The harness: Megatron's 1F1B (2 layers per rank) and interleaved 1F1B (1 layer per chunk)
    train the same model bit for bit, so weights and data do not depend on the placement."""
    _sane(_get(results, "megatron"))
    _assert_same(results, "megatron", "megatron-interleaved", same_layout=False)


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_zbpp_matches_megatron(results, kind):
    _sane(_get(results, f"zbpp-{kind}"), kind=kind)
    _assert_same(results, "megatron", f"zbpp-{kind}")


def test_zbpp_interleaved_matches_megatron(results):
    _sane(_get(results, "zbpp-interleaved-1f1b"), kind="interleaved-1f1b")
    _assert_same(results, "megatron-interleaved", "zbpp-interleaved-1f1b")


def test_zbpp_matches_megatron_with_tied_bf16_per_token_overlap_loss_scale(results):
    res = _get(results, "megatron-features")
    _sane(res)
    # The tied copy on the last stage equals the word embeddings, before and after each step.
    for params in [res["init_params"]] + res["params"]:
        assert torch.equal(params["output_layer.weight"], params["embedding.word_embeddings.weight"])
    assert res["init_params"]["output_layer.weight"].dtype == torch.bfloat16
    assert res["grads"][0]["output_layer.weight"].dtype == torch.float32
    _assert_same(results, "megatron-features", "zbpp-zb-h1-features")


def test_zbpp_matches_megatron_with_two_tuple_loss(results):
    _sane(_get(results, "megatron-old-loss"))
    _assert_same(results, "megatron-old-loss", "zbpp-1f1b-old-loss")


def _w_kernel(res):
    kernels = {rank["w_kernel"] for rank in res["ranks"] if rank is not None}
    assert len(kernels) == 1, kernels
    return kernels.pop()


SPLIT_VS_STOCK = [
    # (stock Megatron, zbpp-split case, same layout): Megatron's 1F1B without any split on one side
    ("megatron", "megatron-split", True),          # Megatron's own schedule, W at once inside B
    ("megatron", "zbpp-zb-h1-split", True),
    ("megatron", "zbpp-zb-h2-split", True),
    ("megatron", "zbpp-zb-auto-split", True),
    ("megatron", "zbpp-zb-v-split", False),
    ("megatron-features", "megatron-features-split", True),
    ("megatron-features", "zbpp-zb-h1-features-split", True),
    ("megatron-features", "zbpp-zb-v-features-split", False),
]


@pytest.mark.parametrize("ref, name, same_layout", SPLIT_VS_STOCK, ids=[c[1] for c in SPLIT_VS_STOCK])
def test_zbpp_split_matches_stock_megatron_bit_for_bit(results, ref, name, same_layout):
    """Megatron's linear layers split by zbpp, their W deferred into the zero-bubble schedules'
    W passes: the losses, gradients and parameters of stock Megatron (no split), bit for bit, as
    zbpp's W runs Megatron's own ops (grad_output^T @ total_input, added to main_grad as its DDP
    hook adds .grad). With the library's GEMM instead (no libzbpp_torch.so), close."""
    res = _get(results, name)
    _sane(res, kind=None if not res["case"]["use_zbpp"] else res["case"]["zbpp_kind"])
    split = res["ranks"][0]["split"]
    assert split is not None and split["split"] and not split["not_split"]
    if _w_kernel(res) == "torch":
        _assert_same(results, ref, name, same_layout=same_layout)
        return
    _assert_close(_get(results, ref), res)


def _assert_close(ref, res):
    for step in range(2):
        for a, b in zip(ref["losses"][step], res["losses"][step]):
            torch.testing.assert_close(b["lm loss"], a["lm loss"], rtol=1e-5, atol=1e-5)
        for field in ("grads", "params"):
            for name, t in ref[field][step].items():
                torch.testing.assert_close(res[field][step][name], t, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, f=field, s=step, n=name: f"{f}[{s}][{n}]: {m}")


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2", "zb-auto"])
def test_zbpp_split_matches_megatron_split_bitwise(results, kind):
    """Megatron's own 1F1B with the layers split (W inside each B) and zbpp's zero-bubble schedules
    (W deferred into the bubbles) train bit for bit alike; and the split really happens: the W store
    ran the weight GEMM of every ColumnParallelLinear/RowParallelLinear for every microbatch."""
    ref, res = _get(results, "megatron-split"), _get(results, f"zbpp-{kind}-split")
    _sane(res)
    _assert_same(results, "megatron-split", f"zbpp-{kind}-split")
    # Both sides ran the same weight GEMMs through the W store (Megatron's at once inside B), so the
    # equality above compares deferred W with W at once, not two unsplit runs.
    for ranks in (ref["ranks"], res["ranks"]):
        for rank in ranks:
            split = rank["split"]
            assert split["split"] and not split["not_split"], split
            # 2 layers x (linear_qkv, linear_proj, linear_fc1, linear_fc2), + output_layer on the last stage.
            linears = 8 + (1 if rank["coords"]["pp"] == 1 else 0)
            assert len(split["split"]) == linears, split["split"]
            assert rank["gemms_run"] == linears * 4 * 2, f"rank {rank['coords']}: {rank['gemms_run']} W GEMMs"


def test_zbpp_zb_v_matches_megatron(results):
    """ZB-V on stock Megatron: chunks built in V order by v_model_provider (rank 0: layers 0 and 3,
    the embedding and the loss), split layers; bit for bit Megatron's 1F1B on the same model."""
    res = _get(results, "zbpp-zb-v-split")
    _sane(res)
    assert [r["chunks"] for r in res["ranks"]] == [[0, 1], [0, 1]]
    _assert_same(results, "megatron-split", "zbpp-zb-v-split", same_layout=False)
    for rank in res["ranks"]:
        # Rank 0 holds the output layer (V's last stage): 4 linears per chunk + output_layer.
        linears = 8 + (1 if rank["coords"]["pp"] == 0 else 0)
        assert rank["gemms_run"] == linears * 4 * 2, f"rank {rank['coords']}: {rank['gemms_run']} W GEMMs"


def test_zbpp_zb_v_matches_megatron_with_tied_bf16_per_token_overlap_loss_scale(results):
    """ZB-V with tied embeddings (both copies on rank 0, the embedding group rank 0 alone, zbpp sums
    their gradients), bf16, per-token loss (num_tokens from rank 0), overlapped grad reduce."""
    _sane(_get(results, "zbpp-zb-v-features"))
    _assert_same(results, "megatron-features", "zbpp-zb-v-features", same_layout=False)


@pytest.mark.parametrize("name", ["zbpp-zb-h1-features-split", "zbpp-zb-v-features-split"])
def test_zbpp_split_with_every_feature_matches_megatron(results, name):
    _sane(_get(results, name))
    _assert_same(results, "megatron-features-split", name, same_layout=False)


# ---- the flags, the loss dicts' rank, evaluation, virtual ranks ------------------------------------------

FLAG_CASES = [
    # (case, Megatron's case to match, the kind the flags choose, its memory limit, same layout)
    ("zbpp-1f1b", "megatron", "1f1b", None, True),                      # no flag, one chunk
    ("zbpp-interleaved-1f1b", "megatron-interleaved", "interleaved-1f1b", None, True),  # no flag, two
    ("zbpp-zb-v-flag", "megatron", "zb-v", None, False),                # --zero-bubble-v-schedule
    ("zbpp-zb-auto-flag-features", "megatron-features", "zb-auto", 2, True),  # --enable-zero-bubble: p
    ("zbpp-pp1", "megatron-pp1", "1f1b", None, True),                   # no flag, one rank
]


@pytest.mark.parametrize("name, ref, kind, mem, same_layout", FLAG_CASES)
def test_flags_choose_the_schedule_and_it_matches_megatron(results, name, ref, kind, mem, same_layout):
    """The zero-bubble flags, parsed by add_arguments' parser and given to configure(args=...), choose
    the schedule that runs; it trains as Megatron's own does, bit for bit."""
    res = _get(results, name)
    _sane(res, kind=kind)
    for rank in res["ranks"]:
        assert rank["schedule_for"] == [kind, mem], rank["schedule_for"]
    _assert_same(results, ref, name, same_layout=same_layout)


@pytest.mark.parametrize("name, ref, loss_rank", [("zbpp-1f1b", "megatron", 1),
                                                  ("zbpp-interleaved-1f1b", "megatron-interleaved", 1),
                                                  ("zbpp-zb-v-flag", "megatron", 0)])
def test_loss_dicts_come_back_on_the_last_pipeline_rank(results, name, ref, loss_rank):
    """Megatron's train_step and evaluate read the loss dicts on the last pipeline rank, where its
    schedules return them ([] elsewhere). Under V the loss stage is on rank 0, which returns them and
    sends them to the last rank, which returns them too."""
    res, want = _get(results, name), _get(results, ref)
    last = want["ranks"][-1]
    assert want["ranks"][0]["losses"] == [[]] * 2  # Megatron's own: nothing on the first rank
    for r, rank in enumerate(res["ranks"]):
        assert rank["holds_loss"] == (r == loss_rank), f"rank {r}"
        for field in ("losses", "eval_losses", "collected"):
            if r in (loss_rank, len(res["ranks"]) - 1):
                assert len(rank[field]) == len(last[field]) == 2, f"{name}, rank {r}: {field}"
                for step, (got, exp) in enumerate(zip(rank[field], last[field])):
                    assert len(got) == len(exp) == 4, f"{name}, rank {r}: {field}[{step}]"
                    for a, b in zip(got, exp):
                        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
                            f"{name}, rank {r}: {field}[{step}] differs from Megatron's"
            else:
                assert rank[field] == [[]] * 2, f"{name}, rank {r}: {field} {rank[field]}"


@pytest.mark.parametrize("name", ["zbpp-1f1b", "zbpp-interleaved-1f1b", "zbpp-zb-v-flag"])
def test_forward_only_and_collect_non_loss_data_match_megatron_and_leave_grads(results, name):
    """Evaluation (forward_only=True) and a collect_non_loss_data pass: Megatron's own results
    (test_flags_choose_the_schedule_and_it_matches_megatron compares eval_losses and collected bit for
    bit, and the batches read), loss_func(output, non_loss_data=True)'s data, and no gradient touched,
    with autograd on (zbpp-1f1b, zbpp-zb-v-flag) or off."""
    res = _get(results, name)
    assert res["collected"] is not None and len(res["collected"]) == 2
    for step in res["collected"]:
        assert len(step) == 4 and all(set(d) == {"token losses", "loss mask"} for d in step)
        assert all(d["token losses"].shape == (2, 8) for d in step)
    for r, rank in enumerate(res["ranks"]):
        assert rank["eval_touched"] == [[], []], f"rank {r}: forward_only changed {rank['eval_touched']}"


@pytest.mark.parametrize("name", ["zbpp-interleaved-1f1b", "zbpp-zb-v-flag"])
def test_each_chunk_runs_under_its_virtual_pipeline_rank(results, name):
    """parallel_state's (deprecated, global) virtual pipeline rank names the chunk whose forward_step
    runs, in training and evaluation, as older Megatron's interleaved schedule set it."""
    for r, rank in enumerate(_get(results, name)["ranks"]):
        assert rank["virtual_ranks"] == {0: [0], 1: [1]}, f"rank {r}: {rank['virtual_ranks']}"


# ---- misuse, the optimizer= call, a dead peer -----------------------------------------------------------

MISUSE = [
    # (case, misuse, exception type, text in its message, items read from each iterator)
    ("zbpp-1f1b", "v-one-chunk", "ValueError",
     r"zb-v \(--zero-bubble-v-schedule\) needs 2 model chunks per pipeline rank.*has 1 chunk", [0]),
    ("zbpp-1f1b", "collect-training", "ValueError", r"collect_non_loss_data needs forward_only=True", [0]),
    ("zbpp-interleaved-1f1b", "few-microbatches", "RuntimeError", r"multiple of the pipeline-parallel size",
     [0, 0]),
    # Stock Megatron builds the two chunks in loop order; a V schedule needs v_model_provider's.
    ("zbpp-interleaved-1f1b", "v-loop-chunks", "ValueError",
     r"zb-v is a V schedule.*built (with|without) the embedding.*v_model_provider\(model_provider\)", [0, 0]),
    ("zbpp-pp1", "no-loss-func", "ValueError",
     r"forward_step_func returned no loss_func \(None\) for microbatch 0 on the loss stage", [1]),
]


@pytest.mark.parametrize("name, misuse, exc_type, text, pulled", MISUSE, ids=[m[1] for m in MISUSE])
def test_misuse_is_a_clear_error_and_zbpp_goes_on(results, name, misuse, exc_type, text, pulled):
    """Each misuse fails on every rank with zbpp's message (the C library's for the schedule), reads no
    data it should not (the failed forward only the microbatch it ran), and the case's training after
    it still matches Megatron's (test_flags_choose_the_schedule_and_it_matches_megatron)."""
    for r, rank in enumerate(_get(results, name)["ranks"]):
        got = rank["misuse"][misuse]
        assert got["type"] == exc_type, f"rank {r}: {got}"
        assert re.search(text, got["message"]), f"rank {r}: {got['message']}"
        assert got["pulled"] == pulled, f"rank {r}: the failed call read {got['pulled']}"
        if misuse == "no-loss-func":
            # The runner's error, naming the op, stays attached as the cause.
            assert got["cause_type"] == "ZbError" and "F(stage 0, mb 0)" in got["cause"], got
        if exc_type == "ZbError":
            assert got["module"] == "zbpp._lib"


def test_optimizer_call_steps_the_optimizer_once_and_reads_no_data(results):
    """The reference fork's train_step steps through forward_backward_func(..., optimizer=...): a stock
    optimizer's step() runs once per call and the call returns (update_successful, grad_norm, False)
    without a pass; the parameters are Megatron's own (test_zbpp_matches_megatron[1f1b])."""
    for r, rank in enumerate(_get(results, "zbpp-1f1b")["ranks"]):
        calls = rank["optimizer_calls"]
        assert len(calls) == 2, f"rank {r}: {calls}"
        for step, call in enumerate(calls):
            _ok, norm, _zeros = call["step_returned"]
            assert call["returned"] == (True, norm, False), f"rank {r}, step {step}: {call}"
            assert call["steps"] == step + 1, f"rank {r}: the optimizer stepped {call['steps']} times"
            assert call["pulled"] == [0], f"rank {r}: the optimizer= call read {call['pulled']}"


def test_dead_peer_gives_zberror_naming_it(results):
    res = _get(results, "dead-peer")
    assert res["ranks"][1] is None  # it exited
    got = res["ranks"][0]["dead_peer"]
    assert got["type"] == "ZbError" and got["module"] == "zbpp._lib", got
    assert "rank 1" in got["message"], got["message"]
    # At once, from the closed connection: not at the zbpp timeout (20 s), not a hang.
    assert got["seconds"] < 10, got


# ---- four pipeline ranks --------------------------------------------------------------------------------

PLAIN4 = dict(pp=4, layers_per_stage=2, m=8)
V4 = dict(pp=4, vp=2, layers_per_stage=1, m=8, v_order=True)
# Two pipeline ranks of two tensor-parallel ranks each, the same 4 layers in both layouts.
TP2 = dict(pp=2, tp=2, layers_per_stage=2)
TP2_V = dict(pp=2, tp=2, vp=2, layers_per_stage=1, v_order=True)
CASES4 = {
    "megatron": dict(PLAIN4),
    "megatron-features": dict(FEATURES, **PLAIN4),
    "megatron-split": dict(PLAIN4, zbpp_split=True),
    "zbpp-zb-h1-split": dict(PLAIN4, use_zbpp=True, zbpp_kind="zb-h1", zbpp_split=True),
    "zbpp-zb-h2-split": dict(PLAIN4, use_zbpp=True, zbpp_kind="zb-h2", zbpp_split=True),
    "megatron-features-split": dict(FEATURES, **PLAIN4, zbpp_split=True),
    "zbpp-zb-v-features-split": dict(FEATURES, **V4, use_zbpp=True, zbpp_kind="zb-v", zbpp_split=True),
    "zbpp-v-min-split": dict(V4, use_zbpp=True, zbpp_kind="v-min", zbpp_split=True),
    "megatron-tp2": dict(TP2),
    "megatron-tp2-split": dict(TP2, zbpp_split=True),
    "zbpp-zb-h1-tp2-split": dict(TP2, use_zbpp=True, zbpp_kind="zb-h1", zbpp_split=True),
    "zbpp-zb-h2-tp2-split": dict(TP2, use_zbpp=True, zbpp_kind="zb-h2", zbpp_split=True),
    "zbpp-zb-auto-tp2-split": dict(TP2, use_zbpp=True, zbpp_kind="zb-auto", zbpp_split=True),
    "zbpp-zb-v-tp2-split": dict(TP2_V, use_zbpp=True, zbpp_kind="zb-v", zbpp_split=True),
    # Last: a worker that raises must come back as a WorkerError with its traceback.
    "failing-worker": dict(PLAIN4, steps=1, fail_rank=1),
}


@pytest.fixture(scope="module")
def results4():
    names = list(CASES4)
    out = mr.run_cases(4, [CASES4[n] for n in names], timeout=TIMEOUT * 2)
    return dict(zip(names, out))


@pytest.mark.parametrize("ref, name", [("megatron-split", "zbpp-zb-h2-split"),
                                       ("megatron-split", "zbpp-v-min-split"),
                                       ("megatron-features-split", "zbpp-zb-v-features-split")])
def test_four_ranks_match_megatron(results4, ref, name):
    _sane(_get(results4, name), m=8)
    _assert_same(results4, ref, name, same_layout=False)


SPLIT_VS_STOCK4 = [
    # pp = 4 (8 layers, m = 8)
    ("megatron", "megatron-split", True),
    ("megatron", "zbpp-zb-h1-split", True),
    ("megatron", "zbpp-zb-h2-split", True),
    ("megatron", "zbpp-v-min-split", False),
    ("megatron-features", "megatron-features-split", True),
    ("megatron-features", "zbpp-zb-v-features-split", False),
    # pp = 2, tp = 2 (4 layers, m = 4): column- and row-parallel layers, the all-reduced dgrad
    ("megatron-tp2", "megatron-tp2-split", True),
    ("megatron-tp2", "zbpp-zb-h1-tp2-split", True),
    ("megatron-tp2", "zbpp-zb-h2-tp2-split", True),
    ("megatron-tp2", "zbpp-zb-auto-tp2-split", True),
    ("megatron-tp2", "zbpp-zb-v-tp2-split", False),
]


@pytest.mark.parametrize("ref, name, same_layout", SPLIT_VS_STOCK4, ids=[c[1] for c in SPLIT_VS_STOCK4])
def test_four_ranks_split_matches_stock_megatron_bit_for_bit(results4, ref, name, same_layout):
    """As test_zbpp_split_matches_stock_megatron_bit_for_bit, at pp = 4 and at pp = 2 with tp = 2."""
    res = _get(results4, name)
    m = res["case"]["m"]
    _sane(res, m=m, kind=None if not res["case"]["use_zbpp"] else res["case"]["zbpp_kind"])
    assert all(rank["split"]["split"] and not rank["split"]["not_split"] for rank in res["ranks"])
    if res["case"]["tp"] == 2:
        assert any(name.endswith("#tp1") for name in res["grads"][0]), "tensor-parallel shards compared"
    if _w_kernel(res) == "torch":
        _assert_same(results4, ref, name, same_layout=same_layout)
        return
    _assert_close(_get(results4, ref), res)


def test_worker_error_comes_back_with_its_traceback(results4):
    err = results4["failing-worker"]
    assert isinstance(err, mr.WorkerError)
    text = str(err)
    assert "failure injected on rank 1" in text
    assert "in forward_step" in text and "Traceback" in text


@pytest.mark.parametrize("name, ref", [("zbpp-vocab-1f1b", "megatron"),
                                       ("zbpp-vocab-zb-v-tied-per-token-unfused", "megatron-tied-per-token")])
def test_vocab_parallel_matches_megatron(results, name, ref):
    """--enable-vocab-parallel through zbpp.megatron on megatron-core's GPTModel: each rank holds
    rows of the word embedding and the output layer (none holds them whole), the passes run in
    the schedule, the case's loss_func (loss mask, num_tokens; per-token: the count to
    finalize_model_grads) on the per-token losses. The training and evaluation losses, the
    gradients and the parameters (the split layers gathered whole) are Megatron's own layers'
    within float32 rounding: the softmax's sum is merged from the shards' (the reference's
    algorithm), so not bit for bit."""
    import torch

    a, b = _get(results, ref), _get(results, name)
    _sane(b, kind="zb-v" if b["case"]["v_order"] else "1f1b")
    for field in ("losses", "eval_losses"):
        for step, (da, db) in enumerate(zip(a[field], b[field])):
            assert len(da) == len(db) == 4, (field, step)
            for x, y in zip(da, db):
                for k in x:
                    torch.testing.assert_close(y[k].float(), x[k].float(), rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{field}[{step}][{k}]: {m}")
    for field in ("init_params", "grads", "params"):
        xs, ys = (a[field], b[field]) if field != "init_params" else ([a[field]], [b[field]])
        for step, (dx, dy) in enumerate(zip(xs, ys)):
            assert set(dx) == set(dy), (field, sorted(set(dx) ^ set(dy)))
            for key in dx:
                torch.testing.assert_close(dy[key], dx[key], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{field}[{step}][{key}]: {m}")
    tied = b["case"]["tied"]
    # gather() after training gives the whole weights, the ones the last step left.
    gathered = b["ranks"][0]["vocab_gathered"]
    for key, name in (("embedding.weight", "embedding.word_embeddings.weight"), ("output.weight", "output_layer.weight")):
        torch.testing.assert_close(gathered[key], b["params"][-1][name], rtol=0, atol=0)
    for rank in b["ranks"]:
        outside = rank["vocab_outside"]
        # Outside zbpp's calls the split layers say what to do instead of failing deep inside.
        if rank["coords"]["pp"] == 0:
            assert "run it through zbpp.megatron's forward_backward_func" in outside["forward"], outside
        assert "NotImplementedError" in outside["sharded_state_dict"] and "not supported yet" in \
            outside["sharded_state_dict"], outside
    for rank in b["ranks"]:
        local = rank["local_names"]
        assert sum(n.startswith("zbpp_vocab.") for n in local) == (1 if tied else 2), local
        assert not any(n.startswith(("embedding.word_embeddings", "output_layer")) for n in local), local


def test_vocab_parallel_missing_loss_func_fails_on_every_rank_and_training_goes_on(results):
    """Under --enable-vocab-parallel Megatron's loss_func runs on the last stage's rank after the
    output layer's all-reduces (its S lane): without one, that rank and its peer both fail with the
    reason, and the next call trains (the lanes and the pipeline are made again)."""
    import torch

    res = _get(results, "zbpp-vocab-misuse")
    for r, rank in enumerate(res["ranks"]):
        got = rank["misuse"]["no-loss-func"]
        assert "returned no loss_func for microbatch 0 on the last stage" in got["message"], f"rank {r}: {got}"
    assert len(res["losses"]) == 1 and len(res["losses"][0]) == 4
    assert all(torch.isfinite(d["lm loss"]).all() for d in res["losses"][0])

