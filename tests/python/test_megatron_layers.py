"""zbpp.split_linear on Megatron-LM's own linear layers (megatron-core's ColumnParallelLinear and
RowParallelLinear), on CPU over gloo.

Each split layer is compared with an unsplit twin holding the same weights, on the same inputs:
the forward output, the input gradient and the bias gradient come from the same torch ops in both,
so they must be equal bit for bit; so must the weight gradient with the W store's "torch" kernel
(the default where libzbpp_torch.so is built: Megatron's own grad_output^T @ total_input, added as
its DDP hook adds it), and with gradient_accumulation_fusion (Megatron's fused kernel, here a CPU
stand-in of APEX's module). With the C library's GEMM (the "cblas" kernel: another summation
order) the weight gradient must be close. W run at once (plain backward) and W captured into a
group and popped later must give the same bits. With Megatron's DDP (its real backward hook and
main_grad buffers) the main_grad must hold each weight gradient exactly once.

Megatron is imported in this process only by the `mcore` fixture (not at collection: tests that
do not use it do not pay for the import), and everything it imported is dropped again when this
module's tests end; torch.cuda.current_device is patched to "cpu" for that time only (Megatron
allocates with it). The TP=2 test runs in two spawned processes.
"""

import contextlib
import datetime
import os
import sys
import tempfile
import types
import warnings

import pytest

torch = pytest.importorskip("torch")

import megatron_real as mr  # noqa: E402 - tests/python is on sys.path under pytest; imports no Megatron


if not mr.megatron_core_installed():
    pytest.skip("megatron.core (megatron-core) is not installed", allow_module_level=True)

import zbpp  # noqa: E402
from zbpp.split import FROZEN, NOT_SPLIT, SPLIT, capture, default_store  # noqa: E402

# fp32 relative bound for a weight gradient summed over a few dozen products in another order.
REL_FP32 = 1e-5
SEQ, BATCH, HIDDEN, FFN = 6, 3, 12, 20


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _torch_kernel():
    return default_store().kernel == "torch"


def _weight_matches(got, want, what):
    """Bit for bit with the torch kernel; close with the library's GEMM."""
    if _torch_kernel():
        assert torch.equal(got, want), f"{what}: not Megatron's bits ({_rel(got, want):.3g} relative)"
    else:
        assert _rel(got, want) < REL_FP32, f"{what}: {_rel(got, want):.3g}"


@contextlib.contextmanager
def _kernel(name):
    st = default_store()
    old = st.kernel
    st.kernel = name
    try:
        yield st
    finally:
        st.kernel = old


def _cpu_patches(mp):
    """Megatron allocates with device=torch.cuda.current_device(), which raises on a CPU torch."""
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")


class _Megatron:
    """What the tests use of Megatron, imported once by the fixture."""

    def __init__(self):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer import TransformerConfig

        from zbpp.megatron import layers

        self.ps = parallel_state
        self.DDP, self.DDPConfig = DistributedDataParallel, DistributedDataParallelConfig
        self.GPTModel, self.local_spec = GPTModel, get_gpt_layer_local_spec
        self.Column, self.Row = ColumnParallelLinear, RowParallelLinear
        self.TransformerConfig = TransformerConfig
        self.layers = layers

    def config(self, **kw):
        base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                    gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)
        base.update(kw)
        return self.TransformerConfig(**base)


@pytest.fixture(scope="module")
def mcore():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a torch.distributed default group already exists in this process")
    before = set(sys.modules)
    mp = pytest.MonkeyPatch()
    _cpu_patches(mp)
    tmp = tempfile.mkdtemp(prefix="zbpp-mlayers-")
    m = None
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        m = _Megatron()
        m.ps.initialize_model_parallel(1, 1)
        # Dropout runs inside get_cuda_rng_tracker().fork(), which needs CUDA's generator; this
        # tracker's fork() does nothing (dropout is 0 here).
        mr.no_fork_rng_tracker()
        yield m
    finally:
        if m is not None:
            m.ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        mp.undo()
        # Drop what this module imported of Megatron (and zbpp's Megatron layers with it): the
        # process is left with the Megatron modules it had before.
        for name in set(sys.modules) - before:
            if name == "megatron" or name.startswith("megatron.") or name == "zbpp.megatron.layers":
                del sys.modules[name]
        zm = sys.modules.get("zbpp.megatron")
        if zm is not None and "layers" in vars(zm):
            delattr(zm, "layers")
        for f in os.listdir(tmp):
            os.remove(os.path.join(tmp, f))
        os.rmdir(tmp)


# ---- building pairs of layers ---------------------------------------------------------------------

def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


LAYERS = {
    # name: (class, keyword arguments, input features, output features)
    "column": ("Column", dict(bias=True), HIDDEN, FFN),
    "column-nobias": ("Column", dict(bias=False), HIDDEN, FFN),
    "column-skip-bias-add": ("Column", dict(bias=True, skip_bias_add=True), HIDDEN, FFN),
    "column-gather-output": ("Column", dict(bias=True, gather_output=True), HIDDEN, FFN),
    "row": ("Row", dict(bias=True, input_is_parallel=True, skip_bias_add=False), FFN, HIDDEN),
    "row-nobias": ("Row", dict(bias=False, input_is_parallel=True, skip_bias_add=False), FFN, HIDDEN),
    "row-skip-bias-add": ("Row", dict(bias=True, input_is_parallel=True, skip_bias_add=True), FFN, HIDDEN),
    "row-scatter-input": ("Row", dict(bias=True, input_is_parallel=False, skip_bias_add=False), FFN, HIDDEN),
}


def _layer(m, kind, seed=0, config=None):
    cls, kw, fin, fout = LAYERS[kind]
    layer = getattr(m, cls)(fin, fout, config=config or m.config(), init_method=torch.nn.init.zeros_, **kw)
    _randomize(layer, seed)
    return layer


def _inputs(kind, seed=1):
    fin = LAYERS[kind][2]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, fin, generator=g)
    dy = torch.randn(SEQ, BATCH, LAYERS[kind][3], generator=g)
    return x, dy


def _run(layer, x, dy):
    """Forward (with the returned bias added, as Megatron's callers do) and backward; returns the
    output and the input gradient."""
    x = x.clone().requires_grad_()
    out, out_bias = layer(x)
    if out_bias is not None:
        out = out + out_bias
    out.backward(dy)
    return out.detach(), x.grad


def _grads(layer):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in layer.named_parameters()}


def _split(module):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not split" warning for layers zbpp splits
        return zbpp.split_linear(module)


# ---- single process, TP = 1 ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_split_layer_matches_megatron(mcore, kind):
    ref, layer = _layer(mcore, kind), _layer(mcore, kind)
    assert _split(layer) is layer
    assert mcore.layers.is_split(layer) and not mcore.layers.is_split(ref)
    assert [e.status for e in zbpp.split_report(layer)] == [SPLIT]
    x, dy = _inputs(kind)
    st = default_store()
    ran = st.gemms_run
    out_ref, dx_ref = _run(ref, x, dy)
    out, dx = _run(layer, x, dy)
    assert st.gemms_run == ran + 1, "the weight GEMM ran in zbpp's W store"
    assert torch.equal(out, out_ref), "forward: Megatron's own ops"
    assert torch.equal(dx, dx_ref), "input gradient: Megatron's own ops"
    g_ref, g = _grads(ref), _grads(layer)
    assert g.keys() == g_ref.keys()
    for name in g:
        assert g[name] is not None, name
        if name == "weight":
            _weight_matches(g[name], g_ref[name], name)
        else:
            assert torch.equal(g[name], g_ref[name]), name
    # float64 check of the weight gradient: dW = dy^T x summed over (seq, batch)
    x64, dy64 = x.double().reshape(-1, x.shape[-1]), dy.double().reshape(-1, dy.shape[-1])
    assert _rel(layer.weight.grad, dy64.t() @ x64) < REL_FP32
    assert st.live_entries() == 0


@pytest.mark.parametrize("kind", ["column", "row-skip-bias-add"])
def test_w_captured_and_popped_later_gives_the_same_bits(mcore, kind):
    now, later = _layer(mcore, kind), _layer(mcore, kind)
    _split(now), _split(later)
    st = default_store()
    x, dy = _inputs(kind)
    for step in range(2):  # the second step accumulates onto the first's gradients
        _run(now, x, dy)
        ran = st.gemms_run
        with capture(stage=0, mb=step):
            _, dx = _run(later, x, dy)
        assert st.gemms_run == ran, "B ran no weight GEMM"
        assert st.store.pending(0) == 1 and st.live_entries() == 1
        if step == 0:
            assert not later.weight.grad.any(), "no weight gradient before W"
            if later.bias is not None:
                assert later.bias.grad is not None and later.bias.grad.any(), "the bias gradient comes in B"
        assert st.store.pop_run(0) == step
        assert st.gemms_run == ran + 1 and st.live_entries() == 0
        for (n, a), (_, b) in zip(now.named_parameters(), later.named_parameters()):
            assert torch.equal(a.grad, b.grad), n


def _ddp(m, module, **ddp_kw):
    return m.DDP(config=module.config, ddp_config=m.DDPConfig(**ddp_kw), module=module)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_megatron_ddp_main_grad_gets_each_gradient_once(mcore, kind):
    ref, layer = _ddp(mcore, _layer(mcore, kind)), _ddp(mcore, _split(_layer(mcore, kind)))
    w_ref, w = ref.module.weight, layer.module.weight
    assert w.main_grad.dtype == torch.float32 and w.grad_added_to_main_grad is False
    st = default_store()
    for i in range(3):  # three microbatches: W at once, W deferred, W deferred
        x, dy = _inputs(kind, seed=10 + i)
        _run(ref.module, x, dy)
        if i == 0:
            _run(layer.module, x, dy)
        else:
            with capture(stage=0, mb=i):
                _run(layer.module, x, dy)
            st.store.pop_run(0)
    assert w.grad is None and w_ref.grad is None, "DDP's hook moved (or dropped) .grad"
    assert w.grad_added_to_main_grad is True, "B told the hook that W writes main_grad"
    assert w.main_grad.abs().sum() > 0
    _weight_matches(w.main_grad, w_ref.main_grad, "main_grad holds the weight gradient once")
    for n, p in layer.module.named_parameters():
        if n != "weight":
            assert torch.equal(p.main_grad, dict(ref.module.named_parameters())[n].main_grad), n
    ref.zero_grad_buffer(), layer.zero_grad_buffer()
    assert w.grad_added_to_main_grad is False and not w.main_grad.any()


def _gpt(m, seed=0, tied=False):
    torch.manual_seed(seed)
    return m.GPTModel(config=m.config(), transformer_layer_spec=m.local_spec(), vocab_size=32,
                      max_sequence_length=8, share_embeddings_and_output_weights=tied)


def _gpt_batch(i):
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, 32, (2, 8), generator=g)
    pos = torch.arange(8).unsqueeze(0).expand(2, 8)
    mask = torch.triu(torch.ones(1, 1, 8, 8), diagonal=1).bool()  # causal (Megatron's default needs CUDA)
    return ids, pos, mask


def _gpt_microbatch(model, i):
    ids, pos, mask = _gpt_batch(i)
    model(ids, pos, mask, labels=ids).float().mean().backward()


LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")


def test_gpt_model_every_linear_is_split_and_w_runs_per_microbatch(mcore):
    M = 3
    ref, now, later = _gpt(mcore), _gpt(mcore), _gpt(mcore)
    _split(now), _split(later)
    report = zbpp.split_report(later)
    linears = [n for n, mod in later.named_modules() if isinstance(mod, (mcore.Column, mcore.Row))]
    assert sorted({n.rsplit(".", 1)[-1] for n in linears}) == sorted(LINEARS)
    assert len(linears) == 2 * 4 + 1
    assert [e.name for e in report.split] == linears and not report.not_split and not report.frozen
    st = default_store()
    ran = st.gemms_run
    for i in range(M):
        _gpt_microbatch(ref, i)
        _gpt_microbatch(now, i)
    assert st.gemms_run == ran + len(linears) * M
    for i in range(M):
        with capture(stage=0, mb=i):
            _gpt_microbatch(later, i)
    assert st.gemms_run == ran + len(linears) * M, "captured: no W has run yet"
    assert st.store.pending(0) == M
    for i in range(M):
        assert st.store.pop_run(0) == i
    assert st.gemms_run == ran + 2 * len(linears) * M, "one W GEMM per linear and microbatch"
    assert st.live_entries() == 0
    params_ref = dict(ref.named_parameters())
    for (n, a), (_, b) in zip(now.named_parameters(), later.named_parameters()):
        assert torch.equal(a.grad, b.grad), f"{n}: W at once and W later differ"
        if _torch_kernel():
            assert torch.equal(a.grad, params_ref[n].grad), f"{n}: {_rel(a.grad, params_ref[n].grad):.3g}"
        else:
            assert _rel(a.grad, params_ref[n].grad) < 1e-4, f"{n}: {_rel(a.grad, params_ref[n].grad):.3g}"


@pytest.mark.parametrize("tied", [False, True])
def test_partition_defers_the_linear_weights_and_leaves_the_rest(mcore, tied):
    """zbpp.splitters.partition on a GPT model: every split Column/RowParallelLinear defers its weight
    (its bias gradient comes back in B, as Megatron's); biases, layer norms and embeddings are the
    generic splitter's, the tied embedding too (the output layer is given it in forward)."""
    from zbpp import splitters

    model = _gpt(mcore, tied=tied)
    part = splitters.partition(model)
    names = {id(p): n for n, p in model.named_parameters()}
    linears = [n for n, mod in model.named_modules() if isinstance(mod, (mcore.Column, mcore.Row))]
    want = [f"{n}.weight" for n in linears if not (tied and n == "output_layer")]
    assert [names[id(p)] for p in part.deferred] == want
    rest = [names[id(p)] for p in part.remaining]
    assert rest == [n for n, p in model.named_parameters() if n not in want]
    assert "embedding.word_embeddings.weight" in rest and any(n.endswith("linear_qkv.bias") for n in rest)
    assert not part.report.not_split


def test_gpt_tied_embedding_under_ddp(mcore):
    """pp=1 with tied embeddings: the output layer uses the embedding's weight (passed to forward),
    which Megatron marks zero_out_wgrad; the DDP hook then adds the (zero) dummy together with the
    embedding lookup's own gradient, and W adds the output layer's part."""
    ref, split = _ddp(mcore, _gpt(mcore, tied=True)), _ddp(mcore, _split(_gpt(mcore, tied=True)))
    emb = split.module.embedding.word_embeddings.weight
    assert getattr(emb, "zero_out_wgrad", False) and split.module.output_layer.weight is None
    assert [e.reason for e in zbpp.split_report(split) if e.name.endswith("output_layer")] == [
        "the weight is passed to forward (tied with the embedding)"]
    st = default_store()
    for i in range(2):
        _gpt_microbatch(ref.module, i)
        with capture(stage=0, mb=i):
            _gpt_microbatch(split.module, i)
        st.store.pop_run(0)
    # Close, not equal, even with the torch kernel: Megatron sums the tied weight's two gradients of a
    # backward (the output layer's and the lookup's) before its hook adds them to main_grad; the split
    # adds the lookup's in B and the output layer's at W, one rounding more. (pp > 1 keeps a copy of the
    # weight per stage; test_megatron_real checks those bit for bit.)
    for (n, a), (_, b) in zip(ref.module.named_parameters(), split.module.named_parameters()):
        assert _rel(b.main_grad, a.main_grad) < 1e-4, f"{n}: {_rel(b.main_grad, a.main_grad):.3g}"


def test_frozen_weight_runs_megatrons_frozen_path(mcore):
    ref, layer = _layer(mcore, "column"), _layer(mcore, "column")
    for m in (ref, layer):
        m.weight.requires_grad_(False)
    _split(layer)  # no warning: there is no weight gradient to lose
    assert [(e.status, "frozen" in e.reason) for e in zbpp.split_report(layer)] == [(FROZEN, True)]
    st = default_store()
    ran = st.gemms_run
    x, dy = _inputs("column")
    out_ref, dx_ref = _run(ref, x, dy)
    out, dx = _run(layer, x, dy)
    assert torch.equal(out, out_ref) and torch.equal(dx, dx_ref)
    assert st.gemms_run == ran and layer.weight.grad is None
    # Unfrozen later, the layer splits.
    layer.weight.requires_grad_(True)
    assert zbpp.split_report(layer).entries[0].status == SPLIT
    _run(layer, x, dy)
    assert st.gemms_run == ran + 1


def test_refused_layers_are_reported_and_warned(mcore):
    m = mcore
    # defer_embedding_wgrad_compute: Megatron defers the output layer's W itself.
    cfg = m.config()
    cfg.defer_embedding_wgrad_compute = True  # (its checks want pp > 1 and the fused extension)
    deferred = m.Column(HIDDEN, FFN, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                        embedding_activation_buffer=[], grad_output_buffer=[])

    class OwnImpl(m.Row):
        def _forward_impl(self, input, weight, *args, **kwargs):
            return super()._forward_impl(input, weight, *args, **kwargs)

    own = OwnImpl(FFN, HIDDEN, config=m.config(), init_method=torch.nn.init.zeros_, bias=False,
                  input_is_parallel=True, skip_bias_add=False)
    fine = _layer(m, "column")
    model = torch.nn.ModuleDict(dict(deferred=deferred, own=own, fine=fine))
    with pytest.warns(UserWarning) as record:
        zbpp.split_linear(model)
    mine = [w for w in record if "zbpp.split_linear" in str(w.message)]
    assert len(mine) == 1, "one warning lists them all"
    text = str(mine[0].message)
    assert "deferred (ColumnParallelLinear): defer_embedding_wgrad_compute" in text and "fine" not in text
    assert not m.layers.is_split(deferred) and m.layers.is_split(fine)
    report = zbpp.split_report(model)
    if m.layers._REASSIGNING[m.Row]:
        # megatron-core before 0.10 sets self._forward_impl in __init__ and forward: the instance
        # attribute hides OwnImpl's method, Megatron's function runs, and zbpp splits it as any.
        assert "own (" not in text and m.layers.is_split(own)
        assert [(e.name, e.status) for e in report] == [("deferred", NOT_SPLIT), ("own", SPLIT), ("fine", SPLIT)]
    else:
        assert "own (OwnImpl): OwnImpl overrides _forward_impl" in text and not m.layers.is_split(own)
        assert [(e.name, e.status) for e in report] == [("deferred", NOT_SPLIT), ("own", NOT_SPLIT),
                                                         ("fine", SPLIT)]


def test_half_precision_main_grad_gets_what_megatrons_hook_adds(mcore):
    """The torch kernel adds W to a float16 main_grad as Megatron's DDP hook adds .grad to it."""
    if not _torch_kernel():
        pytest.skip("the torch kernel is not built")
    ref, layer = _layer(mcore, "row"), _split(_layer(mcore, "row"))
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float16)
    assert zbpp.split_report(layer).entries[0].status == SPLIT
    want = torch.zeros(layer.weight.shape, dtype=torch.float16)
    for i in range(2):
        x, dy = _inputs("row", seed=20 + i)
        _run(layer, x, dy)
        _run(ref, x, dy)
        want.add_(ref.weight.grad)  # the hook: main_grad.add_(param.grad); grad = None
        ref.weight.grad = None
    assert layer.weight.grad is None
    assert torch.equal(layer.weight.main_grad, want)


class _FusedStandIn:
    """APEX's fused_weight_gradient_mlp_cuda as a CPU stand-in (Megatron imports that module for
    gradient_accumulation_fusion): main_grad += grad_output^T @ total_input in one GEMM, float32."""

    def __init__(self):
        self.calls = 0

    def wgrad_gemm_accum_fp32(self, total_input, grad_output, main_grad):
        self.calls += 1
        main_grad.addmm_(grad_output.t().float(), total_input.float())

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


@pytest.mark.parametrize("kind", ["column", "row"])
def test_gradient_accumulation_fusion_runs_megatrons_kernel_at_w(mcore, kind, monkeypatch):
    """With gradient_accumulation_fusion Megatron's own fused kernel makes the weight gradient: zbpp
    calls the very same function at W (into main_grad), so the bits are Megatron's whatever the
    kernel computes; B returns Megatron's dummy and tells its DDP hook not to add it."""
    stand_in = _FusedStandIn()
    monkeypatch.setattr(mcore.layers._ml, "fused_weight_gradient_mlp_cuda", stand_in, raising=False)
    monkeypatch.setattr(mcore.layers._ml, "_grad_accum_fusion_available", True)
    cfg = mcore.config(gradient_accumulation_fusion=True)
    ref = _ddp(mcore, _layer(mcore, kind, config=cfg))
    layer = _ddp(mcore, _split(_layer(mcore, kind, config=cfg)))
    st = default_store()
    for i in range(3):
        x, dy = _inputs(kind, seed=30 + i)
        _run(ref.module, x, dy)
        before = stand_in.calls
        with capture(stage=0, mb=i):
            _run(layer.module, x, dy)
        assert stand_in.calls == before, "deferred: the fused kernel waits for W"
        st.store.pop_run(0)
        assert stand_in.calls == before + 1
    for (n, a), (_, b) in zip(ref.module.named_parameters(), layer.module.named_parameters()):
        assert torch.equal(b.main_grad, a.main_grad), n
    assert layer.module.weight.grad_added_to_main_grad is True


def test_half_precision_main_grad_falls_back_loudly(mcore):
    with _kernel("cblas"):
        _half_main_grad_cblas(mcore)


def _half_main_grad_cblas(mcore):
    ref, layer = _layer(mcore, "row"), _split(_layer(mcore, "row"))
    for mod in (ref, layer):
        mod.weight.main_grad = torch.zeros(mod.weight.shape, dtype=torch.float16)
    report = zbpp.split_report(layer)
    assert report.entries[0].status == NOT_SPLIT and "main_grad is torch.float16" in report.entries[0].reason
    st = default_store()
    ran = st.gemms_run
    x, dy = _inputs("row")
    mcore.layers._warned.clear()
    with pytest.warns(UserWarning, match="runs unsplit"):
        _run(layer, x, dy)
    _run(ref, x, dy)
    assert st.gemms_run == ran, "Megatron's implementation ran the weight GEMM"
    assert torch.equal(layer.weight.grad, ref.weight.grad)


def test_transformer_engine_and_unknown_linear_layers_are_reported():
    """No Megatron needed: Transformer Engine's layers are recognised by their module."""

    def fake(name, module):
        cls = type(name, (torch.nn.Module,), {"__module__": module})

        def init(self):
            torch.nn.Module.__init__(self)
            self.weight = torch.nn.Parameter(torch.zeros(4, 4))

        cls.__init__ = init
        return cls

    TELinear = fake("Linear", "transformer_engine.pytorch.module.linear")
    TELayerNormColumnParallelLinear = fake("TELayerNormColumnParallelLinear",
                                           "megatron.core.extensions.transformer_engine")
    TEColumn = type("TEColumnParallelLinear", (TELinear,),
                    {"__module__": "megatron.core.extensions.transformer_engine"})
    MyLinear = type("MyLinear", (torch.nn.Linear,), {})
    LoraLinear = fake("LoraLinear", __name__)
    model = torch.nn.ModuleDict(dict(te=TELinear(), ln_te=TELayerNormColumnParallelLinear(), col=TEColumn(),
                                     sub=MyLinear(4, 4), lora=LoraLinear(), plain=torch.nn.Linear(4, 4),
                                     norm=torch.nn.LayerNorm(4)))
    model.lora.weight.requires_grad_(False)
    before = zbpp.split_report(model)
    assert before.entries[-1].name == "plain" and before.entries[-1].status == NOT_SPLIT
    with pytest.warns(UserWarning) as record:
        assert zbpp.split_linear(model) is model
    assert len(record) == 1
    text = str(record[0].message)
    assert text.startswith("zbpp.split_linear: 4 linear layer(s) not split")
    assert ("te (Linear), ln_te (TELayerNormColumnParallelLinear), col (TEColumnParallelLinear): "
            "Transformer Engine module without a weight-gradient store") in text
    assert "transformer_impl='local'" in text and "sub (MyLinear): a subclass of torch.nn.Linear" in text
    report = zbpp.split_report(model)
    assert [(e.name, e.status) for e in report] == [
        ("te", NOT_SPLIT), ("ln_te", NOT_SPLIT), ("col", NOT_SPLIT), ("sub", NOT_SPLIT), ("lora", FROZEN),
        ("plain", SPLIT)]
    assert "norm" not in str(report) and repr(report) == "SplitReport(split=1, frozen=1, not_split=4)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zbpp.split_linear(model, warn=False)


# ---- TP = 2, two processes ----------------------------------------------------------------------------

def _tp2_worker(rank, tmp):
    import torch.distributed as dist

    torch.cuda.current_device = lambda: "cpu"  # this process only
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    m = _Megatron()
    m.ps.initialize_model_parallel(2, 1)
    st = default_store()
    for sp in (False, True):
        cfg = m.config(tensor_model_parallel_size=2, sequence_parallel=sp)

        def pair():
            torch.manual_seed(3)  # Megatron draws the full weight on CPU and keeps this rank's part
            col = m.Column(HIDDEN, FFN, config=cfg, init_method=torch.nn.init.normal_, bias=True)
            row = m.Row(FFN, HIDDEN, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                        input_is_parallel=True, skip_bias_add=sp)
            with torch.no_grad():
                col.bias.normal_(), row.bias.normal_()
            return torch.nn.ModuleList([col, row])

        ref, now, later = pair(), _split(pair()), _split(pair())
        assert all(m.layers.is_split(mod) for mod in (*now, *later))
        g = torch.Generator().manual_seed(10 + (rank if sp else 0))  # sequence parallel: this rank's shard
        rows = SEQ // 2 if sp else SEQ
        M = 2  # microbatches: the second forward reuses Megatron's all-gather buffer before W ran
        xs = [torch.randn(rows, BATCH, HIDDEN, generator=g) for _ in range(M)]
        dys = [torch.randn(rows, BATCH, HIDDEN, generator=g) for _ in range(M)]

        def forward(model, i):
            x = xs[i].clone().requires_grad_()
            h, _ = model[0](x)
            out, out_bias = model[1](torch.nn.functional.gelu(h))
            return x, (out + out_bias if out_bias is not None else out)

        def run(model, deferred=False):
            results = []
            for i in range(M):
                x, out = forward(model, i)
                if deferred:
                    with capture(stage=0, mb=i):
                        out.backward(dys[i])
                else:
                    out.backward(dys[i])
                results.append((out.detach(), x.grad))
            return results

        expect = run(ref)
        ran = st.gemms_run
        at_once = run(now)
        assert st.gemms_run == ran + 2 * M
        later_res = run(later, deferred=True)
        assert st.gemms_run == ran + 2 * M and st.store.pending(0) == M
        for i in range(M):
            assert st.store.pop_run(0) == i
        assert st.gemms_run == ran + 4 * M and st.live_entries() == 0
        for i in range(M):
            for what, k in (("forward", 0), ("input gradient", 1)):
                assert torch.equal(at_once[i][k], expect[i][k]), f"sp={sp} mb {i}: {what}"
                assert torch.equal(later_res[i][k], expect[i][k]), f"sp={sp} mb {i}: {what}"
        for (n, a), (_, b), (_, c) in zip(ref.named_parameters(), now.named_parameters(), later.named_parameters()):
            assert torch.equal(b.grad, c.grad), f"sp={sp} {n}: W at once and W later differ"
            if n.endswith("weight"):
                _weight_matches(b.grad, a.grad, f"sp={sp} {n}")
            else:
                assert torch.equal(b.grad, a.grad), f"sp={sp} {n}"
    m.ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_tensor_parallel_2_with_and_without_sequence_parallel():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="zbpp-mlayers-tp2-") as tmp:
        mp.spawn(_tp2_worker, args=(tmp,), nprocs=2, join=True)
