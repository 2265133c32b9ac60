"""split_linear: the same forward, the same full-backward gradients, W deferred into the C store.

With the W store's "torch" kernel (libzbpp_torch.so's zbpp::linear_wgrad, the default wherever it
is built) W runs the ops torch's autograd runs for nn.Linear, so every gradient must equal plain
nn.Linear's bit for bit (torch.equal): fp32, bf16, fp16 and autocast, 2-d and 3-d inputs of any
layout, accumulation over backwards and microbatches, main_grad. With the C library's GEMM (the
"cblas" kernel, the C-only path) the weight gradient sums in another order, so it is compared
within a stated bound, and with a float64 computation of the same model, which both must approach.
Forward outputs and input gradients are torch's ops in both, so they are equal bit for bit.
"""

import contextlib
import copy
import os

import pytest

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
from zbpp import _ops  # noqa: E402
from zbpp.split import SplitLinear, capture, default_store  # noqa: E402

# fp32 relative bound for a weight gradient summed over a few hundred products in another order:
# a few units of float32 epsilon (1.2e-7) times the sum length's square root.
REL_FP32 = 1e-5

KERNELS = ["torch", "cblas"]


@contextlib.contextmanager
def _kernel(name):
    """The CPU store's W kernel set to `name` for the block (skipped where it is not built)."""
    if name == "torch" and _ops.stable() is None:
        if os.environ.get("ZBPP_REQUIRE_TORCH_OPS"):
            pytest.fail(f"ZBPP_REQUIRE_TORCH_OPS is set but the torch kernel is missing: {_ops.stable_unavailable()}")
        pytest.skip(_ops.stable_unavailable())
    st = default_store()
    old = st.kernel
    st.kernel = name
    try:
        yield st
    finally:
        st.kernel = old


def _same(a, b, what):
    """Bit for bit (torch.equal), or where the values first differ and by how much."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not torch.equal(a, b):
        d = (a.double() - b.double()).abs()
        pytest.fail(f"{what}: not nn.Linear's bits: {int((d > 0).sum())} of {d.numel()} elements differ, max "
                    f"{d.max().item():.3g} ({_rel(a.double(), b.double()):.3g} relative)")


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


def test_the_default_w_kernel_is_torchs_own_and_says_so():
    """Where libzbpp_torch.so is built the W store runs torch's ops (kernel "torch"); the C
    library's GEMM is there on request, and a name it does not know is refused, listing the names."""
    st = default_store()
    assert st.kernel == ("torch" if _ops.stable() is not None else "cblas")
    with _kernel("cblas"):
        assert st.kernel == "cblas"
    with _kernel("library"):
        assert st.kernel == "cblas"
    with pytest.raises(ValueError, match="'torch', 'library' or 'cblas'; got 'cublaslt'"):
        st.kernel = "cublaslt"


@pytest.mark.parametrize("value, says", [("library", "cblas"), ("blas", "$ZBPP_WGRAD_KERNEL: zbpp: the W kernel of cpu is "
                                                                     "'torch', 'library' or 'cblas'; got 'blas'")])
def test_the_environment_chooses_the_kernel_of_new_stores(value, says):
    import subprocess
    import sys

    code = ("import zbpp.split as s\ntry:\n    print(s.default_store().kernel)\n"
            "except ValueError as e:\n    print(e)")
    env = dict(os.environ, ZBPP_WGRAD_KERNEL=value,
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(zbpp.__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == says, out.stdout + out.stderr


def test_a_7x5x3_linear_gets_nn_linears_gradients_bit_for_bit():
    """The issue's smallest case: Linear(5, 3) on a [7, 5] input differed from nn.Linear by 4.8e-7
    (relative) with the library's GEMM."""
    with _kernel("torch"):
        torch.manual_seed(0)
        ref = torch.nn.Linear(5, 3)
        lin = zbpp.split_linear(copy.deepcopy(ref))
        x = torch.randn(7, 5)
        for _ in range(2):  # the first gradient written, the second added
            g = torch.randn(7, 3)
            ref(x).backward(g)
            lin(x).backward(g)
        _same(lin.weight.grad, ref.weight.grad, "weight")
        _same(lin.bias.grad, ref.bias.grad, "bias")


@pytest.mark.parametrize("kernel", KERNELS)
def test_forward_and_gradients_match_nn_linear(kernel):
    with _kernel(kernel):
        _forward_and_gradients(kernel)


def _forward_and_gradients(kernel):
    ref, split = _pair()
    idx = torch.randint(0, 20, (5, 7))
    y_ref, y = ref(idx), split(idx)
    assert torch.equal(y, y_ref), "forward must be bit for bit nn.Linear's"
    g = torch.randn_like(y)
    y_ref.backward(g)
    y.backward(g)
    if kernel == "torch":
        for (n, a), (_, b) in zip(split.named_parameters(), ref.named_parameters()):
            _same(a.grad, b.grad, n)
        assert default_store().live_entries() == 0
        return
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


@pytest.mark.parametrize("kernel", KERNELS)
def test_gradients_accumulate_over_backwards(kernel):
    with _kernel(kernel):
        ref, split = _pair(1)
        idx = torch.randint(0, 20, (4, 3))
        for _ in range(3):
            ref(idx).sum().backward()
            split(idx).sum().backward()
    if kernel == "torch":
        for (n, a), (_, b) in zip(split.named_parameters(), ref.named_parameters()):
            _same(a.grad, b.grad, n)
        return
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


def test_main_grad_gets_what_a_ddp_hook_would_add():
    """With the torch kernel main_grad += g as Megatron's DDP hook adds .grad to it (any
    floating-point main_grad: the hook's add_), over several backwards; .grad stays None."""
    with _kernel("torch"):
        torch.manual_seed(4)
        lin = torch.nn.Linear(8, 5)
        ref = copy.deepcopy(lin)
        zbpp.split_linear(lin)
        for dtype in (torch.float32, torch.bfloat16):
            lin.weight.main_grad = torch.zeros(5, 8, dtype=dtype)
            lin.bias.main_grad = torch.zeros(5, dtype=dtype)
            want_w, want_b = torch.zeros(5, 8, dtype=dtype), torch.zeros(5, dtype=dtype)
            for _ in range(3):
                x = torch.randn(6, 8)
                lin(x).square().sum().backward()
                ref(x).square().sum().backward()
                want_w.add_(ref.weight.grad)  # Megatron's hook: main_grad.add_(param.grad), then grad = None
                want_b.add_(ref.bias.grad)
                ref.weight.grad = ref.bias.grad = None
            assert lin.weight.grad is None and lin.bias.grad is None
            _same(lin.weight.main_grad, want_w, f"weight main_grad ({dtype})")
            _same(lin.bias.main_grad, want_b, f"bias main_grad ({dtype})")
        assert default_store().live_entries() == 0


def test_main_grad_receives_the_weight_gradient():
    with _kernel("cblas"):
        _main_grad_cblas()


def _main_grad_cblas():
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_half_and_double_parameters_get_nn_linears_gradients(dtype):
    """Parameters of another dtype: W's product in their dtype, accumulated in it, as nn.Linear's."""
    with _kernel("torch"):
        torch.manual_seed(5)
        ref = torch.nn.Linear(128, 32).to(dtype)
        lin = zbpp.split_linear(copy.deepcopy(ref))
        for _ in range(2):
            x = torch.randn(2, 2000, 128).to(dtype)  # long sums: the BLAS's blocking shows
            lin(x).float().square().sum().backward()
            ref(x).float().square().sum().backward()
    assert lin.weight.grad.dtype == dtype
    _same(lin.weight.grad, ref.weight.grad, "weight")
    _same(lin.bias.grad, ref.bias.grad, "bias")


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 2e-2)])
def test_half_precision_parameters_get_gradients_in_their_dtype(dtype, bound):
    # bf16 (torch 1.13 has no fp16 GEMM on CPU): the W product is formed in fp32 and rounded once
    # to bf16 (8 mantissa bits, relative error up to 2^-8), as autograd's own bf16 result is.
    with _kernel("cblas"):
        _half_cblas(dtype, bound)


def _half_cblas(dtype, bound):
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


LAYOUTS = [
    lambda: torch.randn(1, 8).expand(4096, 8),                  # a broadcast row: stride 0
    lambda: torch.randn(8, 300).t(),                             # transposed: row stride 1
    lambda: torch.randn(64, 16)[:, ::2],                         # every other column
    lambda: torch.randn(2, 64, 8).transpose(0, 1),               # batch-major view of a 3-d input
    lambda: torch.randn(3, 700, 8),                              # 2100 rows: past a BLAS K block
    lambda: torch.randn(8),                                      # one sample, no batch dimension
]
LAYOUT_IDS = ["expanded", "transposed", "strided-columns", "transposed-3d", "3d-many-rows", "1d"]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("make", LAYOUTS, ids=LAYOUT_IDS)
def test_any_input_layout_gives_nn_linears_gradients_bit_for_bit(make, bias):
    """Input, weight and bias gradients equal nn.Linear's for every layout torch's linear treats its
    own way (addmm over rows, matmul plus an in-place bias, column-major inputs), over two
    backwards, the second with an output gradient that is not contiguous."""
    with _kernel("torch"):
        torch.manual_seed(0)
        ref = torch.nn.Linear(8, 5, bias=bias)
        lin = zbpp.split_linear(copy.deepcopy(ref))
        x = make()
        xl, xr = x.detach().requires_grad_(), x.detach().requires_grad_()  # x's own layout, both
        lin(xl).square().sum().backward()
        ref(xr).square().sum().backward()
        out_l, out_r = lin(xl), ref(xr)
        if x.dim() > 1:  # a transpose after the layer hands back a transposed gradient
            out_l, out_r = out_l.transpose(-1, -2), out_r.transpose(-1, -2)
        c = torch.randn(out_r.shape)
        (out_l * c).sum().backward()
        (out_r * c).sum().backward()
    _same(xl.grad, xr.grad, "input gradient")
    _same(lin.weight.grad, ref.weight.grad, "weight")
    if bias:
        _same(lin.bias.grad, ref.bias.grad, "bias")


@pytest.mark.parametrize("make", LAYOUTS[:4], ids=LAYOUT_IDS[:4])
def test_any_input_strides_give_nn_linears_gradients(make):
    with _kernel("cblas"):
        _strides_cblas(make)


def _strides_cblas(make):
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


@pytest.mark.parametrize("kernel", KERNELS)
def test_autocast_bf16_on_cpu_matches_nn_linear(kernel):
    with _kernel(kernel):
        _autocast(kernel)


def _autocast(kernel):
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
        if kernel == "torch":  # dW in bf16, converted to the fp32 gradient: nn.Linear's ops
            _same(p.grad, q.grad, f"parameter {tuple(p.shape)}")
        else:  # nn.Linear rounds dW to bf16 before it reaches the fp32 gradient; the GEMM sums in fp32.
            assert _max_rel(p.grad, q.grad) < 1e-2, p.shape


def test_frozen_weight_trainable_bias_gets_nn_linears_bias_gradient():
    with _kernel("torch"):
        lin = torch.nn.Linear(8, 4)
        lin.weight.requires_grad_(False)
        ref = copy.deepcopy(lin)
        zbpp.split_linear(lin)
        for _ in range(2):
            x = torch.randn(3, 10, 8)
            lin(x).square().sum().backward()
            ref(x).square().sum().backward()
    assert lin.weight.grad is None
    _same(lin.bias.grad, ref.bias.grad, "bias")


def test_frozen_weight_trainable_bias_runs_no_gemm(monkeypatch):
    with _kernel("cblas"):
        _frozen_cblas(monkeypatch)


def _frozen_cblas(monkeypatch):
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


def test_a_pipelines_deferred_w_gives_the_loops_nn_linear_bits():
    """A zbpp schedule that runs every microbatch's I before any W (W deferred the longest), on a
    stage of split layers with 3-d inputs of 600 rows per microbatch: the gradients equal a plain
    loop's over nn.Linear bit for bit (the schedule's scale_grads divides by m = 4, exactly)."""
    from zbpp.pipelining import PipelineStage
    from zbpp.pipelining.schedules import PipelineScheduleMulti, _Action

    with _kernel("torch") as st:
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16, bias=False),
                                  torch.nn.Tanh(), torch.nn.Linear(16, 4))
        mod = zbpp.split_linear(copy.deepcopy(ref))
        x, y = torch.randn(12, 200, 16), torch.randn(12, 200, 4)
        for xi, yi in zip(x.chunk(4), y.chunk(4)):
            torch.nn.functional.mse_loss(ref(xi), yi).backward()
        order = [f"0F{i}" for i in range(4)] + [f"0I{i}" for i in range(4)] + [f"0W{i}" for i in range(4)]

        class IThenW(PipelineScheduleMulti):
            def __init__(self, stages, m, loss_fn):
                super().__init__(stages, m, loss_fn=loss_fn)
                self.pipeline_order = {0: [_Action.from_str(c) for c in order]}

        before = st.gemms_run
        sched = IThenW([PipelineStage(mod, 0, 1, "cpu", split_backward=False)], 4,
                       loss_fn=torch.nn.functional.mse_loss)
        sched.step(x, target=y)
        assert st.gemms_run - before == 3 * 4  # every layer's W, per microbatch, from the store
    for (n, a), b in zip(mod.named_parameters(), ref.parameters()):
        _same(a.grad, b.grad / 4, n)


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
    # split_backward=False: only the layers split here defer their W (the automatic split would run
    # this first stage's whole backward at W, as torch does for a stage whose input needs no grad).
    sched = IThenW([PipelineStage(torch.compile(mod, fullgraph=True), 0, 1, "cpu", split_backward=False)], 2,
                   loss_fn=torch.nn.functional.mse_loss)
    sched.step(x, target=y)
    assert st.gemms_run - before == 4  # 2 layers x 2 microbatches, each at its W op
    for a, b in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad / 2)
