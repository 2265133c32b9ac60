"""zbpp.split_linear on Transformer Engine's linear modules (zbpp.te_layers).

Transformer Engine needs a GPU, so this file has two parts:

1. Host tests of zbpp's side of TE's deferred-weight-gradient protocol, against `_ProtocolLinear`
   below: a module that behaves as TE's sources describe (transformer_engine/pytorch/module:
   _common.py's WeightGradStore is a FIFO of (tensors, function) put during backward when
   delay_wgrad_compute is on; base.py's backward_dw pops one, writes main_grad through the fused
   GEMM or .grad, sets a bias .grad only when it is None, then calls the wgrad-accumulation hooks;
   linear.py's backward returns a dummy weight gradient and sets grad_added_to_main_grad when it
   accumulates into main_grad). It is our reading of TE, not TE: what it proves is that zbpp runs
   each B's W once, in order, at the W op, with the gradients Megatron's DDP would hold.
2. `gpu` tests with the real transformer_engine.pytorch (skipped without a GPU or TE): split
   te.Linear / te.LayerNormMLP against unsplit twins, W captured per microbatch and popped later.
"""

import queue

import pytest

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
from zbpp import te_layers  # noqa: E402
from zbpp.split import FROZEN, NOT_SPLIT, SPLIT, capture, default_store  # noqa: E402

IN, OUT, ROWS = 6, 5, 7


class _Store:
    """TE's WeightGradStore as _common.py has it (the parts zbpp uses)."""

    def __init__(self, delay_wgrad_compute=False, ub_bulk_wgrad=False):
        self.context = queue.Queue() if delay_wgrad_compute else None
        self.enabled = bool(delay_wgrad_compute)

    def delay_wgrad_compute(self):
        return self.enabled

    def put(self, tensor_list, func):
        assert self.enabled
        self.context.put([tensor_list, func])

    def pop(self):
        assert self.enabled
        if self.context.qsize() == 0:
            raise RuntimeError("Pop empty queue.")
        tensor_list, func = self.context.get()
        return func(*tensor_list), tensor_list


class _Fn(torch.autograd.Function):
    """One linear of a TE module: B puts its W into the store when delaying (linear.py)."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, index):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.index = module, index
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        m = ctx.module
        dx = dy @ weight
        bias = m.biases[ctx.index]

        def wgrad_gemm(x2, dy2):
            dw = dy2.t() @ x2
            if m.fuse_wgrad_accumulation:
                weight.main_grad.add_(dw)
            return dw, dy2.sum(0)

        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        store = m.wgrad_store
        grad_bias = None
        if store.delay_wgrad_compute():
            store.put([x2, dy2], wgrad_gemm)
            wgrad = None
        else:
            wgrad, grad_bias = wgrad_gemm(x2, dy2)
        if m.fuse_wgrad_accumulation and hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            wgrad = torch.empty_like(weight)
        elif m.fuse_wgrad_accumulation:
            wgrad = None
        return dx, wgrad, grad_bias, None, None


class _ProtocolBase(torch.nn.Module):
    """base.py's backward_dw (generalised to n linears per module, n puts per backward)."""

    def backward_dw(self):
        if not (self.wgrad_store is not None and self.wgrad_store.delay_wgrad_compute()):
            return
        for i in reversed(range(len(self.weights))):  # backward order: last linear first
            (wgrad, bgrad), _ = self.wgrad_store.pop()
            if not self.fuse_wgrad_accumulation:
                self.weights[i].grad = wgrad.to(self.weights[i].dtype)
            if self.biases[i].grad is None:
                self.biases[i].grad = bgrad.to(self.biases[i].dtype)
        for hook in self.hooks:
            hook()


_ProtocolBase.__module__ = "transformer_engine.pytorch.module.base"


class _ProtocolLinear(_ProtocolBase):
    """n chained linears (1: TE's Linear; 2: LayerNormMLP's fc1, fc2) with TE's attributes."""

    def __init__(self, n=1, fuse=True, delay=False, ub_bulk_wgrad=False, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        dims = [IN] + [OUT] * n
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(dims[i + 1], dims[i], generator=g)) for i in range(n)])
        self.biases = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(dims[i + 1], generator=g)) for i in range(n)])
        self.fuse_wgrad_accumulation = fuse
        self.ub_bulk_wgrad = ub_bulk_wgrad
        self.wgrad_store = _Store(delay)
        self.hooks = []

    def forward(self, x):
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = _Fn.apply(x, w, b, self, i)
        return x


_ProtocolLinear.__module__ = "transformer_engine.pytorch.module.linear"


class _MegatronWrapper(_ProtocolLinear):
    """Megatron's TE wrappers: backward_dw only with Megatron's own config.delay_wgrad_compute."""

    delay_in_config = False

    def backward_dw(self):
        if self.delay_in_config:
            super().backward_dw()


_MegatronWrapper.__module__ = "megatron.core.extensions.transformer_engine"


def _ddp_buffers(module):
    """What Megatron's DDP gives each parameter: an fp32 main_grad and grad_added_to_main_grad."""
    for p in module.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False


def _ddp_hook_like(module):
    """After a backward: what DDP's grad hook does with a returned gradient (add it to main_grad
    unless grad_added_to_main_grad; clear .grad)."""
    for p in module.parameters():
        if p.grad is not None and not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
        p.grad = None


def _batches(k):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)


def _reference(module_args, mbs):
    """main_grad of each parameter after the microbatches with W inside B (no delay)."""
    ref = _ProtocolLinear(**module_args)
    _ddp_buffers(ref)
    for k in range(mbs):
        x, dy = _batches(k)
        ref(x).backward(dy)
        _ddp_hook_like(ref)
    return [p.main_grad.clone() for p in ref.parameters()]


@pytest.mark.parametrize("n", [1, 2], ids=["linear", "two-puts-per-backward"])
def test_plain_backward_runs_w_at_the_end_of_it(n):
    ref = _reference(dict(n=n), 2)
    m = _ProtocolLinear(n=n)
    assert zbpp.split_linear(m) is m and te_layers.is_split(m)
    assert zbpp.split_report(m).entries[0].status == SPLIT
    _ddp_buffers(m)
    st = default_store()
    ran = st.gemms_run
    for k in range(2):
        x, dy = _batches(k)
        m(x).backward(dy)
        _ddp_hook_like(m)
    assert st.gemms_run == ran + 2, "one W entry per backward"
    for got, want in zip((p.main_grad for p in m.parameters()), ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert m.wgrad_store.context.qsize() == 0


@pytest.mark.parametrize("n", [1, 2], ids=["linear", "two-puts-per-backward"])
def test_captured_w_waits_for_its_w_op_and_runs_in_order(n):
    mbs = 3
    ref = _reference(dict(n=n), mbs)
    m = zbpp.split_linear(_ProtocolLinear(n=n))
    _ddp_buffers(m)
    st = default_store()
    for k in range(mbs):
        x, dy = _batches(k)
        with capture(0, k):
            m(x).backward(dy)
        _ddp_hook_like(m)
    # Every B ran; no W yet: the weights' main_grad is untouched, the queue holds every put.
    assert all(float(w.main_grad.abs().sum()) == 0.0 for w in m.weights)
    assert m.wgrad_store.context.qsize() == n * mbs
    for k in range(mbs):
        assert st.store.pop_run(0) == k
        assert m.wgrad_store.context.qsize() == n * (mbs - k - 1)
    for got, want in zip((p.main_grad for p in m.parameters()), ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert all(p.grad is None for p in m.parameters())


def test_megatron_wrapper_without_its_delay_flag_still_runs_tes_backward_dw():
    ref = _reference(dict(), 2)
    m = zbpp.split_linear(_MegatronWrapper())
    _ddp_buffers(m)
    for k in range(2):
        x, dy = _batches(k)
        with capture(0, k):
            m(x).backward(dy)
        _ddp_hook_like(m)
    default_store().store.pop_run(0)
    default_store().store.pop_run(0)
    for got, want in zip((p.main_grad for p in m.parameters()), ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_module_built_with_delay_is_split_and_unsplit_restores_its_store():
    m = _ProtocolLinear(delay=True)
    own = m.wgrad_store
    zbpp.split_linear(m)
    assert te_layers.is_split(m) and m.wgrad_store is not own
    te_layers.unsplit_layer(m)
    assert m.wgrad_store is own and not te_layers.is_split(m)


def test_refusals_are_reported_with_their_reason():
    model = torch.nn.ModuleDict(dict(unfused=_ProtocolLinear(fuse=False), ub=_ProtocolLinear(ub_bulk_wgrad=True),
                                     frozen=_ProtocolLinear(), fine=_ProtocolLinear()))
    for p in model.frozen.parameters():
        p.requires_grad_(False)
    with pytest.warns(UserWarning) as record:
        zbpp.split_linear(model)
    text = str(record[0].message)
    assert "unfused (_ProtocolLinear): fuse_wgrad_accumulation is off" in text
    assert "ub (_ProtocolLinear): TE's userbuffers overlap" in text
    report = zbpp.split_report(model)
    assert [(e.name, e.status) for e in report] == [("unfused", NOT_SPLIT), ("ub", NOT_SPLIT),
                                                     ("frozen", FROZEN), ("fine", SPLIT)]
    assert not te_layers.is_split(model.unfused) and model.unfused.wgrad_store.delay_wgrad_compute() is False


# ---- the real Transformer Engine -------------------------------------------------------------------


def _te():
    return pytest.importorskip("transformer_engine.pytorch")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_real_te_split_matches_unsplit(kind):
    te = _te()
    torch.manual_seed(0)
    hidden, ffn, mbs = 256, 512, 3

    def build():
        if kind == "Linear":
            m = te.Linear(hidden, ffn, bias=True, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
        else:
            m = te.LayerNormMLP(hidden, ffn, bias=True, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
        return m.cuda()

    ref, m = build(), build()
    m.load_state_dict(ref.state_dict())
    for mod in (ref, m):
        for p in mod.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
            p.grad_added_to_main_grad = False
    zbpp.split_linear(m)
    assert te_layers.is_split(m), zbpp.split_report(m)
    xs = [torch.randn(64, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(mbs)]
    dys = [torch.randn(64, hidden if kind != "Linear" else ffn, device="cuda", dtype=torch.bfloat16)
           for _ in range(mbs)]
    for k in range(mbs):
        ref(xs[k]).backward(dys[k])
        _ddp_hook_like(ref)
        with capture(0, k, device="cuda"):
            m(xs[k]).backward(dys[k])
        _ddp_hook_like(m)
    st = default_store("cuda")
    for k in range(mbs):
        assert st.store.pop_run(0) == k
    torch.cuda.synchronize()
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        torch.testing.assert_close(q.main_grad, p.main_grad, rtol=1e-5, atol=1e-5, msg=name)
