"""zbpp.megatron in this process: patch()/unpatch() on the installed megatron-core, the zero-bubble
flags (add_arguments, configure, schedule_for), and the reference fork's post-validation protocol.

No pipeline runs here. Training, evaluation, the misuse errors, the optimizer= call and a dead peer
are tested against real Megatron-LM (megatron-core) on two and four CPU processes in
test_megatron_real.py (harness: megatron_real.py).

megatron-core has no megatron.training (Megatron's argument parser and train_step): the flags are
parsed here by a plain argparse parser extended with add_arguments, as Megatron's parse_args does
with an extra_args_provider; patch() patches the megatron.core modules it finds.
"""

import argparse
import importlib
import sys

import pytest

torch = pytest.importorskip("torch")

import megatron_real as mr  # noqa: E402 - tests/python is on sys.path under pytest; imports no Megatron

import zbpp.megatron as zm  # noqa: E402

# Where patch() installs the function, as megatron-core 0.16 ships it (megatron.training, not part of
# megatron-core, adds megatron.training.training when installed).
CORE_TARGETS = ("megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules")


def _parse(argv):
    """Megatron's parse_args(extra_args_provider=zbpp.megatron.add_arguments), in miniature."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    return zm.add_arguments(parser).parse_args(list(argv))


@pytest.fixture
def fresh_config():
    """zbpp.megatron's configuration cleared before and after the test."""
    zm.configure()
    yield
    zm.configure()


@pytest.fixture(scope="module")
def megatron_core():
    """The installed megatron-core's pipeline_parallel modules, imported in this process (about 3 s;
    only this module's patch test asks for it). They stay imported afterwards (unpatched): a later
    import would cost the same again, and test_megatron_layers.py's fixture reuses them."""
    if not mr.megatron_core_installed():
        pytest.skip("megatron-core is not installed")
    modules = {name: importlib.import_module(name) for name in CORE_TARGETS}
    yield modules
    zm.unpatch()


# ---- patching the installed Megatron ---------------------------------------------------------------------

def _training_targets():
    """megatron.training's modules that imported get_forward_backward_func, where installed (not
    with megatron-core alone)."""
    found = {}
    for name in ("megatron.training.training", "megatron.training"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "get_forward_backward_func"):
            found[name] = module
    return found


def test_patch_replaces_the_lookups_and_unpatch_restores(megatron_core):
    modules = dict(megatron_core, **_training_targets())
    names = list(modules)
    originals = {n: modules[n].get_forward_backward_func for n in names}
    # One function, imported under several names (the package re-exports the schedules' one).
    assert len(set(map(id, originals.values()))) == 1
    assert originals[names[0]].__module__ == "megatron.core.pipeline_parallel.schedules"
    try:
        assert zm.patch() == names
        for n in names:
            assert modules[n].get_forward_backward_func is zm.get_forward_backward_func, n
        # What Megatron's train_step / evaluate call, and with any sizes.
        from megatron.core import pipeline_parallel
        assert pipeline_parallel.get_forward_backward_func() is zm.forward_backward_func
        assert pipeline_parallel.get_forward_backward_func(pp_size=4, vp_size=2) is zm.forward_backward_func
        assert zm.patch() == names  # idempotent: the originals are kept from the first call
    finally:
        restored = zm.unpatch()
    assert sorted(restored) == sorted(names)
    for n in names:
        assert modules[n].get_forward_backward_func is originals[n], n
    assert zm.unpatch() == []


def test_patch_without_megatron_says_so(monkeypatch):
    # Hide any Megatron (None in sys.modules makes its import fail).
    for name in ("megatron", "megatron.core", "megatron.core.pipeline_parallel",
                 "megatron.core.pipeline_parallel.schedules", "megatron.training", "megatron.training.training"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="Megatron-LM was not found"):
        zm.patch()


# ---- the flags -------------------------------------------------------------------------------------------

def test_add_arguments_parses_the_five_flags(fresh_config, capsys):
    args = _parse(["--enable-zero-bubble", "--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup",
                   "half", "--zero-bubble-max-pending-backward", "6", "--enable-optimizer-post-validation"])
    assert (args.enable_zero_bubble, args.zero_bubble_v_schedule, args.zero_bubble_v_schedule_mem_setup,
            args.zero_bubble_max_pending_backward, args.enable_optimizer_post_validation) == (True, True, "half", 6, True)
    defaults = _parse([])
    assert (defaults.enable_zero_bubble, defaults.zero_bubble_v_schedule, defaults.zero_bubble_v_schedule_mem_setup,
            defaults.zero_bubble_max_pending_backward, defaults.enable_optimizer_post_validation) == (
                False, False, "zb", "auto", False)
    zm.configure(args)
    assert zm.options().enable_optimizer_post_validation is True
    for bad, text in ((["--zero-bubble-v-schedule-mem-setup", "tiny"], "invalid choice: 'tiny'"),
                      (["--zero-bubble-max-pending-backward", "0"], "'auto' or an integer >= 1")):
        with pytest.raises(SystemExit):
            _parse(bad)
        err = capsys.readouterr().err
        assert text in err, err
    # A parser that already has the flags (the reference fork's Megatron) keeps its own.
    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-zero-bubble", action="store_true")
    zm.add_arguments(parser)
    assert parser.parse_args(["--enable-zero-bubble", "--zero-bubble-v-schedule"]).zero_bubble_v_schedule


def test_fork_flags_are_accepted_or_refused_by_name(fresh_config):
    """The reference fork's other flags parse; those selecting something zbpp does not run are an error
    that names the flag (never silently ignored); the rest change nothing."""
    accepted = _parse(["--enable-zb-runtime", "--enable-exactly-numeric-match",
                       "--no-pre-communication-optimization", "--zero-bubble-pipeline-timers-start-iter", "5",
                       "--zero-bubble-pipeline-timers-end-iter", "9", "--offload-time", "2.0",
                       "--zero-bubble-adaptive-memory-limit-percentile", "70", "--enable-zero-bubble"])
    zm.configure(accepted)
    assert zm.options().zero_bubble_adaptive_memory_limit_percentile == 70
    assert zm.schedule_for(1, 4, zm.options()) == ("zb-auto", 4)
    for argv, flag in ((["--enable-1f1b-v"], "--enable-1f1b-v"), (["--num-seq-splits", "2"], "--num-seq-splits"),
                       (["--interleave-group-size", "2"], "--interleave-group-size"),
                       (["--offload-chunk-num", "-1"], "--offload-chunk-num"), (["--offload-time", "0"], "--offload-time")):
        with pytest.raises(ValueError, match=flag):
            zm.configure(_parse(argv))
    with pytest.raises(ValueError, match="percentile"):
        zm.configure(_parse(["--zero-bubble-adaptive-memory-limit-percentile", "0"]))


def test_vocab_parallel_flags_parse_and_what_they_do_not_go_with_is_refused(fresh_config):
    """sail-sg/VocabularyParallelism's flags are options (vocab_model_provider reads them); a call
    whose settings differ from the model's, or that asks for what the split layers do not run,
    fails naming what and why (on every rank alike: the checks read only the flags and config)."""
    import types

    from zbpp.megatron.vocab import check_call

    zm.configure(_parse(["--enable-vocab-parallel", "--disable-backward-fusion"]))
    opts = zm.options()
    assert opts.enable_vocab_parallel and opts.disable_backward_fusion
    import torch

    def ctx(device="cpu"):
        return types.SimpleNamespace(vp=types.SimpleNamespace(fused=False, parameters=lambda: [torch.zeros(1, device=device)]))

    unfused = ctx()
    fp32 = types.SimpleNamespace(fp16=False, bf16=False)
    plain = [torch.nn.Linear(1, 1)]
    gathering = [torch.nn.Linear(1, 1)]
    gathering[0].ddp_config = types.SimpleNamespace(overlap_param_gather=True)
    check_call(unfused, fp32, opts, False, False, plain)  # what the model was built for: fine
    for c, config, o, fwd, collect, chunks, text in (
            (unfused, fp32, opts._replace(enable_vocab_parallel=False), False, False, plain, "flag is off"),
            (unfused, fp32, opts._replace(disable_backward_fusion=False), False, False, plain,
             "--disable-backward-fusion"),
            (unfused, fp32, opts._replace(cpu_offload=True), False, False, plain, "--cpu-offload"),
            (unfused, fp32, opts, True, True, plain, "collect_non_loss_data"),
            (unfused, types.SimpleNamespace(fp16=False, bf16=True), opts, False, False, plain, "bf16"),
            (unfused, fp32, opts, False, False, gathering, "--overlap-param-gather"),
            # The shards must be where the chunks are (on CUDA, get_model's .cuda() moves both);
            # a second device here: meta.
            (ctx("meta"), fp32, opts, True, False, plain, "move them together"),
            (unfused, fp32, opts, False, False, [torch.nn.Linear(1, 1, device="meta")], "move them together")):
        with pytest.raises(ValueError, match=text):
            check_call(c, config, o, fwd, collect, chunks)


def test_fork_offload_flags_choose_what_moves(fresh_config):
    """--cpu-offload turns PipeOffload on for any schedule; --offload-chunk-num N lets only the first N
    chunks of every rank move (stages below N * p, loop or V); --offload-time times the copies where
    nothing is measured; --auto-offload-time and --offload-overlap-sr are accepted."""
    from zbpp.megatron.flags import offload

    zm.configure(_parse([]))
    assert offload(zm.options(), 4, 2) == (None, None)
    zm.configure(_parse(["--cpu-offload", "--auto-offload-time", "--offload-overlap-sr", "--offload-time", "0.75"]))
    chosen, times = offload(zm.options(), 4, 2)
    assert chosen == "auto" and times == {"f": 1.0, "b": 1.0, "w": 1.0, "offload": 1.5, "reload": 1.5}
    zm.configure(_parse(["--cpu-offload", "--offload-chunk-num", "1"]))
    assert offload(zm.options(), 4, 2)[0] == [0, 1, 2, 3]
    zm.configure(_parse(["--cpu-offload", "--offload-chunk-num", "2"]))
    assert offload(zm.options(), 4, 2)[0] == "auto"


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


def test_optimizer_call_with_zbpp_post_validation():
    """optimizer= with zbpp's PostValidatedOptimizer: its post-validated step, returned in the fork's
    contract (update_successful, grad_norm, rolled_back); an inf gradient skips the update."""
    import zbpp
    from zbpp.megatron.hooks import optimizer_step

    w = torch.nn.Parameter(torch.ones(3))
    post = zbpp.PostValidatedOptimizer(torch.optim.SGD([w], lr=0.5), {0: [w]}, 1)
    w.grad = torch.tensor([3.0, 4.0, 0.0])
    ok, norm, rolled = optimizer_step(post, 0, 1)
    assert (ok, rolled) == (True, False) and norm == pytest.approx(5.0)
    assert torch.equal(w.detach(), torch.tensor([-0.5, -1.0, 1.0]))
    w.grad = torch.tensor([float("inf"), 0.0, 0.0])
    ok, norm, rolled = optimizer_step(post, 0, 1)
    assert ok is False and torch.equal(w.detach(), torch.tensor([-0.5, -1.0, 1.0]))
    post.close()
