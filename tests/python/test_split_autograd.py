"""Split layers outside a pipeline behave as nn.Linear under torch.autograd (issue 24, item 7).

With no W store capturing, a split layer's backward returns its weight and bias gradients to
autograd, as nn.Linear's does, instead of writing .grad itself: torch.autograd.grad returns them
and leaves .grad alone, create_graph=True gives gradients that can be differentiated again
(gradient penalties, MAML), retain_graph=True lets backward run twice, and tensor hooks and
post-accumulate-grad hooks see the weight gradient. Each test builds a split model and an identical
nn.Linear model (same seed, copied weights, fp32) and compares the two within a tight bound: the W
GEMM of the split layer (the C library's CBLAS call) sums in another order than torch's.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
from zbpp.split import default_store  # noqa: E402

REL_FP32 = 1e-5


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _close(got, want, bound=REL_FP32, what=""):
    assert got is not None and want is not None, what
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert _rel(got, want) < bound, f"{what}: {_rel(got, want):.3g}"


def _models(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    ref = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 6, bias=False),
                              torch.nn.Tanh(), torch.nn.Linear(6, 5)).to(dtype)
    split = zbpp.split_linear(copy.deepcopy(ref))
    assert all(type(m).__name__ == "SplitLinear" for m in split if isinstance(m, torch.nn.Linear))
    return ref, split


def _x(seed=1, shape=(4, 7, 12), dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.randn(*shape, dtype=dtype)


def _loss(model, x):
    return model(x).square().mean()


def _no_grads(*models):
    for m in models:
        for n, p in m.named_parameters():
            assert p.grad is None, f"{n}: .grad was written"


# ---- torch.autograd.grad ----------------------------------------------------------------------------

_WHICH = ["weight", "bias", "x", "weight+bias", "weight+x", "all"]


def _inputs(model, x, which):
    out = []
    if "weight" in which or which == "all":
        out += [model[0].weight, model[2].weight, model[4].weight]
    if "bias" in which or which == "all":
        out += [model[0].bias, model[4].bias]
    if "x" in which or which == "all":
        out.append(x)
    return out


@pytest.mark.parametrize("which", _WHICH)
def test_autograd_grad_returns_nn_linears_gradients_and_leaves_grad_alone(which):
    ref, split = _models()
    x = _x()
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = torch.autograd.grad(_loss(ref, xr), _inputs(ref, xr, which))
    got = torch.autograd.grad(_loss(split, xs), _inputs(split, xs, which))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        _close(g, w, what=f"{which}[{i}]")
    _no_grads(ref, split)
    assert xr.grad is None and xs.grad is None
    assert default_store().live_entries() == 0


def test_autograd_grad_allow_unused_as_nn_linear():
    ref, split = _models(2)
    x = _x(3)
    # A layer the loss does not use: an error without allow_unused, None with it, for both models.
    extra_ref, extra_split = torch.nn.Linear(3, 3), zbpp.split_linear(torch.nn.Linear(3, 3))
    for model, extra in ((ref, extra_ref), (split, extra_split)):
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(_loss(model, x), [model[0].weight, extra.weight])
    want = torch.autograd.grad(_loss(ref, x), [ref[0].weight, ref[4].bias, extra_ref.weight], allow_unused=True)
    got = torch.autograd.grad(_loss(split, x), [split[0].weight, split[4].bias, extra_split.weight],
                              allow_unused=True)
    assert want[2] is None and got[2] is None
    _close(got[0], want[0], what="weight")
    _close(got[1], want[1], what="bias")
    # materialize_grads: zeros for the unused one, as nn.Linear
    got = torch.autograd.grad(_loss(split, x), [split[0].weight, extra_split.weight], allow_unused=True,
                              materialize_grads=True)
    assert torch.equal(got[1], torch.zeros_like(extra_split.weight))
    _no_grads(ref, split, extra_ref, extra_split)


def test_autograd_grad_with_a_frozen_weight_returns_the_bias_gradient():
    ref, split = _models(4)
    for m in (ref, split):
        m[0].weight.requires_grad_(False)
    x = _x(5)
    want = torch.autograd.grad(_loss(ref, x), [ref[0].bias, ref[2].weight])
    got = torch.autograd.grad(_loss(split, x), [split[0].bias, split[2].weight])
    _close(got[0], want[0], what="bias")
    _close(got[1], want[1], what="weight")
    _no_grads(ref, split)


def test_backward_with_inputs_fills_only_those_gradients():
    ref, split = _models(6)
    x = _x(7)
    for m in (ref, split):
        _loss(m, x).backward(inputs=[m[4].weight])
    _close(split[4].weight.grad, ref[4].weight.grad, what="weight")
    for m in (ref, split):
        assert all(p.grad is None for n, p in m.named_parameters() if n != "4.weight")


# ---- create_graph: double backward ------------------------------------------------------------------

def test_gradient_penalty_on_the_input_backpropagates_to_the_weights():
    ref, split = _models(8)
    x = _x(9)
    for m in (ref, split):
        xi = x.clone().requires_grad_()
        loss = _loss(m, xi)
        (gx,) = torch.autograd.grad(loss, xi, create_graph=True)
        _no_grads(m)  # the inner grad wrote no .grad
        (loss + gx.square().sum()).backward()
    for (n, p), (_, q) in zip(split.named_parameters(), ref.named_parameters()):
        _close(p.grad, q.grad, what=n)


def test_gradient_penalty_on_the_weights_backpropagates_to_the_weights():
    ref, split = _models(10)
    x = _x(11)
    for m in (ref, split):
        params = list(m.parameters())
        grads = torch.autograd.grad(_loss(m, x), params, create_graph=True)
        _no_grads(m)
        sum(g.square().sum() for g in grads).backward()
    for (n, p), (_, q) in zip(split.named_parameters(), ref.named_parameters()):
        _close(p.grad, q.grad, what=n)


@pytest.mark.parametrize("penalty", ["input", "weights"])
def test_gradient_penalty_under_autocast_reaches_the_weights_as_nn_linears(penalty):
    """The same penalties under torch.autocast(bfloat16) (a WGAN-GP on mixed precision): the casts
    of x and of the weight must be part of the double backward's graph. The weights' gradients
    were about 0.3 of nn.Linear's (and None for a later layer) before the fix."""
    ref, split = _models(20)
    x = _x(21)
    for m in (ref, split):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            loss = m(xi).float().square().mean()
            wrt = [xi] if penalty == "input" else list(m.parameters())
            grads = torch.autograd.grad(loss, wrt, create_graph=True)
            pen = sum((g.float().norm() - 1) ** 2 for g in grads)  # WGAN-GP's form
        (loss + pen).backward()
    for (n, p), (_, q) in zip(split.named_parameters(), ref.named_parameters()):
        _close(p.grad, q.grad, bound=3e-2, what=n)  # bf16 products, rounded in different places


def test_maml_inner_step_then_outer_loss_through_the_fast_weights():
    ref, split = _models(12)
    x_in, x_out = _x(13), _x(14)
    lr = 0.1
    outer = {}
    for name, m in (("ref", ref), ("split", split)):
        names, params = zip(*m.named_parameters())
        grads = torch.autograd.grad(_loss(m, x_in), params, create_graph=True)
        fast = {n: p - lr * g for n, p, g in zip(names, params, grads)}
        loss = torch.func.functional_call(m, fast, (x_out,)).square().mean()
        loss.backward()
        outer[name] = loss.item()
    assert abs(outer["split"] - outer["ref"]) <= 1e-5 * abs(outer["ref"])
    for (n, p), (_, q) in zip(split.named_parameters(), ref.named_parameters()):
        _close(p.grad, q.grad, what=n)


# ---- retain_graph, backward() and hooks ------------------------------------------------------------

def test_retain_graph_grads_twice_then_backward_twice_accumulates():
    ref, split = _models(15)
    x = _x(16)
    results = {}
    for name, m in (("ref", ref), ("split", split)):
        loss = _loss(m, x)
        params = list(m.parameters())
        first = torch.autograd.grad(loss, params, retain_graph=True)
        second = torch.autograd.grad(loss, params, retain_graph=True)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
        _no_grads(m)
        loss.backward(retain_graph=True)
        once = [p.grad.clone() for p in params]
        loss.backward()
        results[name] = (first, once, [p.grad.clone() for p in params])
    for i, (n, _) in enumerate(split.named_parameters()):
        for k in range(3):
            _close(results["split"][k][i], results["ref"][k][i], what=f"{n} ({k})")
        _close(results["split"][2][i], 2 * results["split"][1][i], what=f"{n} twice")


def test_backward_fills_grad_and_runs_tensor_and_accumulate_hooks():
    ref, split = _models(17)
    x = _x(18)
    seen = {}
    for name, m in (("ref", ref), ("split", split)):
        w = m[0].weight
        seen[name] = []
        w.register_hook(lambda g: g * 2)  # a hook may change the gradient (nn.Linear: it does)
        w.register_post_accumulate_grad_hook(lambda p, name=name: seen[name].append(p.grad.clone()))
        _loss(m, x).backward()
        _loss(m, x).backward()
    assert len(seen["split"]) == len(seen["ref"]) == 2
    for a, b in zip(seen["split"], seen["ref"]):
        _close(a, b, what="post-accumulate hook")
    for (n, p), (_, q) in zip(split.named_parameters(), ref.named_parameters()):
        _close(p.grad, q.grad, what=n)
    assert default_store().live_entries() == 0


def test_half_precision_parameters_under_autograd_grad_and_backward():
    # bf16 on CPU: the split W sums in fp32 and rounds once; nn.Linear's bf16 GEMM rounds its own way.
    ref, split = _models(19, torch.bfloat16)
    x = _x(20, dtype=torch.bfloat16)
    params_r, params_s = list(ref.parameters()), list(split.parameters())
    want = torch.autograd.grad(_loss(ref, x).float(), params_r)
    got = torch.autograd.grad(_loss(split, x).float(), params_s)
    for i, (g, w) in enumerate(zip(got, want)):
        _close(g, w, bound=2e-2, what=f"param {i}")
        assert g.dtype == torch.bfloat16
    _no_grads(ref, split)
    _loss(ref, x).float().backward()
    _loss(split, x).float().backward()
    for p, q in zip(params_s, params_r):
        assert p.grad.dtype == torch.bfloat16
        _close(p.grad, q.grad, bound=2e-2)


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_non_leaf_weights_get_their_gradient_through_autograd(which):
    """A split layer called with tensors computed from the parameters (torch.func.functional_call,
    weight norm, ...): the gradient flows back through them, as with nn.Linear."""
    ref, split = _models(21)
    x = _x(22)
    scale = {}
    for name, m in (("ref", ref), ("split", split)):
        s = torch.tensor(1.5, requires_grad=True)
        scale[name] = s
        params = dict(m.named_parameters())
        params[f"0.{which}"] = params[f"0.{which}"] * s
        torch.func.functional_call(m, params, (x,)).square().mean().backward()
    _close(scale["split"].grad, scale["ref"].grad, what="scale")
    for (n, p), (_, q) in zip(split.named_parameters(), ref.named_parameters()):
        _close(p.grad, q.grad, what=n)


# ---- what stays: main_grad (Megatron) and a pipeline's W --------------------------------------------

def test_main_grad_parameters_keep_megatrons_fused_accumulation():
    """Documented, not changed: a parameter with main_grad gets its gradient there (as Megatron's
    layers with gradient-accumulation fusion), and autograd gets None for it."""
    torch.manual_seed(23)
    lin = torch.nn.Linear(8, 5)
    ref = copy.deepcopy(lin)
    zbpp.split_linear(lin)
    lin.weight.main_grad = torch.zeros(5, 8)
    x = torch.randn(6, 8, requires_grad=True)
    gw, gb, gx = torch.autograd.grad(lin(x).sum(), [lin.weight, lin.bias, x], allow_unused=True)
    rw, rb, rx = torch.autograd.grad(ref(x).sum(), [ref.weight, ref.bias, x])
    assert gw is None and lin.weight.grad is None
    _close(lin.weight.main_grad, rw, what="main_grad")
    _close(gb, rb, what="bias")
    _close(gx, rx, what="x")



def test_plain_backward_and_a_pipelines_w_give_the_same_bits():
    """A regression guard for the above (it passed before too): the gradient a plain backward
    returns, added to .grad by autograd, equals what a pipeline's W adds to .grad, bias included
    (whose host sum is formed apart in both), over backwards that accumulate."""
    from zbpp.split import capture

    torch.manual_seed(26)
    now = zbpp.split_linear(torch.nn.Linear(32, 24))
    later = copy.deepcopy(now)
    st = default_store()
    for mb in range(3):
        x, g = torch.randn(2, 40, 32), torch.randn(2, 40, 24)
        now(x).backward(g)
        with capture(stage=0, mb=mb):
            later(x).backward(g)
        assert st.store.pop_run(0) == mb
    for (n, p), (_, q) in zip(now.named_parameters(), later.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert st.live_entries() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, REL_FP32), (torch.bfloat16, 2e-2)])
def test_autograd_grad_on_cuda(dtype, bound):
    dev = torch.device("cuda", torch.cuda.current_device())
    ref, split = _models(27, dtype)
    ref, split = ref.to(dev), split.to(dev)
    x = _x(28, dtype=dtype).to(dev)
    for m in (ref, split):
        m.xi = x.clone().requires_grad_()
    want = torch.autograd.grad(_loss(ref, ref.xi).float(), [*ref.parameters(), ref.xi])
    got = torch.autograd.grad(_loss(split, split.xi).float(), [*split.parameters(), split.xi])
    for i, (g, w) in enumerate(zip(got, want)):
        _close(g, w, bound=bound, what=f"{dtype} [{i}]")
    _no_grads(ref, split)
    for m in (ref, split):
        _loss(m, x).float().backward()
    for (n, p), (_, q) in zip(split.named_parameters(), ref.named_parameters()):
        _close(p.grad, q.grad, bound=bound, what=n)
    assert default_store(dev).live_entries() == 0
