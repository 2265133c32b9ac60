"""split_linear: the same forward, the same full-backward gradients, W deferred into the C store.

Gradients are compared with plain nn.Linear (torch's own GEMMs) within a stated bound, because the
W GEMM is the C library's CBLAS call, which sums in another order; and with a float64 computation
of the same model, which both must approach. Forward outputs and input gradients are computed by
the same torch ops in both, so they must be equal bit for bit.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
from zbpp.split import SplitLinear, capture, default_store  # noqa: E402

# fp32 relative bound for a weight gradient summed over a few hundred products in another order:
# a few units of float32 epsilon (1.2e-7) times the sum length's square root.
REL_FP32 = 1e-5


class Mixed(torch.nn.Module):
    """Linear layers mixed with other parametrised layers (embedding, layer norm, conv)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 12)
        self.fc1 = torch.nn.Linear(12, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.conv = torch.nn.Conv1d(24, 24, 3, padding=1)
        self.fc2 = torch.nn.Linear(24, 6, bias=False)

    def forward(self, idx):
        h = torch.nn.functional.gelu(self.fc1(self.emb(idx)))
        h = self.norm(h)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.fc2(h)


def _pair(seed=0):
    torch.manual_seed(seed)
    ref = Mixed()
    split = zbpp.split_linear(copy.deepcopy(ref))
    return ref, split


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_split_linear_swaps_in_place_and_keeps_parameters():
    ref, split = _pair()
    keys = list(ref.state_dict())
    out = zbpp.split_linear(split)
    assert out is split
    assert isinstance(split.fc1, SplitLinear) and isinstance(split.fc1, torch.nn.Linear)
    assert list(split.state_dict()) == keys
    for (n, a), (_, b) in zip(ref.named_parameters(), split.named_parameters()):
        assert torch.equal(a, b), n
    frozen = torch.nn.Linear(3, 3)
    frozen.weight.requires_grad_(False)
    zbpp.split_linear(frozen)
    assert not frozen.weight.requires_grad and frozen.bias.requires_grad
    with pytest.raises(TypeError, match="torch.nn.Module"):
        zbpp.split_linear(object())


def test_forward_and_gradients_match_nn_linear():
    ref, split = _pair()
    idx = torch.randint(0, 20, (5, 7))
    y_ref, y = ref(idx), split(idx)
    assert torch.equal(y, y_ref), "forward must be bit for bit nn.Linear's"
    g = torch.randn_like(y)
    y_ref.backward(g)
    y.backward(g)
    # float64 reference of the same model
    ref64 = copy.deepcopy(ref).double()
    for p in ref64.parameters():
        p.grad = None
    ref64(idx).backward(g.double())
    for (n, a), (_, b), (_, c) in zip(split.named_parameters(), ref.named_parameters(), ref64.named_parameters()):
        assert a.grad is not None, n
        assert _rel(a.grad, b.grad) < REL_FP32, f"{n}: {_rel(a.grad, b.grad):.3g} vs nn.Linear"
        assert _rel(a.grad.double(), c.grad) < REL_FP32, f"{n}: {_rel(a.grad.double(), c.grad):.3g} vs float64"
    assert default_store().live_entries() == 0


def test_gradients_accumulate_over_backwards():
    ref, split = _pair(1)
    idx = torch.randint(0, 20, (4, 3))
    for _ in range(3):
        ref(idx).sum().backward()
        split(idx).sum().backward()
    assert _rel(split.fc1.weight.grad, ref.fc1.weight.grad) < REL_FP32
    assert _rel(split.fc2.weight.grad, ref.fc2.weight.grad) < REL_FP32


def test_capture_defers_w_until_the_store_runs_it():
    _, split = _pair(2)
    idx = torch.randint(0, 20, (4, 3))
    store = default_store()
    with capture(stage=0, mb=0):
        split(idx).sum().backward()
    # B has run: the input-side layers have their gradients, the Linear weights not yet.
    assert split.norm.weight.grad is not None and split.emb.weight.grad is not None
    assert split.fc2.weight.grad is None or not split.fc2.weight.grad.any()
    assert store.store.pending(0) == 1 and store.live_entries() == 2
    assert store.store.pop_run(0) == 0
    assert store.store.pending(-1) == 0 and store.live_entries() == 0, "the store is empty after W"
    assert split.fc2.weight.grad.abs().sum() > 0


def test_clear_drops_entries_and_releases_tensors():
    _, split = _pair(3)
    store = default_store()
    with capture(stage=1, mb=0):
        split(torch.randint(0, 20, (2, 3))).sum().backward()
    assert store.live_entries() == 2
    store.store.clear()
    assert store.live_entries() == 0 and store.store.pending(-1) == 0


def test_main_grad_receives_the_weight_gradient():
    torch.manual_seed(4)
    lin = torch.nn.Linear(8, 5)
    ref = copy.deepcopy(lin)
    zbpp.split_linear(lin)
    lin.weight.main_grad = torch.zeros(5, 8)
    lin.bias.main_grad = torch.zeros(5)
    x = torch.randn(6, 8)
    lin(x).sum().backward()
    ref(x).sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is None, "Megatron-style: gradients go to main_grad"
    assert _rel(lin.weight.main_grad, ref.weight.grad) < REL_FP32
    assert _rel(lin.bias.main_grad, ref.bias.grad) < REL_FP32
    lin.weight.main_grad = torch.zeros(5, 8, dtype=torch.float16)
    with pytest.raises(TypeError, match="main_grad must be a contiguous float32"):
        lin(x).sum().backward()
    # The failed backward left nothing behind: the next one gets its own gradient.
    lin.weight.main_grad = torch.zeros(5, 8)
    lin(x).sum().backward()
    assert _rel(lin.weight.main_grad, ref.weight.grad) < REL_FP32
    assert default_store().live_entries() == 0


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 2e-2)])
def test_half_precision_parameters_get_gradients_in_their_dtype(dtype, bound):
    # bf16 (torch 1.13 has no fp16 GEMM on CPU): the W product is formed in fp32 and rounded once
    # to bf16 (8 mantissa bits, relative error up to 2^-8), as autograd's own bf16 result is.
    torch.manual_seed(5)
    lin = torch.nn.Linear(16, 8).to(dtype)
    ref32 = copy.deepcopy(lin).float()
    zbpp.split_linear(lin)
    x = torch.randn(10, 16).to(dtype)
    lin(x).float().sum().backward()
    ref32(x.float()).sum().backward()
    assert lin.weight.grad.dtype == dtype
    assert _rel(lin.weight.grad.float(), ref32.weight.grad) < bound
    assert _rel(lin.bias.grad.float(), ref32.bias.grad) < bound


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(1, 8).expand(4096, 8),                  # a broadcast row: stride 0
    lambda: torch.randn(8, 300).t(),                             # transposed: row stride 1
    lambda: torch.randn(64, 16)[:, ::2],                         # every other column
    lambda: torch.randn(2, 64, 8).transpose(0, 1),               # batch-major view of a 3-d input
], ids=["expanded", "transposed", "strided-columns", "transposed-3d"])
def test_any_input_strides_give_nn_linears_gradients(make):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 5)
    ref = copy.deepcopy(lin)
    zbpp.split_linear(lin)
    x = make()
    lin(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert torch.isfinite(lin.weight.grad).all()
    assert _max_rel(lin.weight.grad, ref.weight.grad) < 1e-4
    assert _max_rel(lin.bias.grad, ref.bias.grad) < 1e-4
    # And a non-contiguous output gradient (a transpose after the layer hands back a transposed one).
    lin.weight.grad = ref.weight.grad = None
    c = torch.randn(ref(x).transpose(-1, -2).shape)
    (lin(x).transpose(-1, -2) * c).sum().backward()
    (ref(x).transpose(-1, -2) * c).sum().backward()
    assert _max_rel(lin.weight.grad, ref.weight.grad) < 1e-4


def test_autocast_bf16_on_cpu_matches_nn_linear():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    ref = copy.deepcopy(net)
    zbpp.split_linear(net)
    x = torch.randn(64, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = net(x), ref(xr)
    assert y.dtype == yr.dtype == torch.bfloat16
    assert torch.equal(y, yr)  # the same bf16 ops in the forward
    y.float().square().sum().backward()
    yr.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, xr.grad)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert p.grad.dtype == q.grad.dtype == torch.float32
        # nn.Linear rounds dW to bf16 before it reaches the fp32 gradient; zbpp sums in fp32.
        assert _max_rel(p.grad, q.grad) < 1e-2, p.shape


def test_frozen_weight_trainable_bias_runs_no_gemm(monkeypatch):
    lin = torch.nn.Linear(8, 4)
    lin.weight.requires_grad_(False)
    ref = copy.deepcopy(lin)
    zbpp.split_linear(lin)
    rows = []
    real_push = zbpp.runtime.WStore.push

    def spy(self, dtype, n_rows, *args, **kwargs):
        rows.append(n_rows)
        return real_push(self, dtype, n_rows, *args, **kwargs)

    monkeypatch.setattr(zbpp.runtime.WStore, "push", spy)
    x = torch.randn(10, 8)
    lin(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert rows == [0]  # one entry, and it is no GEMM: only the bias's sums, as Python W work
    assert lin.weight.grad is None
    assert _max_rel(lin.bias.grad, ref.bias.grad) < 1e-6


def test_a_failing_w_action_fails_the_w_with_its_exception():
    st = default_store()
    st.store.begin(0, 7)

    def boom():
        raise RuntimeError("the gradient could not be added")

    st.push_action(boom)
    st.store.end()
    with pytest.raises(RuntimeError, match="could not be added") as info:
        st.store.pop_run(0)
    assert isinstance(info.value.__cause__, zbpp.ZbError)
    assert "release callback" in info.value.__cause__.message
    assert st.live_entries() == 0 and st.store.pending() == 0


def test_closing_a_busy_backend_keeps_it_until_it_can_go():
    backend = zbpp.runtime.Backend("host")
    store = zbpp.runtime.WStore(backend, lambda token, ran: None)
    with pytest.raises(zbpp.ZbError) as info:
        backend.close()
    assert info.value.code == zbpp.runtime.ZB_ERR_BUSY
    assert backend._h  # not dropped: closing again once the store is gone frees it
    store.close()
    backend.close()
    assert not backend._h


# ---- torch.compile --------------------------------------------------------------------------------

def _two_layers():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mod = copy.deepcopy(ref)
    zbpp.split_linear(mod)
    return ref, mod


def test_torch_compile_traces_split_layers_whole_and_their_w_runs():
    """The W push is the custom op zbpp::defer_wgrad (zbpp/_ops.py): one graph, no break at a split
    layer, and the op is not dropped as dead code: every split layer's W GEMM runs and the
    gradients are nn.Linear's."""
    if zbpp._ops.op() is None:
        pytest.skip("this torch cannot register zbpp's custom op (needs torch.library.custom_op)")
    ref, mod = _two_layers()
    x = torch.randn(8, 16)
    explained = torch._dynamo.explain(mod)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    st = default_store()
    before = st.gemms_run
    torch.compile(mod, fullgraph=True)(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert st.gemms_run - before == 2  # both layers' W through the store, not dropped
    for a, b in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_torch_export_of_a_split_model_gives_linear_outputs_and_gradients():
    """torch.export takes a split model (its layers export as aten.linear: an exported program has
    no pipeline to defer W to), forward and joint forward-backward graph alike, and the exported
    module's gradients are nn.Linear's."""
    ref, mod = _two_layers()
    x = torch.randn(8, 16)
    ep = torch.export.export(mod, (x,))
    assert "aten.linear.default" in [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    exported = ep.module()
    out = exported(x)
    torch.testing.assert_close(out, ref(x))
    out.square().sum().backward()
    ref(x).square().sum().backward()
    got = dict(exported.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad)
    try:
        from torch.export.experimental import _export_forward_backward
    except ImportError:
        return
    loss_ep = torch.export.export(torch.nn.Sequential(mod, _SquareSum()), (x,))
    joint = _export_forward_backward(loss_ep)
    assert joint.graph_signature.backward_signature is not None


class _SquareSum(torch.nn.Module):
    def forward(self, y):
        return y.square().sum()


def test_compiled_split_layers_defer_w_inside_a_pipeline():
    """In a pipeline the compiled backward's W goes into the store at B and runs at the W op (an
    order with I before W), and the step's gradients are the loop's."""
    if zbpp._ops.op() is None:
        pytest.skip("this torch cannot register zbpp's custom op (needs torch.library.custom_op)")
    from zbpp.pipelining import PipelineStage
    from zbpp.pipelining.schedules import PipelineScheduleMulti, _Action

    ref, mod = _two_layers()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for xi, yi in zip(x.chunk(2), y.chunk(2)):
        torch.nn.functional.mse_loss(ref(xi), yi).backward()

    class IThenW(PipelineScheduleMulti):
        def __init__(self, stages, m, loss_fn):
            super().__init__(stages, m, loss_fn=loss_fn)
            self.pipeline_order = {0: [_Action.from_str(c) for c in "0F0 0F1 0I0 0I1 0W0 0W1".split()]}

    st = default_store()
    before = st.gemms_run
    sched = IThenW([PipelineStage(torch.compile(mod, fullgraph=True), 0, 1, "cpu")], 2,
                   loss_fn=torch.nn.functional.mse_loss)
    sched.step(x, target=y)
    assert st.gemms_run - before == 4  # 2 layers x 2 microbatches, each at its W op
    for a, b in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad / 2)
