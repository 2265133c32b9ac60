"""Zero-copy stages: a zbpp schedule hands the runner the tensors its stages produce and reads the
ones it receives in place, so no activation or gradient is copied on its way between stages
(zb_runner_config_t.release_cb). Checked here on the CPU, where the same code runs: a stage's input
is the very tensor the stage before it on this rank produced, a step issues no copy or clone of a
boundary-shaped tensor (torch's dispatcher counts them), and training still matches the loop.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import zbpp.pipelining as zp  # noqa: E402

D, MB, M = 6, 4, 4  # boundary tensors are [MB, D]; parameters are [D, D] and [D]


class CountCopies(TorchDispatchMode):
    """Counts aten copy_/clone calls on tensors of one shape."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("copy_", "clone", "_to_copy") and tuple(args[0].shape) == self.shape:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _stages():
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(3)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_stages_on_one_rank_hand_their_tensors_on_without_copies(one_process_group, device):
    mods = [m.to(device) for m in _stages()]
    ref = copy.deepcopy(mods)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(MB * M, D, generator=g).to(device), torch.randn(MB * M, D, generator=g).to(device)
    loss_fn = torch.nn.MSELoss()

    # Three stages on the one rank: the handoffs 0 -> 1 -> 2 never leave this process.
    stages = [zp.PipelineStage(mods[s], s, 3, device) for s in range(3)]
    sched = zp.ScheduleLoopedBFS(stages, M, loss_fn=loss_fn)
    produced, received = {}, {}
    for s, mod in enumerate(mods):
        mod.register_forward_hook(lambda m, i, o, s=s: produced.setdefault(s, []).append(o.data_ptr()))
        mod.register_forward_pre_hook(lambda m, i, s=s: received.setdefault(s, []).append(i[0].data_ptr()))
    sched.step(x, target=y)  # the first step also works out the shapes
    for mod in mods:
        mod.zero_grad()
    produced.clear(), received.clear()
    counter = CountCopies((MB, D))
    losses = []
    with counter:
        sched.step(x, target=y, losses=losses)
    assert counter.count == 0, f"{counter.count} copies of activations or gradients in one step"
    # Each stage's inputs are the tensors the stage before it produced (the same memory).
    for s in (1, 2):
        assert received[s] == produced[s - 1], f"stage {s}"

    # And it trains like the loop.
    ref_losses = []
    for xi, yi in zip(x.chunk(M), y.chunk(M)):
        h = xi
        for mod in ref:
            h = mod(h)
        loss = loss_fn(h, yi)
        loss.backward()
        ref_losses.append(loss.detach())
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b)
    for mod, r in zip(mods, ref):
        for p, q in zip(mod.parameters(), r.parameters()):
            torch.testing.assert_close(p.grad, q.grad / M)


def test_a_stage_that_passes_its_input_on_keeps_its_own_copy(one_process_group):
    """A middle stage that returns its input (a view of the runner's buffer) and a last stage that
    returns its input both still give the right outputs: those are copied, not lent or kept as views
    of memory the runner reuses."""
    torch.manual_seed(0)
    mods = [torch.nn.Linear(D, D), torch.nn.Identity(), torch.nn.Linear(D, D), torch.nn.Identity()]
    ref = copy.deepcopy(mods)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(MB * M, D, generator=g), torch.randn(MB * M, D, generator=g)
    loss_fn = torch.nn.MSELoss()
    stages = [zp.PipelineStage(mods[s], s, 4, "cpu") for s in range(4)]
    sched = zp.ScheduleLoopedBFS(stages, M, loss_fn=loss_fn)
    for _ in range(2):
        for mod in mods:
            mod.zero_grad()
        out = sched.step(x, target=y)
    with torch.no_grad():
        want = x
        for mod in ref:
            want = mod(want)
    torch.testing.assert_close(out, want)
    for xi, yi in zip(x.chunk(M), y.chunk(M)):
        h = xi
        for mod in ref:
            h = mod(h)
        loss_fn(h, yi).backward()
    for mod, r in zip(mods, ref):
        for p, q in zip(mod.parameters(), r.parameters()):
            torch.testing.assert_close(p.grad, q.grad / M)
