"""The stable-ABI ops of libzbpp_torch.so (csrc/torch/): zbpp::wgrad, zbpp::wgrad_deferred and
zbpp::linear_wgrad.

What a user relies on: the W they compute is nn.Linear's weight gradient for any input layout and
dtype (zbpp::linear_wgrad: bit for bit autograd's, accumulation included); bad arguments get a
message saying what was wrong; torch.compile and torch.export record the ops as graph nodes (no
break); inside a pipeline's backward (or capture()) the deferred op's W waits in the store for its
W op, and outside one it runs at once.
"""

import os

import pytest

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
from zbpp import _ops  # noqa: E402
from zbpp.split import capture, default_store  # noqa: E402


@pytest.fixture(scope="module")
def ops():
    found = _ops.stable()
    if found is None:
        why = _ops.stable_unavailable()
        if os.environ.get("ZBPP_REQUIRE_TORCH_OPS"):
            pytest.fail(f"ZBPP_REQUIRE_TORCH_OPS is set but the stable-ABI ops are not available: {why}")
        pytest.skip(why)
    return found


def _ref(x, dy):
    """float64 dy^T x and the column sums of dy, over all leading dimensions."""
    x2 = x.reshape(-1, x.shape[-1]).double()
    dy2 = dy.reshape(-1, dy.shape[-1]).double()
    return dy2.t() @ x2, dy2.sum(0)


@pytest.mark.parametrize("layout", ["dense", "3d", "expanded", "transposed", "row_slice"])
def test_wgrad_is_the_linear_weight_gradient_for_any_layout(ops, layout):
    torch.manual_seed(0)
    if layout == "dense":
        x, dy = torch.randn(32, 16), torch.randn(32, 8)
    elif layout == "3d":
        x, dy = torch.randn(4, 8, 16), torch.randn(4, 8, 8)
    elif layout == "expanded":  # stride 0: one row seen 32 times (the x.expand case)
        x, dy = torch.randn(1, 16).expand(32, 16), torch.randn(32, 8)
    elif layout == "transposed":
        x, dy = torch.randn(16, 32).t(), torch.randn(8, 32).t()
    else:  # every other row of a bigger tensor, and columns of a wider one
        x, dy = torch.randn(64, 20)[::2, :16], torch.randn(32, 12)[:, 2:10]
    dw, db = torch.full((8, 16), 0.5), torch.full((8,), -1.0)
    ops.wgrad(x, dy, dw, db)
    rw, rb = _ref(x, dy)
    torch.testing.assert_close(dw.double(), rw + 0.5, rtol=1e-5, atol=1e-5)  # accumulated
    torch.testing.assert_close(db.double(), rb - 1.0, rtol=1e-5, atol=1e-5)
    ops.wgrad(x, dy, dw, db, overwrite=True)
    torch.testing.assert_close(dw.double(), rw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db.double(), rb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgrad_half_inputs_sum_in_fp32(ops, dtype):
    torch.manual_seed(1)
    x, dy = torch.randn(64, 16).to(dtype), torch.randn(64, 8).to(dtype)
    rw, rb = _ref(x, dy)
    dw = torch.zeros(8, 16)  # fp32 accumulation (main_grad)
    ops.wgrad(x, dy, dw)
    torch.testing.assert_close(dw.double(), rw, rtol=1e-5, atol=1e-4)
    half = torch.zeros(8, 16, dtype=dtype)  # the product rounded once into x's dtype
    hb = torch.zeros(8, dtype=dtype)
    ops.wgrad(x, dy, half, hb, overwrite=True)
    assert torch.equal(half, rw.to(dtype))  # fp32 sum rounded to nearest once (exact fp32 here)
    torch.testing.assert_close(hb.double(), rb, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case, words", [
    ("double", "float32, bfloat16 or float16; got float64"),
    ("mixed", "one dtype; got float32 and bfloat16"),
    ("dw_shape", "dw must be a contiguous [out, in] = [8, 16] tensor; got [16, 8]"),
    ("dw_strided", "(not contiguous)"),
    ("dw_dtype", "dw must be float32 (accumulated in fp32) or x's dtype float32; got float64"),
    ("db_shape", "db must be a contiguous [8] tensor"),
    ("rows", "same number of rows"),
])
def test_wgrad_bad_arguments_say_what_is_wrong(ops, case, words):
    x, dy, dw, db = torch.randn(4, 16), torch.randn(4, 8), torch.zeros(8, 16), None
    if case == "double":
        x, dy = x.double(), dy.double()
    elif case == "mixed":
        dy = dy.bfloat16()
    elif case == "dw_shape":
        dw = torch.zeros(16, 8)
    elif case == "dw_strided":
        dw = torch.zeros(16, 8).t()
    elif case == "dw_dtype":
        dw = dw.double()
    elif case == "db_shape":
        db = torch.zeros(4)
    elif case == "rows":
        dy = torch.randn(5, 8)
    before = dw.clone()
    with pytest.raises(RuntimeError, match="zbpp::wgrad: ") as err:
        ops.wgrad(x, dy, dw, db)
    assert words in str(err.value)
    assert torch.equal(dw, before)  # nothing written


def test_export_and_compile_record_the_op_as_a_node(ops):
    class ManualW(torch.nn.Module):
        def forward(self, x, dy, dw):
            ops.wgrad(x, dy, dw)
            return dw * 2

    x, dy = torch.randn(6, 5), torch.randn(6, 4)
    want = 2 * (dy.t() @ x)
    ep = torch.export.export(ManualW(), (x, dy, torch.zeros(4, 5)))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "zbpp.wgrad.default" in targets, targets
    torch.testing.assert_close(ep.module()(x, dy, torch.zeros(4, 5)), want)
    explained = torch._dynamo.explain(ManualW())(x, dy, torch.zeros(4, 5))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch.testing.assert_close(torch.compile(ManualW(), fullgraph=True)(x, dy, torch.zeros(4, 5)), want)


def test_deferred_waits_for_its_group_and_drops_what_it_kept(ops):
    st = default_store()
    x, dy = torch.randn(6, 5), torch.randn(6, 4)
    dw, db = torch.zeros(4, 5), torch.zeros(4)
    live, run = st.live_entries(), st.gemms_run
    with capture(7, 0):
        ops.wgrad_deferred(x, dy, dw, db)
    assert st.live_entries() == live + 1 and not dw.any()  # pushed, not run
    st.store.pop_run(7)
    torch.testing.assert_close(dw.double(), _ref(x, dy)[0], rtol=1e-5, atol=1e-5)
    assert st.gemms_run == run + 1 and st.live_entries() == live
    with capture(7, 1):  # dropped unrun: released with ran = 0, nothing written
        ops.wgrad_deferred(x, dy, torch.zeros(4, 5))
    dropped = st.gemms_dropped
    st.store.clear()
    assert st.gemms_dropped == dropped + 1 and st.live_entries() == live
    ops.wgrad_deferred(x, dy, dw, db, overwrite=True)  # no capture: at once
    torch.testing.assert_close(dw.double(), _ref(x, dy)[0], rtol=1e-5, atol=1e-5)
    dw.zero_()
    with capture(7, 2):  # an eager caller that keeps x and dy as they are may skip the copies
        ops.wgrad_deferred(x, dy, dw, copy_inputs=False)
    st.store.pop_run(7)
    torch.testing.assert_close(dw.double(), _ref(x, dy)[0], rtol=1e-5, atol=1e-5)


class _ManualLinear(torch.autograd.Function):
    """A user's own linear with a split backward: dx now, W through zbpp::wgrad_deferred into a
    gradient buffer of the user's (Megatron's main_grad, say)."""

    @staticmethod
    def forward(ctx, x, weight, main_grad):
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        torch.ops.zbpp.wgrad_deferred(x, dy, ctx.main_grad)
        return dy @ weight, None, None


def test_compiled_deep_model_deferred_w_equals_autograd(ops):
    """Three layers compiled whole, W deferred in a capture and run later: inductor reuses the
    memory of x and dy as soon as the op returns, so the op must read copies (copy_inputs=True, the
    default; with False the last layer's gradient was measured wrong here)."""
    torch.manual_seed(3)
    ws = [torch.randn(32, 32) for _ in range(3)]
    grads = [torch.zeros(32, 32) for _ in range(3)]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ws = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in ws])

        def forward(self, x):
            for w, g in zip(self.ws, grads):
                x = torch.tanh(_ManualLinear.apply(x * 1.5 + 0.1, w, g))
            return x

    x = torch.randn(64, 32)
    ref = [w.clone().requires_grad_() for w in ws]
    h = x
    for w in ref:
        h = torch.tanh((h * 1.5 + 0.1) @ w.t())
    h.square().sum().backward()
    st = default_store()
    compiled = torch.compile(Model(), fullgraph=True)
    for _ in range(2):  # the second step runs the cached graph
        for g in grads:
            g.zero_()
        with capture(0, 0):
            compiled(x).square().sum().backward()
        assert all(not g.any() for g in grads)  # deferred: nothing yet
        st.store.pop_run(0)
        for w, g in zip(ref, grads):
            torch.testing.assert_close(g, w.grad, rtol=1e-4, atol=1e-4)
    assert st.live_entries() == 0


def test_compiled_backward_defers_in_a_pipeline_and_matches_autograd(ops):
    """A compiled model whose backward calls the stable op, run by a zbpp schedule with W ops after
    every I: W lands in the user's buffer at the W ops, equal to autograd's weight gradient."""
    from zbpp.pipelining import PipelineStage
    from zbpp.pipelining.schedules import PipelineScheduleMulti, _Action

    torch.manual_seed(2)
    weight = torch.randn(4, 16, requires_grad=True)
    main_grad = torch.zeros(4, 16)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(weight.detach().clone())

        def forward(self, x):
            return _ManualLinear.apply(x, self.w, main_grad)

    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for xi, yi in zip(x.chunk(2), y.chunk(2)):
        torch.nn.functional.mse_loss(xi @ weight.t(), yi).backward()

    class IThenW(PipelineScheduleMulti):
        def __init__(self, stages, m, loss_fn):
            super().__init__(stages, m, loss_fn=loss_fn)
            self.pipeline_order = {0: [_Action.from_str(c) for c in "0F0 0F1 0I0 0I1 0W0 0W1".split()]}

    st = default_store()
    run = st.gemms_run
    model = Model()
    sched = IThenW([PipelineStage(torch.compile(model, fullgraph=True), 0, 1, "cpu")], 2,
                   loss_fn=torch.nn.functional.mse_loss)
    sched.step(x, target=y)
    assert st.gemms_run - run == 2  # one W per microbatch, each run at its W op
    # The sum over both microbatches: the schedule's scale_grads divides the parameters' .grad by
    # the microbatch count, not a buffer of the user's.
    torch.testing.assert_close(main_grad, weight.grad)
    assert st.live_entries() == 0


# ---- zbpp::linear_wgrad: autograd's own ops ---------------------------------------------------------

def _autograd(x, weight, bias, dys):
    """.grad of weight and bias after one backward of F.linear per output gradient in dys."""
    w = weight.detach().clone().requires_grad_()
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    for dy in dys:
        torch.nn.functional.linear(x, w, b).backward(dy)
    return w.grad, (b.grad if b is not None else None)


# (x shape, x layout, weight layout, bias): what torch's linear does with each, written out in
# _linear_args the way at::linear and its backward formulas read them.
LINEAR_CASES = {
    "2d": ((40, 16), "contiguous", "contiguous", True),
    "2d-column-major-x": ((40, 16), "transposed", "contiguous", True),
    "3d-addmm": ((3, 300, 16), "contiguous", "contiguous", True),
    "3d-matmul-plus-bias": ((3, 300, 16), "transposed", "contiguous", True),
    "3d-no-bias": ((3, 300, 16), "contiguous", "contiguous", False),
    "column-major-weight": ((40, 16), "contiguous", "transposed", True),
}


def _linear_args(x, dy, weight, bias):
    """What autograd's backward of F.linear(x, weight, bias) reads: addmm over x viewed as rows for a
    2-d or contiguous input with a bias (bias gradient: rows summed), else matmul (+ the bias in
    place: summed over every leading dimension); dW = dy2^T x2 unless weight^T is not column-major."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    flat = x.dim() == 2 or (bias is not None and x.is_contiguous())
    kw = dict(dy_t_x=weight.stride(1) == 1 and weight.stride(0) == weight.shape[1])
    if bias is not None and not flat:
        kw.update(bias_of=dy, bias_dims=list(range(dy.dim() - 1)))
    return x2, dy2, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_wgrad_equals_autograd_bit_for_bit(ops, case, dtype):
    shape, x_layout, w_layout, has_bias = LINEAR_CASES[case]
    torch.manual_seed(0)
    x = torch.randn(*shape).to(dtype)
    if x_layout == "transposed":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, column-major / batch-major
    weight = torch.randn(8, 16).to(dtype)
    if w_layout == "transposed":
        weight = weight.t().contiguous().t()
    bias = torch.randn(8).to(dtype) if has_bias else None
    dys = [torch.randn(*shape[:-1], 8).to(dtype) for _ in range(3)]
    want_w, want_b = _autograd(x, weight, bias, dys)
    dw = torch.zeros(8, 16, dtype=dtype)
    db = torch.zeros(8, dtype=dtype) if has_bias else None
    for i, dy in enumerate(dys):  # the first gradient written (autograd's .grad = g), the rest added
        x2, dy2, kw = _linear_args(x, dy, weight, bias)
        assert ops.linear_wgrad(x2, dy2, dw, db, dw_add=i > 0, db_add=i > 0, **kw) == 0  # ran now
    assert torch.equal(dw, want_w), (dw.double() - want_w.double()).abs().max()
    if has_bias:
        assert torch.equal(db, want_b), (db.double() - want_b.double()).abs().max()


def test_linear_wgrad_converts_to_the_targets_dtype_as_autocast_does(ops):
    """Under autocast nn.Linear's dW is a bf16 product that reaches the fp32 .grad converted; a W
    run inside an autocast region still computes what the backward would (its kernels are out=
    overloads, which autocast leaves alone)."""
    torch.manual_seed(1)
    x, weight, bias = torch.randn(64, 16), torch.randn(8, 16, requires_grad=True), torch.randn(8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, weight, bias)
    dy = torch.randn(64, 8, dtype=torch.bfloat16)
    y.backward(dy)
    dw, db = torch.zeros(8, 16), torch.zeros(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # W inside an autocast region
        ops.linear_wgrad(x.bfloat16(), dy, dw, db, dw_add=False, db_add=False)
    assert torch.equal(dw, weight.grad) and torch.equal(db, bias.grad)
    x32, dy32 = torch.randn(64, 16), torch.randn(64, 8)
    ref = (dy32.t() @ x32)
    out = torch.zeros(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 tensors stay fp32: no autocast cast
        ops.linear_wgrad(x32, dy32, out, None, dw_add=False)
    assert torch.equal(out, ref)


def test_linear_wgrad_deferred_runs_at_its_w_and_drops_unrun(ops):
    st = default_store()
    if st.kernel != "torch":
        pytest.skip("the CPU store does not run the torch kernel")
    torch.manual_seed(2)
    x, dy = torch.randn(6, 5), torch.randn(6, 4)
    dw = torch.zeros(4, 5)
    live, run, dropped = st.live_entries(), st.gemms_run, st.gemms_dropped
    with capture(7, 0):
        st.push_linear(x, dy, _param(dw), None)
    assert st.live_entries() == live + 1 and st.gemms_run == run  # pushed, not run
    st.store.pop_run(7)
    assert st.gemms_run == run + 1 and st.live_entries() == live
    with capture(7, 1):
        p = _param(torch.zeros(4, 5))
        st.push_linear(x, dy, p, None)
    st.store.clear()  # dropped unrun: nothing written, the tensors it kept let go
    assert st.gemms_dropped == dropped + 1 and st.live_entries() == live and not p.grad.any()


def _param(like):
    return torch.nn.Parameter(torch.zeros_like(like))


def test_linear_wgrad_failing_at_w_fails_the_w_op_with_torchs_message(ops):
    st = default_store()
    if st.kernel != "torch":
        pytest.skip("the CPU store does not run the torch kernel")
    p = _param(torch.zeros(4, 5))
    x = torch.randn(6, 5)
    with capture(7, 2):
        st.push_linear(x, torch.randn(6, 4), p, None)
    x.resize_(2, 2)  # the input changed under the pending W
    with pytest.raises(RuntimeError, match=r"the weight gradient \(W\) failed in torch: .*") as info:
        st.store.pop_run(7)
    assert isinstance(info.value.__cause__, zbpp.ZbError)
    assert st.live_entries() == 0 and st.store.pending() == 0


@pytest.mark.parametrize("case, words", [
    ("3d", "x and dy must be [rows, in] and [rows, out] as autograd has them; got x [2, 3, 5]"),
    ("rows", "same number of rows; got x [6, 5], dy [7, 4]"),
    ("mixed", "one floating-point dtype; got float32 and bfloat16"),
    ("nothing", "give dw, db or both"),
    ("dw_shape", "dw must be [4, 5]; got [5, 4]"),
    ("db_shape", "db must be [4]; got [5]"),
    ("bias_dims", "bias_dims must be distinct leading dimensions of bias_of [6, 4]"),
])
def test_linear_wgrad_bad_arguments_say_what_is_wrong(ops, case, words):
    x, dy, dw, db, kw = torch.randn(6, 5), torch.randn(6, 4), torch.zeros(4, 5), None, {}
    if case == "3d":
        x = torch.randn(2, 3, 5)
    elif case == "rows":
        dy = torch.randn(7, 4)
    elif case == "mixed":
        dy = dy.bfloat16()
    elif case == "nothing":
        dw = None
    elif case == "dw_shape":
        dw = torch.zeros(5, 4)
    elif case == "db_shape":
        db = torch.zeros(5)
    elif case == "bias_dims":
        db, kw = torch.zeros(4), dict(bias_dims=[1])
    with pytest.raises(RuntimeError, match="zbpp::linear_wgrad: ") as err:
        ops.linear_wgrad(x, dy, dw, db, **kw)
    assert words in str(err.value)


def test_the_library_loads_into_a_process_without_python_reaching_it():
    """A C++ program (no Python) loads libtorch and libzbpp_torch.so and calls zbpp::wgrad through
    torch's dispatcher: the check ctest runs as torch_ops_cpp (tests/c/torch_ops_check.cpp)."""
    build = os.environ.get("ZBPP_BUILD_DIR")
    exe = os.path.join(build, "torch_ops_check") if build else None
    if not exe or not os.path.isfile(exe):
        pytest.skip("torch_ops_check is built with libzbpp_torch.so (ZBPP_BUILD_DIR names the build)")
    import subprocess

    out = subprocess.run([exe, os.path.join(build, "libzbpp_torch.so")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "zbpp::wgrad matches" in out.stdout
