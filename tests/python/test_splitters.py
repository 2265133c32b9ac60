"""zbpp.splitters: the layer families behind one registry, and the W store they share.

What a user (or a stage) relies on: each layer family claims its own layers and the registry splits
and reports them as zbpp.split_linear / zbpp.split_report always did (those names and the rest of
zbpp.split still import from there); partition() says which trainable parameters the split layers
defer themselves and which are left to the generic autograd-graph splitter, and the two together
train a stage exactly as a plain backward does; the modules no longer import each other in a circle.
"""

import ast
import copy
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import zbpp  # noqa: E402
from zbpp import splitters  # noqa: E402
from zbpp.split import SplitLinear, capture, default_store  # noqa: E402
from zbpp.splitters import FROZEN, NOT_SPLIT, SPLIT  # noqa: E402

PACKAGE = Path(zbpp.__file__).resolve().parent


# ---- no circle ------------------------------------------------------------------------------------

def _module_name(path):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path, known):
    """The zbpp modules among `known` that `path` imports anywhere (functions included, as a lazy
    import is still a dependency), resolved from relative and absolute forms."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from . import te_layers`
    return {m for m in found if m in known and m != name}


def test_no_module_imports_another_in_a_circle():
    """split.py, megatron/layers.py and te_layers.py imported each other in a circle; now the W store
    and the families import no registry, and the registry reaches the families only by name."""
    files = [PACKAGE / "split.py", PACKAGE / "wgrad_store.py", PACKAGE / "_wlayout.py", PACKAGE / "te_layers.py",
             PACKAGE / "megatron" / "layers.py", *sorted((PACKAGE / "splitters").glob("*.py"))]
    known = {_module_name(f) for f in files}
    graph = {_module_name(f): _imports(f, known) for f in files}
    graph["zbpp.splitters"] |= {f"zbpp.splitters.{name}" for name in splitters.FAMILIES}  # importlib, by name
    for name in splitters.FAMILIES:
        assert f"zbpp.splitters.{name}" in known

    def cycle_from(start, path, seen):
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                found = cycle_from(start, path + [nxt], seen)
                if found:
                    return found
        return None

    for start in sorted(graph):
        circle = cycle_from(start, [start], {start})
        assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_public_names_still_come_from_zbpp_split():
    import zbpp.split as split

    assert split.split_linear is splitters.split and split.split_report is splitters.report
    assert zbpp.split_linear is splitters.split and zbpp.split_report is splitters.report
    assert split.SplitLinear is SplitLinear and split.default_store is zbpp.wgrad_store.default_store
    for name in ("WGradStore", "capture", "defer_weight_grad", "defer_action"):
        assert getattr(split, name) is getattr(zbpp.wgrad_store, name), name
    for name in ("SplitReport", "SplitEntry", "SPLIT", "FROZEN", "NOT_SPLIT"):
        assert getattr(split, name) is getattr(splitters, name), name


# ---- families and partition -----------------------------------------------------------------------

class _MyLinear(torch.nn.Linear):
    pass


class _TELinear(torch.nn.Module):
    """A Transformer Engine module as the registry sees one: by its class's module."""
    __module__ = "transformer_engine.pytorch.module.linear"

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 4))


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.fc1 = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.fc2 = torch.nn.Linear(8, 8, bias=False)
        self.sub = _MyLinear(8, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(8, 10)
        self.head.weight = self.emb.weight  # tied: one parameter, two modules
        self.te = _TELinear()


def test_each_family_claims_its_layers_in_order():
    model = _Model()
    linear, te = splitters.families()[-1], splitters.families()[-2]
    assert (linear.NAME, te.NAME) == ("torch.nn.Linear", "Transformer Engine")
    assert splitters.family_of(model.fc1) is linear and splitters.family_of(model.sub) is linear
    assert splitters.family_of(model.te) is te  # a "Linear" class of TE's: TE's, not the unknown kind
    assert splitters.family_of(model.norm) is None and splitters.family_of(model.emb) is None
    assert "megatron" not in [f.__name__.rsplit(".", 1)[-1] for f in splitters.families()] or \
        "megatron.core.tensor_parallel.layers" in sys.modules  # asked only once Megatron is imported


def test_partition_splits_and_divides_the_trainable_parameters():
    model = _Model()
    with pytest.warns(UserWarning, match="not split"):
        part = splitters.partition(model, warn=True)
    assert type(model.fc1) is SplitLinear and type(model.head) is SplitLinear and type(model.sub) is _MyLinear
    names = {id(p): n for n, p in model.named_parameters()}  # (the tied weight under its first name)
    assert [names[id(p)] for p in part.deferred] == ["fc1.weight", "fc1.bias", "fc2.weight", "head.bias"]
    # The tied weight stays the generic splitter's: the embedding's use of it is not a split layer's.
    assert [names[id(p)] for p in part.remaining] == ["emb.weight", "norm.weight", "norm.bias", "sub.weight",
                                                      "sub.bias", "te.weight"]
    assert {(e.name, e.status) for e in part.report} == {
        ("fc1", SPLIT), ("fc2", SPLIT), ("sub", NOT_SPLIT), ("frozen", FROZEN), ("head", SPLIT), ("te", NOT_SPLIT)}


class _TEStore:
    """TE's WeightGradStore, the parts the registry's TE family looks at."""

    def __init__(self, delay_wgrad_compute=False):
        self.enabled = bool(delay_wgrad_compute)

    def delay_wgrad_compute(self):
        return self.enabled

    def put(self, tensor_list, func):
        pass

    def pop(self):
        pass


class _TELayerNormLinear(torch.nn.Module):
    """TE's LayerNormLinear as the registry sees it: a fused layer norm and a linear, whose weight
    and bias TE's backward_dw computes (the layer norm's come back in B)."""
    __module__ = "transformer_engine.pytorch.module.layernorm_linear"

    def __init__(self):
        super().__init__()
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(4))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(4))
        self.weight = torch.nn.Parameter(torch.zeros(4, 4))
        self.bias = torch.nn.Parameter(torch.zeros(4))
        self.fuse_wgrad_accumulation = True
        self.wgrad_store = _TEStore()

    def backward_dw(self):
        pass


def test_partition_leaves_a_te_layers_fused_layer_norm_to_the_generic_splitter():
    m = _TELayerNormLinear()
    part = splitters.partition(m)
    assert zbpp.te_layers.is_split(m)
    assert [id(p) for p in part.deferred] == [id(m.weight), id(m.bias)]
    assert [id(p) for p in part.remaining] == [id(m.layer_norm_weight), id(m.layer_norm_bias)]


def test_a_stage_split_by_partition_and_the_generic_splitter_trains_like_a_plain_backward():
    """A middle stage (its input needs a gradient): the registry splits its linear layers, the generic
    splitter takes the rest (here a LayerNorm's and an extra scale's); B gives the input gradient,
    W later the weights', over two microbatches: every gradient equals a plain backward's."""
    generic = splitters.autograd_splitter()
    if generic is None:
        pytest.skip("this zbpp has no generic autograd splitter")

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 32)
            self.norm = torch.nn.LayerNorm(32)
            self.scale = torch.nn.Parameter(torch.full((32,), 1.5))
            self.fc2 = torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x)) * self.scale))

    torch.manual_seed(0)
    ref = Stage()
    stage = copy.deepcopy(ref)
    part = splitters.partition(stage)
    assert default_store().kernel in ("torch", "cblas")
    xs = [torch.randn(3, 50, 16) for _ in range(2)]
    gs = [torch.randn(3, 50, 16) for _ in range(2)]
    ref_dx = []
    for x, g in zip(xs, gs):
        xr = x.clone().requires_grad_()
        ref(xr).backward(g)
        ref_dx.append(xr.grad)
    st = default_store()
    ws = []
    for i, (x, g) in enumerate(zip(xs, gs)):
        xi = x.clone().requires_grad_()
        with capture(0, i):  # B: the split layers push their W into this group
            out = stage(xi)
            ws.append(generic.backward_input([out], [g], [xi], part.remaining))
        if default_store().kernel == "torch":
            assert torch.equal(xi.grad, ref_dx[i]), "input gradient"
    for p in (stage.fc1.weight, stage.norm.weight, stage.scale):  # .grad: None, or zeros until W writes it
        assert p.grad is None or not p.grad.any(), "no weight gradient before W"
    for i, w in enumerate(ws):  # W, in microbatch order
        w()
        st.store.pop_run(0)
    for (n, a), (_, b) in zip(stage.named_parameters(), ref.named_parameters()):
        if st.kernel == "torch" or n in ("norm.weight", "norm.bias", "scale"):
            assert torch.equal(a.grad, b.grad), n
        else:  # the library's GEMM: another summation order
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert st.live_entries() == 0


def test_autograd_splitter_learns_the_families_deferring_functions(monkeypatch):
    generic = splitters.autograd_splitter()
    if generic is None:
        pytest.skip("this zbpp has no generic autograd splitter")
    seen = []
    monkeypatch.setattr(generic, "register_deferring", seen.append)
    assert splitters.autograd_splitter() is generic
    assert zbpp.split._SplitLinearFn in seen


def test_no_generic_splitter_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "zbpp._autograd_split", None)  # as if the module were absent
    assert splitters.autograd_splitter() is None
