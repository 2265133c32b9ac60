"""The automatic B/W split (PipelineStage's split_backward; zbpp/_autograd_split.py): any module's
backward under a schedule with W ops puts its weight gradients into W, and training stays the
sequential loop's bit for bit."""

import logging

import pytest

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
from zbpp import _autograd_split  # noqa: E402
from zbpp.split import capture  # noqa: E402


class Block(torch.nn.Module):
    """Parameters of every kind the split must reach: a Linear, a LayerNorm (one backward that
    feeds both the input and the weight), a bias added by hand, a scale used twice, and an output
    computed from a parameter alone (off every input path)."""

    def __init__(self, d=8, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = torch.nn.Linear(d, 2 * d)
        self.norm = torch.nn.LayerNorm(2 * d)
        self.out = torch.nn.Linear(2 * d, d)
        self.bias = torch.nn.Parameter(torch.randn(d, generator=g))
        self.scale = torch.nn.Parameter(torch.randn(d, generator=g))
        with torch.no_grad():
            for prm in (*self.lin.parameters(), *self.norm.parameters(), *self.out.parameters()):
                prm.copy_(torch.randn(prm.shape, generator=g))

    def forward(self, x):
        h = self.out(torch.tanh(self.norm(self.lin(x)))) + self.bias
        return h * self.scale + self.scale, self.scale.square().sum()


def _grads(split, first, mbs=3):
    block = Block()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(mbs)]
    weights, dxs = [], []
    for x, dy in data:
        x = x.clone().requires_grad_(not first)
        out, extra = block(x)
        if split:
            weights.append(_autograd_split.backward_input([out, extra], [dy, torch.tensor(0.5)], [x],
                                                          list(block.parameters())))
            # B leaves every parameter alone: its gradient is W's.
            assert all(prm.grad is None for prm in block.parameters())
        else:
            torch.autograd.backward([out, extra], [dy, torch.tensor(0.5)])
        dxs.append(x.grad)
    for w in weights:
        assert w is not None
        w()
    return {n: prm.grad for n, prm in block.named_parameters()}, dxs


@pytest.mark.parametrize("first", [False, True], ids=["input-needs-grad", "first-stage"])
def test_b_then_w_gives_the_full_backwards_bits(first):
    full, full_dx = _grads(split=False, first=first)
    split, split_dx = _grads(split=True, first=first)
    assert full.keys() == split.keys()
    for name in full:
        assert split[name] is not None, f"{name} got no gradient from W"
        assert torch.equal(full[name], split[name]), name
    for a, b in zip(full_dx, split_dx):
        assert (a is None and b is None) or torch.equal(a, b)


def test_a_split_linear_keeps_its_w_in_the_store_and_a_tied_use_still_reaches_w():
    """The head is a SplitLinear sharing its weight with an embedding: the store's W adds the
    head's part, the graph split the embedding's, once each (as a loop's backward)."""

    def build():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 6)
        head = zbpp.split_linear(torch.nn.Linear(6, 10, bias=False))
        head.weight = emb.weight
        return emb, head

    ids = torch.tensor([[1, 2, 3], [4, 5, 1]])
    emb, head = build()
    x = torch.randn(2, 3, 6, requires_grad=True)
    (head(emb(ids) + x).sum()).backward()
    want = emb.weight.grad.clone()

    emb, head = build()
    x2 = x.detach().clone().requires_grad_(True)
    loss = head(emb(ids) + x2).sum()
    with capture(stage=0, mb=0) as store:
        w = _autograd_split.backward_input([loss], [None], [x2], [emb.weight])
    store.store.pop_run(0)  # the head's part: a GEMM in the W store
    assert w is not None
    w()  # the embedding's part: the graph split
    assert torch.equal(x2.grad, x.grad)
    torch.testing.assert_close(emb.weight.grad, want, rtol=0, atol=1e-6)


def _pipeline(kind_cls, split_backward=None, steps=2, m=4):
    """Both stages of a V (or one stage) on this one rank, trained for `steps`; returns the losses,
    the parameters and the last step's measured W share."""
    torch.manual_seed(0)
    mods = [torch.nn.Sequential(Block(seed=1), _First()), torch.nn.Sequential(Block(seed=2), _First())]
    ref = [torch.nn.Sequential(Block(seed=1), _First()), torch.nn.Sequential(Block(seed=2), _First())]
    for a, b in zip(mods, ref):
        b.load_state_dict(a.state_dict())
    kw = {} if split_backward is None else {"split_backward": split_backward}
    stages = [zbpp.PipelineStage(mod, s, 2, "cpu") for s, mod in enumerate(mods)]
    sched = kind_cls(stages, m, loss_fn=lambda out, y: (out - y).square().mean(), **kw)
    g = torch.Generator().manual_seed(3)
    losses, ref_losses, same = [], [], True
    params = [p for mod in mods for p in mod.parameters()]
    ref_params = [p for mod in ref for p in mod.parameters()]
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        got = []
        sched.step(x, target=y, losses=got)
        losses.append([float(v) for v in got])
        step = []
        for xi, yi in zip(x.chunk(m), y.chunk(m)):
            loss = (ref[1](ref[0](xi)) - yi).square().mean()
            loss.backward()
            step.append(float(loss))
        ref_losses.append(step)
        with torch.no_grad():
            for a, b in zip(params, ref_params):
                b.grad.div_(m)  # the schedule divides by the number of microbatches (scale_grads)
                same = same and torch.equal(a.grad, b.grad)
                a -= 0.1 * a.grad
                b -= 0.1 * b.grad
                a.grad = b.grad = None
    share = sched.timeline().measured_w_share
    sched.close()
    return losses, ref_losses, same, share


class _First(torch.nn.Module):
    """Keeps the first of Block's two outputs (a stage passes one tensor on)."""

    def forward(self, pair):
        out, extra = pair
        return out + 0 * extra


@pytest.mark.parametrize("cls", ["ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"])
def test_a_zero_bubble_schedule_splits_any_module_and_trains_like_the_loop(cls):
    # Three steps: zb-auto (ScheduleInterleavedZeroBubble) runs step 2 with every backward fused,
    # to measure a fused backward (_plan.fused_variant); step 3 runs its plan, with W apart.
    losses, ref_losses, same, share = _pipeline(getattr(zbpp, cls), steps=3)
    assert losses == ref_losses
    assert same, "gradients differ from the sequential loop's"
    assert share > 0.05, f"W ops did no work (W share of the backward {share:.3f})"


def test_split_backward_false_keeps_w_empty_and_says_so_once(caplog):
    caplog.set_level(logging.WARNING, logger="zbpp")
    losses, ref_losses, same, share = _pipeline(zbpp.ScheduleZBVZeroBubble, split_backward=False)
    assert losses == ref_losses and same
    said = [r for r in caplog.records if "W ops" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "split_backward=False" in said[0].getMessage()


def test_schedules_without_w_run_the_backward_whole():
    losses, ref_losses, same, share = _pipeline(zbpp.ScheduleInterleaved1F1B)
    assert losses == ref_losses and same
    assert share == 0.0


def test_w_runs_no_input_gradient_work_again():
    """W runs only the parameters' branches: a backward on the input path that lies between two
    places where parameters join (here between the add of `w` and the multiply by `scale`) runs
    once, in B, not again in W (torch's split groups parameters the same way)."""
    calls = []

    class Costly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            calls.append(1)
            return g * 2

    scale = torch.nn.Parameter(torch.full((4,), 3.0))
    w = torch.nn.Parameter(torch.ones(4))
    x = torch.randn(2, 4, requires_grad=True)
    out = Costly.apply(x * scale) + w * 5
    weight = _autograd_split.backward_input([out], [torch.ones(2, 4)], [x], [scale, w])
    assert len(calls) == 1 and x.grad is not None
    weight()
    assert len(calls) == 1, "W ran the input path's backward again"
    assert torch.equal(w.grad, torch.full((4,), 10.0))
    assert torch.equal(scale.grad, (x.detach() * 2).sum(0))


class _Mixer(torch.nn.Module):
    """A weight matrix that is no Linear (x @ mix): its gradient is a GEMM only the graph split
    can move to W."""

    def __init__(self, d=8):
        super().__init__()
        self.mix = torch.nn.Parameter(torch.eye(d) + 0.1 * torch.randn(d, d, generator=torch.Generator().manual_seed(5)))

    def forward(self, x):
        return x @ self.mix


def _count_graph_splits(monkeypatch):
    """Counts the calls of the graph split's B (backward_input) whose stage has inputs needing a
    gradient (the first stage always goes through it: its whole backward runs at W)."""
    calls = []
    real = _autograd_split.backward_input

    def counted(outputs, grads, inputs, params, accumulators=None):
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            calls.append(len(params))
        return real(outputs, grads, inputs, params, accumulators)

    monkeypatch.setattr(_autograd_split, "backward_input", counted)
    return calls


def test_norm_scales_and_biases_left_by_the_linear_split_are_computed_in_b(monkeypatch):
    """Block's parameters other than its Linears are all of one dimension (a LayerNorm, a bias, a
    scale): the graph walk would cost more than their W moves, so B computes them. The Linears' W is
    still apart, and training is still the loop's bit for bit."""
    calls = _count_graph_splits(monkeypatch)
    losses, ref_losses, same, share = _pipeline(zbpp.ScheduleZBVZeroBubble)
    assert losses == ref_losses and same
    assert share > 0.05, f"W ops did no work (W share {share:.3f})"
    assert calls == [], "the graph split ran for a stage whose only leftovers are 1-d parameters"


def test_a_weight_matrix_no_splitter_knows_still_goes_to_w(monkeypatch):
    calls = _count_graph_splits(monkeypatch)
    torch.manual_seed(0)
    make = lambda: [torch.nn.Sequential(Block(seed=1), _First()),  # noqa: E731
                    torch.nn.Sequential(_Mixer(), Block(seed=2), _First())]
    mods, ref = make(), make()
    for a, b in zip(mods, ref):
        b.load_state_dict(a.state_dict())
    stages = [zbpp.PipelineStage(mod, s, 2, "cpu") for s, mod in enumerate(mods)]
    sched = zbpp.ScheduleZBVZeroBubble(stages, 4, loss_fn=lambda out, y: (out - y).square().mean())
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    sched.step(x, target=y)
    for xi, yi in zip(x.chunk(4), y.chunk(4)):
        ((ref[1](ref[0](xi)) - yi).square().mean()).backward()
    sched.close()
    assert calls, "the graph split did not run for a stage with a weight matrix no splitter defers"
    for a, b in zip([p for m in mods for p in m.parameters()], [p for m in ref for p in m.parameters()]):
        assert torch.equal(a.grad, b.grad.div_(4))


def test_split_layers_run_as_nn_linear_where_nothing_is_deferred(monkeypatch):
    """A fused backward (no W op apart: 1F1B-like schedules) and a stage whose input needs no
    gradient (its whole backward runs at W) have nothing for a split layer to defer: their
    forwards run nn.Linear's own (no split Function in the graph), with the same bits."""
    from zbpp.splitters import linear

    seen = []
    real = linear._SplitLinearFn.apply

    def counted(*args):
        seen.append(args[0].requires_grad)
        return real(*args)

    monkeypatch.setattr(linear._SplitLinearFn, "apply", counted)
    losses, ref_losses, same, share = _pipeline(zbpp.ScheduleInterleaved1F1B)
    assert losses == ref_losses and same and share == 0.0
    assert seen == [], f"{len(seen)} split-Function forwards under a schedule without W ops"
    losses, ref_losses, same, share = _pipeline(zbpp.ScheduleZBVZeroBubble)
    assert losses == ref_losses and same
    # Stage 0's input needs no gradient: only stage 1's Linears (2 per microbatch) take the split.
    assert seen and all(seen) and len(seen) == 2 * 4 * 2, len(seen)


def test_fused_forward_is_nn_linear_except_for_main_grad():
    from zbpp.splitters.linear import fused_forward

    lin = zbpp.split_linear(torch.nn.Linear(4, 3))
    x = torch.randn(5, 4, requires_grad=True)
    with fused_forward():
        out = lin(x)
    assert "SplitLinear" not in type(out.grad_fn).__name__
    lin.weight.main_grad = torch.zeros(3, 4)
    with fused_forward():
        out = lin(x)
    assert "SplitLinear" in type(out.grad_fn).__name__, "a layer with main_grad must keep the split"
