"""Split any module's backward into B and W through its autograd graph (what torch's zero-bubble
schedules do for every module, torch/distributed/pipelining/_backward.py), for the parameters no
layer splitter defers itself.

Why: a zero-bubble schedule needs a W to move. zbpp's layer splitters (SplitLinear, Megatron's and
Transformer Engine's linears) push their weight-gradient GEMMs into the W store during B; every
other parameter (LayerNorm, Embedding, a bias added by hand, a user's own layer) would get its
gradient in B. This module gives those parameters a W too, for any module, with autograd's own
backward functions:

B  runs torch.autograd.grad(outputs, stage inputs, retain_graph=True): only the nodes on a path from
   the outputs to the inputs run. On the way it records the gradient reaching each *frontier* node:
   a node on that path from which some parameter is reached by nodes off the path (a LayerNorm's
   backward, which feeds both its input and its weight; an add that a bias joins). The input
   gradients are set as the inputs' .grad (what the pipeline sends upstream).
W  runs the parameters' branches from the frontier nodes, seeded with the recorded gradients, and
   adds the results to .grad as autograd's accumulation would (the first microbatch's gradient
   becomes .grad, later ones are added in place). Parameters are grouped by the frontier nodes
   they hang from, one autograd.grad per group (as torch's stage_backward_weight groups them): a
   single call from every frontier node would also run each node on an input path between two of
   them, B's work again. Within a group, a frontier node below another one would get its gradient
   twice (seeded, and again through the one above), so each is held to its recorded gradient.
   Outputs that reach parameters without touching an input path (a second output computed from
   parameters only) are seeded as they are.

Edges from a deferring layer's node (one that pushed its W into the store in B: SplitLinear's,
Megatron's split linears') to its parameters are not followed: that W is the store's. A weight such
a layer shares with another use (a tied embedding) still gets the other use's gradient here.

A stage none of whose inputs needs a gradient (the first stage: token ids, or data) has nothing to
send upstream, so its whole backward is W, as in torch (backward_weight_one_chunk of stage 0 runs
the full backward).

Bits: each parameter's gradient is computed by the same backward functions on the same saved
tensors as a full backward, and accumulated in the same order, so training equals the sequential
loop's (tests/python/test_autograd_split.py checks torch.equal). Hooks: as in torch's split, the
gradient reaches .grad without autograd's AccumulateGrad, so tensor hooks on parameters and
post-accumulate-grad hooks do not run for these parameters; a pipeline that relies on them (DDP's
bucketing) turns the split off (split_backward=False) or runs a schedule without W.
"""

import sys

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["backward_input", "register_deferring"]

# autograd.Function classes whose backward pushes its weight gradient to the W store in B.
_DEFERRING = set()
# Node class -> whether its nodes are a deferring Function's (a Function's backward node class
# carries it as _forward_cls); cleared when a Function is registered.
_DEFERS = {}


def register_deferring(function_cls):
    """Marks an autograd.Function class as one that defers its parameters' gradients itself (its
    backward pushes them to the W store): the split does not compute them again in W."""
    if function_cls not in _DEFERRING:
        _DEFERRING.add(function_cls)
        _DEFERS.clear()
    return function_cls


def _known_deferring():
    """The deferring Functions of every layer family active now (zbpp.splitters registers them
    here). A family becomes active once its library is imported, so the families are asked again
    whenever the process has imported modules since they last were (asking every time cost a few
    microseconds per B, for an answer that changes only with an import)."""
    if _ASKED[0] != len(sys.modules):
        from . import splitters

        splitters.autograd_splitter()
        _ASKED[0] = len(sys.modules)
    return _DEFERRING


_ASKED = [None]  # len(sys.modules) when the families last registered their deferring Functions


def _node(t):
    return get_gradient_edge(t).node


def _parents(roots, skip):
    """For every node reachable from `roots`: the nodes with an edge to it (the reverse graph),
    leaving out edges from a deferring node to a node in `skip` (its parameters' accumulators)."""
    deferring = _known_deferring()
    defers_of = _DEFERS
    parents, seen, todo = {}, set(), []
    for node in roots:
        if node not in seen:
            seen.add(node)
            todo.append(node)
    # The walk visits every node of the stage's graph at every B: kept to the plain operations.
    pop, push, add = todo.pop, todo.append, seen.add
    while todo:
        node = pop()
        cls = type(node)
        defers = defers_of.get(cls)
        if defers is None:
            defers = defers_of[cls] = getattr(cls, "_forward_cls", None) in deferring
        for nxt, _ in node.next_functions:
            if nxt is None or (defers and nxt in skip):
                continue
            got = parents.get(nxt)
            if got is None:
                parents[nxt] = [node]
            else:
                got.append(node)
            if nxt not in seen:
                add(nxt)
                push(nxt)
    return parents


def _upward(start, parents, stop=None):
    """Nodes reached from `start` through `parents`; with `stop`, the walk does not go past a node
    in it and those met are returned apart: (inside, met)."""
    inside, met, todo = set(), set(), list(start)
    while todo:
        node = todo.pop()
        if stop is not None and node in stop:
            met.add(node)
            continue
        if node in inside:
            continue
        inside.add(node)
        todo.extend(parents.get(node, ()))
    return inside, met


def _accumulate(param, grad):
    """Adds a microbatch's gradient to .grad as AccumulateGrad does: the first one becomes .grad,
    later ones are added in place."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def backward_input(outputs, grads, inputs, params, accumulators=None):
    """B of a stage: the input gradients (set as each input's .grad) now, and the W function that
    adds the remaining gradients of `params` to their .grad, or None when no W work is left.

    outputs: the stage's output tensors (the loss alone on the loss stage); grads: their gradients
    (None for a scalar loss); inputs: the stage's input tensors; params: its trainable parameters.
    accumulators: a dict the caller keeps while the parameters' gradient accumulators cannot change
    (a pipeline keeps one for a step): each parameter's accumulator node is looked up once and kept
    there (the lookup makes a view of the parameter, ~3 us each; holding the node keeps it the one
    autograd uses)."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    params = [p for p in params if p.requires_grad]
    needing = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not pairs:
        return None
    seeds = [torch.ones_like(o) if g is None else g for o, g in pairs]
    if not needing:
        # Nothing goes upstream: the whole backward is W (the graph is kept until then).
        outs = [o for o, _ in pairs]

        def full():
            torch.autograd.backward(outs, seeds)

        return full
    roots = [_node(o) for o, _ in pairs]
    accs = {}
    for p in params:
        if accumulators is None:
            acc = _node(p)
        else:
            got = accumulators.get(id(p))
            if got is None or got[0] is not p:
                got = accumulators[id(p)] = (p, _node(p))
            acc = got[1]
        accs.setdefault(acc, []).append(p)
    parents = _parents(roots, set(accs))
    on_path, _ = _upward([_node(x) for x in needing], parents)
    frontier = set()
    sources = {}  # acc -> the frontier nodes and loose outputs (their nodes) its parameters hang from
    loose_roots = {r: (o, g) for (o, _), g, r in zip(pairs, seeds, roots) if r not in on_path}
    for acc in accs:
        if acc not in parents:
            continue  # not used by this stage's outputs, or only through a deferring layer
        inside, met = _upward([acc], parents, stop=on_path)
        frontier |= met
        sources[acc] = met | {r for r in loose_roots if r in inside}
    recorded = {}

    def recorder(node):
        def hook(grad_outputs):
            recorded[node] = grad_outputs

        return hook

    _grad_into([(node, recorder(node)) for node in frontier], [o for o, _ in pairs], needing, seeds)
    groups = _groups(sources)
    if not groups:
        return None
    calls = []
    for accs_of, srcs in groups:
        edges, edge_grads, clamps = [], [], {}
        for node in srcs:
            if node in loose_roots:
                o, g = loose_roots[node]
                edges.append(get_gradient_edge(o))
                edge_grads.append(g)
                continue
            saved = recorded.get(node, ())
            for k, g in enumerate(saved):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    edge_grads.append(g)
            clamps[node] = saved
        if edges:
            calls.append((edges, edge_grads, clamps if len(srcs) > 1 else {},
                          [p for acc in accs_of for p in accs[acc]]))
    recorded.clear()
    if not calls:
        return None

    def weight():
        # One autograd.grad per group of parameters that hang from the same frontier nodes (as
        # torch's stage_backward_weight groups them): one call for all would also run every node
        # on an input path between two frontier nodes, which is B's work again.
        for edges, edge_grads, clamps, params_of in calls:
            # A frontier node below another one would get its gradient twice (seeded, and again
            # through the one above): it is held to what B recorded.
            _grad_into([(node, lambda _, saved=saved: saved) for node, saved in clamps.items()],
                       edges, params_of, edge_grads)
        calls.clear()

    return weight


def _grad_into(prehooks, outputs, inputs, grads):
    """torch.autograd.grad(outputs, inputs, grads) with `prehooks` ((node, hook) pairs) in place
    while it runs, each result added to its input's .grad (_accumulate). The graph is kept: a split
    stage's W still needs it after B, and one group's W may share nodes with another's."""
    handles = [node.register_prehook(hook) for node, hook in prehooks]
    try:
        got = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for t, g in zip(inputs, got):
        if g is not None:
            _accumulate(t, g)


def _groups(sources):
    """Parameter accumulators grouped so that groups share no source node: [(accs, sources)]."""
    groups = []
    for acc, srcs in sources.items():
        if not srcs:
            continue
        accs_of, merged = [acc], set(srcs)
        keep = []
        for g_accs, g_srcs in groups:
            if g_srcs & merged:
                accs_of = g_accs + accs_of
                merged |= g_srcs
            else:
                keep.append((g_accs, g_srcs))
        groups = keep + [(accs_of, merged)]
    return groups
