"""zbpp's split Megatron linear layers outside a pipeline under torch.autograd (issue 24, item 7).

A split ColumnParallelLinear / RowParallelLinear whose weight has no main_grad returns its weight
gradient to autograd outside a pipeline, as Megatron's own layer without gradient-accumulation
fusion does: torch.autograd.grad returns it and .grad stays untouched, and create_graph=True gives
a gradient that can be differentiated again. Each split layer is compared with an unsplit twin
(the fixtures and builders of test_megatron_layers.py). Weights with main_grad keep Megatron's
fused accumulation (test_megatron_layers.py checks that).
"""

import pytest

torch = pytest.importorskip("torch")

from test_megatron_layers import REL_FP32, _inputs, _layer, _rel, _split, mcore  # noqa: E402,F401

from zbpp.split import default_store  # noqa: E402


def _forward(layer, x):
    out, out_bias = layer(x)
    return out + out_bias if out_bias is not None else out


@pytest.mark.parametrize("kind", ["column", "row", "column-skip-bias-add"])
def test_autograd_grad_returns_the_weight_gradient_and_leaves_grad_alone(mcore, kind):
    ref, layer = _layer(mcore, kind), _split(_layer(mcore, kind))
    x, dy = _inputs(kind)
    got, want = [], []
    for m, out in ((ref, want), (layer, got)):
        xi = x.clone().requires_grad_()
        params = [p for p in m.parameters()]
        out.extend(torch.autograd.grad((_forward(m, xi) * dy).sum(), params + [xi]))
        assert all(p.grad is None for p in m.parameters()), "autograd.grad wrote .grad"
    for a, b in zip(got, want):
        assert a is not None and a.dtype == b.dtype and _rel(a, b) < REL_FP32
    assert default_store().live_entries() == 0


def test_gradient_penalty_through_a_split_megatron_layer(mcore):
    ref, layer = _layer(mcore, "column"), _split(_layer(mcore, "column"))
    x, dy = _inputs("column")
    for m in (ref, layer):
        xi = x.clone().requires_grad_()
        loss = (torch.tanh(_forward(m, xi)) * dy).sum()
        (gx,) = torch.autograd.grad(loss, xi, create_graph=True)
        assert all(p.grad is None for p in m.parameters())
        (loss + gx.square().sum()).backward()
    for (n, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and _rel(p.grad, q.grad) < REL_FP32, n
