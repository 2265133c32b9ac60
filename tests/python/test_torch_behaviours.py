"""torch.distributed.pipelining's behaviours that scripts depend on, from zbpp.pipelining, checked
against the installed torch's own schedules wherever the same question can be put to both.

- A batch that does not split evenly: torch.tensor_split's microbatches (64 rows in 3 are 22, 21
  and 21) on a one-process pipeline, for every torch class; outputs, losses and gradients equal
  torch's own bit for bit. Across ranks such a batch fails on every rank, before anything runs,
  with torch's PipeliningMetadataError (torch's schedules fail on it too, at the first transfer).
- Metadata that a boundary cannot carry (a shape that changes between steps, a stage that returns
  no tensor): torch's PipeliningMetadataError on every rank of the pipeline.
- stage.backward_weight_one_chunk() inside a BACKWARD_WEIGHT custom function runs what the stage's
  dw_builder returned at that microbatch's B, as torch's runtime does.
- How often each stage's module and the loss_fn run: torch's metadata inference runs every stage
  once more at the first step and after each switch between step() and eval(); zbpp's counts are
  torch's, step by step.
- Pre-split microbatches (step(arg_mbs=, kwarg_mbs=, target_mbs=), torchtitan's call) and keyword
  arguments, which torch hands to every stage of a rank.
- torchtitan's own pipeline code (its stage split, its schedule builder, its trainer's step call)
  with zbpp aliased in for torch.distributed.pipelining: every schedule it offers trains as torch's,
  bit for bit, on 2 gloo processes. Needs a torchtitan checkout in $TORCHTITAN_DIR (and the few
  packages its pipeline module imports: spmd_types, tyro); skipped without it.
"""

import copy
import inspect
import json
import os
import subprocess
import sys
import traceback

import pytest

torch = pytest.importorskip("torch")
tp = pytest.importorskip("torch.distributed.pipelining")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import zbpp  # noqa: E402
import zbpp.pipelining as zp  # noqa: E402

import pipeline_worker  # noqa: E402
import torch_release  # noqa: E402

ts = tp.schedules

# What torch 2.12 and older do not do as 2.13 does (torch_release.py): the comparisons are skipped there.
UNEVEN = torch_release.needs(2, 13, "uneven microbatches (it refuses a shape other than microbatch 0's)")
LOCAL_SENDS = torch_release.needs(2, 13, "stages of one process handing over in memory (it sends through gloo, "
                                         "which refuses to send to itself)")
INFERENCE_CALLS = torch_release.needs(2, 13, "2.13's count of its metadata inference's calls")
# torch 2.13's name; torch 2.11 (the GPU machine's) calls it PipeliningShapeError.
MetadataError = getattr(tp._utils, "PipeliningMetadataError", None) or tp._utils.PipeliningShapeError

SINGLE = ["ScheduleGPipe", "Schedule1F1B"]
MULTI = ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
         "ScheduleDualPipeV"]
D = 8


class Affine(torch.nn.Module):
    """x W^T + b through torch.nn.functional.linear, not nn.Linear: zbpp's zero-bubble classes then
    split its backward through the autograd graph, whose W is torch's own matmul, so every class can
    be compared with torch's to the bit. Counts its calls and the rows it saw."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.b = torch.nn.Parameter(torch.randn(D))
        self.rows = []

    def forward(self, x, scale=None):
        self.rows.append(x.shape[0])
        out = torch.tanh(torch.nn.functional.linear(x, self.w, self.b))
        return out * scale if scale is not None else out


def affine_stages(n):
    torch.manual_seed(0)
    return [Affine() for _ in range(n)]


def build(lib, cls_name, mods, loss_fn, **kwargs):
    """A one-process pipeline of `mods` (one stage each) under lib's class cls_name."""
    stages = [lib.PipelineStage(m, i, len(mods), torch.device("cpu")) for i, m in enumerate(mods)]
    cls = getattr(lib, cls_name)
    return cls(stages[0] if cls_name in SINGLE else stages, kwargs.pop("m"), loss_fn=loss_fn, **kwargs), stages


def n_stages(cls_name):
    return 1 if cls_name in SINGLE else 2


@pytest.fixture
def one_process_group(tmp_path):
    """torch's PipelineStage needs a process group; zbpp's runs with or without one."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def assert_equal_lists(got, want, what):
    assert len(got) == len(want), (what, len(got), len(want))
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}[{k}]: zbpp {a} vs torch {b}"


# ---- a batch that does not split evenly ----------------------------------------------------------

@UNEVEN
@pytest.mark.parametrize("cls_name", SINGLE + MULTI)
def test_uneven_microbatches_train_as_torchs_on_one_process(one_process_group, cls_name):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, D, generator=g), torch.randn(64, D, generator=g)
    m = 3
    results = {}
    for lib in (tp, zp):
        mods = affine_stages(n_stages(cls_name))
        sched, _ = build(lib, cls_name, mods, torch.nn.MSELoss(), m=m)
        losses = []
        out = sched.step(x, target=y, losses=losses)
        results[lib] = (out, losses, [p.grad for mod in mods for p in mod.parameters()], [mod.rows for mod in mods])
    (z_out, z_losses, z_grads, z_rows), (t_out, t_losses, t_grads, t_rows) = results[zp], results[tp]
    sizes = [len(part) for part in torch.tensor_split(x, m)]
    assert len(set(sizes)) > 1, "the batch must split unevenly for this test"
    # the microbatches torch makes (plus microbatch 0 once more: the shape inference of both)
    assert z_rows == t_rows and sorted(z_rows[0]) == sorted(sizes + sizes[:1]), (z_rows, t_rows)
    assert torch.equal(z_out, t_out)
    assert_equal_lists(z_losses, t_losses, "losses")
    assert_equal_lists(z_grads, t_grads, "gradients")


@UNEVEN
def test_uneven_microbatches_with_chunk_specs_and_a_target_split_as_torch_splits_them(one_process_group):
    """With args_chunk_spec (torch's split_args_kwargs_into_chunks): 10 rows along dim 1 in 4."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(D, 10, generator=g), torch.randn(10, D, generator=g)
    spec = (tp.microbatch.TensorChunkSpec(1),)
    results = {}
    for lib in (tp, zp):
        mod = affine_stages(1)[0]
        wrapped = torch.nn.Sequential(_Transpose(), mod)
        sched, _ = build(lib, "Schedule1F1B", [wrapped], torch.nn.MSELoss(), m=4, args_chunk_spec=spec)
        losses = []
        sched.step(x, target=y, losses=losses)
        results[lib] = (losses, [p.grad for p in mod.parameters()], mod.rows)
    assert results[zp][2] == results[tp][2]
    assert_equal_lists(results[zp][0], results[tp][0], "losses")
    assert_equal_lists(results[zp][1], results[tp][1], "gradients")


class _Transpose(torch.nn.Module):
    def forward(self, x):
        return x.t()


def _rank_body(rank, world, key, case, out_dir):
    """One rank of a 2-rank 1F1B pipeline of Affine stages that fails as `case` says; writes the
    error it got (type names along its classes, message) to out_dir/rank{rank}.json."""
    pipeline_worker._init(rank, world, key, timeout=60.0)
    got = {"error": None}
    try:
        torch.manual_seed(0)
        mod = Affine()
        if case == "nontensor" and rank == 0:
            mod.forward = lambda x: "not a tensor"
        sched = zp.Schedule1F1B(zp.PipelineStage(mod, rank, world, "cpu"), 4, loss_fn=torch.nn.MSELoss(),
                                timeout=30.0)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
        for k in range(1, 3):
            batch = x[:7] if case == "uneven" else x
            if case == "shape" and k == 2 and rank == 0:
                mod.forward = lambda x: torch.zeros(x.shape[0], D + 1)
            sched.step(batch) if rank == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001 - written for the test
        got = {"error": str(exc), "classes": [c.__name__ for c in type(exc).__mro__],
               "metadata": isinstance(exc, MetadataError), "zbpp_error": isinstance(exc, zbpp.ZbError),
               "trace": traceback.format_exc()[-2000:]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("case, first", [
    ("uneven", r"batch size 7, which does not split into n_microbatches=4 equal microbatches.*\[2, 2, 2, 1\].*one rank"),
    ("shape", r"stage 0 shape mismatch.*microbatch 0.*one rank"),
    ("nontensor", r"stage 0 must return tensors"),
])
def test_metadata_errors_are_torchs_class_on_every_rank(tmp_path, case, first):
    """The rank where it happens raises PipeliningMetadataError (also the ValueError or TypeError
    zbpp raised before); its peer, which learns it through the pipeline's failure path, raises a
    PipeliningMetadataError too, naming the rank and the reason (a ZbError as well when it learned
    it inside its step, the closed pipeline's RuntimeError when at the start of its next one)."""
    mp.spawn(_rank_body, args=(2, pipeline_worker.fresh_key(), case, str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    import re

    assert got[0]["error"] and re.search(first, got[0]["error"], re.S), got[0]
    assert got[0]["metadata"] and not got[0]["zbpp_error"], got[0]
    assert got[1]["error"] and "rank 0 failed first" in got[1]["error"], got[1]
    assert re.search(first, got[1]["error"], re.S), got[1]
    assert got[1]["metadata"], got[1]


# ---- backward_weight_one_chunk and dw_builder ------------------------------------------------------

class _DeferredMatmul(torch.autograd.Function):
    """y = x W^T whose backward returns only the input's gradient and leaves (x, dy) to the owner's
    dw_builder: the weight-gradient deferral torch's dw_builder exists for."""

    @staticmethod
    def forward(ctx, x, w, owner):
        ctx.save_for_backward(x, w)
        ctx.owner = owner
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        ctx.owner.pending.append((x, dy))
        return dy @ w, None, None  # no gradient for w here: dw_builder's work


class Deferred(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.b = torch.nn.Parameter(torch.randn(D))
        self.pending = []

    def forward(self, x):
        return torch.tanh(_DeferredMatmul.apply(x, self.w, self) + self.b)

    def dw_builder(self):
        """torch's protocol: called at the B, returns what adds this B's weight gradient at W."""
        x, dy = self.pending.pop()

        def run():
            g = dy.t() @ x
            self.w.grad = g if self.w.grad is None else self.w.grad + g
        return run


@LOCAL_SENDS
@pytest.mark.parametrize("cls_name", ["ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"])
@pytest.mark.parametrize("calls_it", [True, False], ids=["runs-dw", "skips-dw"])
def test_backward_weight_one_chunk_runs_dw_builders_work_in_a_w_function(one_process_group, cls_name, calls_it):
    """A BACKWARD_WEIGHT function that calls stage.backward_weight_one_chunk(mb) (or not) gets
    torch's W actions and leaves torch's gradients: with the call, the deferred weight gradients
    equal torch's bit for bit; without it they are missing, as in torch."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
    results = {}
    for lib in (tp, zp):
        torch.manual_seed(0)
        mods = [Deferred(), Deferred()]
        stages = [lib.PipelineStage(mod, i, 2, torch.device("cpu"), dw_builder=mod.dw_builder)
                  for i, mod in enumerate(mods)]
        sched = getattr(lib, cls_name)(stages, 4, loss_fn=torch.nn.MSELoss())
        seen = []

        def w_function(action, ctx, stages=stages, seen=seen):
            seen.append((action.stage_index, action.microbatch_index))
            if calls_it:
                stage = {s.stage_index: s for s in stages}[action.stage_index]
                stage.backward_weight_one_chunk(action.microbatch_index)

        sched.register_custom_function(ts.BACKWARD_WEIGHT, w_function)
        sched.step(x, target=y)
        results[lib] = (sorted(seen), [mod.w.grad for mod in mods], [mod.b.grad for mod in mods], sched)
    z, t = results[zp], results[tp]
    want = sorted((a.stage_index, a.microbatch_index) for a in z[3].pipeline_order[0]
                  if a.computation_type == ts.BACKWARD_WEIGHT)
    assert want and z[0] == want == t[0], (z[0], t[0])
    assert_equal_lists(z[2], t[2], "bias gradients")
    if calls_it:
        assert_equal_lists(z[1], t[1], "weight gradients")
    else:
        assert z[1] == t[1] == [None, None]


def test_backward_weight_one_chunk_outside_its_w_action_fails_clearly(one_process_group):
    torch.manual_seed(0)
    mods = [Deferred(), Deferred()]
    stages = [zp.PipelineStage(mod, i, 2, "cpu", dw_builder=mod.dw_builder) for i, mod in enumerate(mods)]
    sched = zp.ScheduleZBVZeroBubble(stages, 4, loss_fn=torch.nn.MSELoss())

    def wrong(action, ctx):
        stages[action.stage_index].backward_weight_one_chunk(action.microbatch_index + 1)

    sched.register_custom_function(ts.BACKWARD_WEIGHT, wrong)
    x, y = torch.randn(8, D), torch.randn(8, D)
    with pytest.raises(RuntimeError, match="not the work of the action being run"):
        sched.step(x, target=y)

    def twice(action, ctx):
        stages[action.stage_index].backward_weight_one_chunk(action.microbatch_index)
        stages[action.stage_index].backward_weight_one_chunk(action.microbatch_index)

    sched = zp.ScheduleZBVZeroBubble(stages, 4, loss_fn=torch.nn.MSELoss())
    sched.register_custom_function(ts.BACKWARD_WEIGHT, twice)
    with pytest.raises(AssertionError, match="ran already"):
        sched.step(x, target=y)


# ---- how often the stages and the loss run ---------------------------------------------------------

def _counts(lib, cls_name, calls, world=1, rank=0, examples=False):
    """Runs `calls` (step / eval) on lib's pipeline of Affine stages; per call, how often each stage
    of this rank ran forward and how often loss_fn ran. examples: every stage is built with
    input_args and output_args (torch then infers nothing)."""
    S = n_stages(cls_name) * world
    mods = affine_stages(S)
    if cls_name in SINGLE:
        mine = [rank]
    elif cls_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        mine = [rank, S - 1 - rank]
    else:
        mine = [rank, rank + world]
    loss_calls = []

    def loss_fn(out, target):
        loss_calls.append(1)
        return torch.nn.functional.mse_loss(out, target)

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)
    def example(s):  # a microbatch's boundaries as torch's examples: activations require gradients
        if not examples:
            return {}
        act = torch.zeros(2, D, requires_grad=True)
        return {"input_args": x[:2] if s == 0 else act, "output_args": act}

    stages = [lib.PipelineStage(mods[s], s, S, torch.device("cpu"), **example(s)) for s in mine]
    cls = getattr(lib, cls_name)
    sched = cls(stages[0] if cls_name in SINGLE else stages, 2, loss_fn=loss_fn)
    first = 0 in mine
    last = (S - 1) in mine
    out = []
    for call in calls:
        for s in mine:
            mods[s].rows.clear()
        loss_calls.clear()
        kw = {"target": y, "losses": []} if last else {}
        getattr(sched, call)(*((x,) if first else ()), **kw)
        out.append((call, {s: len(mods[s].rows) for s in mine}, len(loss_calls)))
    return out


@INFERENCE_CALLS
@pytest.mark.parametrize("cls_name", SINGLE + MULTI)
def test_stages_and_loss_run_as_often_as_torchs_on_one_process(one_process_group, cls_name):
    """torch runs its metadata inference at the first step (every stage once more, with the loss
    when training) and again after every switch between eval() and step(). (torch 2.13's eval()
    fails for two stages on one rank, so those classes compare two steps only.)"""
    calls = ["step", "step", "eval", "eval", "step"] if cls_name in SINGLE else ["step", "step"]
    got, want = _counts(zp, cls_name, calls), _counts(tp, cls_name, calls)
    assert got == want
    assert want[0] != want[1], "the first step must show the inference's extra calls"
    # Stages built with example inputs and outputs: torch infers nothing, and neither does zbpp.
    got, want = _counts(zp, cls_name, calls, examples=True), _counts(tp, cls_name, calls, examples=True)
    assert got == want and want[0] == want[1]


def _rank_counts(rank, world, key, cls_name, out_dir):
    pipeline_worker._init(rank, world, key, timeout=60.0)
    try:
        calls = ["step", "step", "eval", "eval", "step"]
        got = {"torch": _counts(tp, cls_name, calls, world, rank), "zbpp": _counts(zp, cls_name, calls, world, rank),
               "torch_examples": _counts(tp, cls_name, calls, world, rank, examples=True),
               "zbpp_examples": _counts(zp, cls_name, calls, world, rank, examples=True)}
    except Exception:  # noqa: BLE001 - written for the test
        got = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"counts{rank}.json"), "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()


@INFERENCE_CALLS
@pytest.mark.parametrize("cls_name", ["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_stages_and_loss_run_as_often_as_torchs_on_two_ranks(tmp_path, cls_name):
    mp.spawn(_rank_counts, args=(2, pipeline_worker.fresh_key(), cls_name, str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        got = json.loads((tmp_path / f"counts{r}.json").read_text())
        assert "error" not in got, got.get("error")
        assert got["zbpp"] == got["torch"], (r, got)
        assert got["zbpp_examples"] == got["torch_examples"], (r, got)


# ---- pre-split microbatches and keyword arguments --------------------------------------------------

def _presplit_step():
    """Whether the installed torch's step takes arg_mbs (pytorch/pytorch#188500, after 2.13)."""
    return "arg_mbs" in inspect.signature(ts.PipelineScheduleSingle.step).parameters


@LOCAL_SENDS
@pytest.mark.parametrize("cls_name", ["Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"])
def test_presplit_microbatches_and_keyword_arguments_train_as_torchs(one_process_group, cls_name):
    """step(arg_mbs=, kwarg_mbs=, target_mbs=) as torchtitan's trainer calls it equals the
    whole-batch step, and both equal torch's whole-batch step (its pre-split step too, where the
    installed torch has one); the keyword argument reaches every stage, as torch hands it on."""
    g = torch.Generator().manual_seed(1)
    x, y, scale = (torch.randn(8, D, generator=g), torch.randn(8, D, generator=g),
                   torch.rand(8, 1, generator=g) + 0.5)
    m = 4
    xs, ys, ss = x.chunk(m), y.chunk(m), scale.chunk(m)

    def run(lib, presplit):
        mods = affine_stages(n_stages(cls_name))
        sched, _ = build(lib, cls_name, mods, torch.nn.MSELoss(), m=m)
        losses = []
        if presplit:
            out = sched.step(arg_mbs=[(a,) for a in xs], kwarg_mbs=[{"scale": s} for s in ss], target_mbs=list(ys),
                             losses=losses)
        else:
            out = sched.step(x, scale=scale, target=y, losses=losses)
        return out, losses, [p.grad for mod in mods for p in mod.parameters()]

    want = run(tp, False)
    for got in (run(zp, True), run(zp, False)) + ((run(tp, True),) if _presplit_step() else ()):
        assert torch.equal(got[0], want[0])
        assert_equal_lists(got[1], want[1], "losses")
        assert_equal_lists(got[2], want[2], "gradients")
    # without the keyword argument on the second stage the result would differ: it did reach it
    mods = affine_stages(n_stages(cls_name))
    plain = mods[-1](mods[0](xs[0], scale=ss[0]) if len(mods) > 1 else xs[0], scale=ss[0])
    unscaled = mods[-1](mods[0](xs[0], scale=ss[0]) if len(mods) > 1 else xs[0])
    assert not torch.equal(plain, unscaled)


def test_presplit_microbatches_are_checked_as_torch_checks_them():
    sched = zp.Schedule1F1B(zp.PipelineStage(affine_stages(1)[0], 0, 1, "cpu"), 2, loss_fn=torch.nn.MSELoss())
    x, y = torch.randn(4, D), torch.randn(4, D)
    xs, ys = [(a,) for a in x.chunk(2)], list(y.chunk(2))
    with pytest.raises(ValueError, match="either whole or split"):
        sched.step(x, arg_mbs=xs, target_mbs=ys)
    with pytest.raises(ValueError, match="either whole or split"):
        sched.step(arg_mbs=xs, target=y)
    with pytest.raises(ValueError, match="Expecting 2 arg_mbs but got 1"):
        sched.step(arg_mbs=xs[:1], target_mbs=ys)
    with pytest.raises(TypeError, match="arg_mbs must be a list"):
        sched.step(arg_mbs=tuple(xs), target_mbs=ys)
    with pytest.raises(TypeError, match=r"kwarg_mbs\[1\] must be a dict"):
        sched.step(arg_mbs=xs, kwarg_mbs=[{}, ()], target_mbs=ys)
    # eval takes them too, and gives what the whole batch gives
    out = sched.eval(arg_mbs=xs)
    assert torch.equal(out, sched.eval(x))


# ---- zbpp in torch's place -------------------------------------------------------------------------

ALIAS_SCRIPT = r"""
import json, sys
import torch
import zbpp.pipelining as zp
sys.modules["torch.distributed.pipelining"] = zp  # the package only: its submodules follow
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _PipelineScheduleRuntime, get_schedule_class
import test_torch_behaviours as t

mods = t.affine_stages(2)
stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(mods)]
sched = get_schedule_class("ZBVZeroBubble")(stages, 4, loss_fn=torch.nn.MSELoss())
g = torch.Generator().manual_seed(1)
sched.step(torch.randn(8, t.D, generator=g), target=torch.randn(8, t.D, generator=g))
print(json.dumps({"classes": [ScheduleZBVZeroBubble is zp.ScheduleZBVZeroBubble, PipelineStage is zp.PipelineStage,
                              issubclass(ScheduleZBVZeroBubble, _PipelineScheduleRuntime)],
                  "grads": [p.grad.tolist() for m in mods for p in m.parameters()]}))
"""


def test_zbpp_aliased_in_for_torchs_package_runs_what_imports_torch(repo_root):
    """A script that puts zbpp.pipelining in sys.modules under torch's name, before torch's package
    was ever imported, then imports torch's names as torchtitan does: it gets zbpp's classes, and
    zbpp still finds torch's own data types (_torch.need); the step trains as zbpp does directly."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo_root / "bindings" / "python"),
                                                       str(repo_root / "tests" / "python")]))
    proc = subprocess.run([sys.executable, "-c", ALIAS_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["classes"] == [True, True, True]
    mods = affine_stages(2)
    sched = zp.ScheduleZBVZeroBubble([zp.PipelineStage(m, i, 2, "cpu") for i, m in enumerate(mods)], 4,
                                     loss_fn=torch.nn.MSELoss())
    g = torch.Generator().manual_seed(1)
    sched.step(torch.randn(8, D, generator=g), target=torch.randn(8, D, generator=g))
    assert got["grads"] == [p.grad.tolist() for m in mods for p in m.parameters()]


# ---- torchtitan --------------------------------------------------------------------------------

TORCHTITAN = os.environ.get("TORCHTITAN_DIR")
TITAN_SCHEDULES = ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                   "DualPipeV", "csv"]


def _titan_env(repo_root):
    paths = [TORCHTITAN, str(repo_root / "bindings" / "python"), str(repo_root / "tests" / "python")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


@pytest.fixture(scope="module")
def titan(repo_root):
    if not TORCHTITAN:
        pytest.skip("set TORCHTITAN_DIR to a torchtitan checkout (its pipeline module's imports installed: "
                    "spmd_types, tyro) to run torchtitan's pipeline code with zbpp aliased in")
    probe = subprocess.run([sys.executable, "-c", "import torchtitan.distributed.pipeline_parallel"],
                           env=_titan_env(repo_root), capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"TORCHTITAN_DIR={TORCHTITAN}: torchtitan's pipeline module does not import here: "
                    f"{probe.stderr.strip().splitlines()[-1]}")
    return _titan_env(repo_root)


@pytest.mark.parametrize("schedule", TITAN_SCHEDULES)
def test_torchtitans_pipeline_code_trains_as_torchs_with_zbpp_aliased_in(titan, tmp_path, repo_root, schedule):
    """titan_worker.py runs torchtitan's _pipeline_module_split and _build_pipeline_schedule and
    the trainer's step call unchanged, over a tiny model shaped like torchtitan's decoders, once with
    torch's package and once with zbpp aliased in for it; 3 optimizer steps of losses and every
    parameter after them must be equal bit for bit."""
    worker = repo_root / "tests" / "python" / "titan_worker.py"
    csv = tmp_path / "order.csv"
    if schedule == "csv":
        # torchtitan's pipeline_parallel_schedule_csv: torch's InterleavedZeroBubble order (F, I, W) of
        # 4 stages in a loop over 2 ranks, compute only, as torch's planner writes it
        from stand_ins import stand_in_class

        mock = stand_in_class(tp.stage._PipelineStageBase)
        order = ts.ScheduleInterleavedZeroBubble([mock(4, 2) for _ in range(2)], 4).pipeline_order
        csv.write_text("".join(",".join(str(a) for a in order[r] if a is not None) + "\n" for r in sorted(order)))
    runs = {}
    for impl in ("torch", "zbpp"):
        out = tmp_path / f"{impl}.pt"
        for attempt in range(2):
            proc = subprocess.run([sys.executable, str(worker), impl, schedule, str(out), str(csv)], env=titan,
                                  capture_output=True, text=True, timeout=300)
            # torch's own run (no zbpp loaded) sometimes aborts in gloo's teardown ("terminate called
            # without an active exception"): 3 times in 7 runs of these tests here. That is torch's reference, not what
            # is tested: run it once more. zbpp's runs get no second try.
            if proc.returncode == 0 or impl != "torch" or "terminate called without an active exception" not in proc.stderr:
                break
        assert proc.returncode == 0, f"{impl}: {proc.stderr[-4000:]}"
        runs[impl] = torch.load(out)
    z, t = runs["zbpp"], runs["torch"]
    assert z["schedule_class"].startswith("zbpp.pipelining") and t["schedule_class"].startswith("torch.")
    assert z["schedule_class"].split(".")[-1] == t["schedule_class"].split(".")[-1]
    assert z["losses"] == t["losses"] and len(t["losses"]) == 3, (z["losses"], t["losses"])
    assert z["params"].keys() == t["params"].keys()
    for name in t["params"]:
        assert torch.equal(z["params"][name], t["params"][name]), name
