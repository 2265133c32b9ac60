"""Split backward for Megatron-LM's own linear layers (ColumnParallelLinear, RowParallelLinear).

What this is: a replacement for Megatron's `linear_with_grad_accumulation_and_async_allreduce`,
installed per layer as the instance attribute `_forward_impl` (Megatron's forward calls
`self._forward_impl(input=..., weight=..., bias=..., ...)`; the class's own method dispatches to
the frozen-weight or the trainable path, and so does this one). megatron-core before 0.10 assigns
`self._forward_impl` in every forward instead: there the layer's class is swapped for a subclass
(`SplitColumnParallelLinear`, ...) whose `_forward_impl` is zbpp's whatever is assigned. Only the
layers it is installed on change; their parameters, state dict and hooks do not.

    forward   identical to Megatron's: with sequence parallelism the input is all-gathered over the
              tensor-parallel group into Megatron's global buffer, then output = total_input @ W^T
              (+ bias), the same torch ops.
    B         grad_input = grad_output @ W, with Megatron's tensor-parallel handling: all-reduced
              over the group (allreduce_dgrad) or reduce-scattered (sequence parallelism); the bias
              gradient (a sum over rows) is returned to autograd, as Megatron does.
    W         dW += grad_output^T total_input (fp32 accumulation), pushed to zbpp's W store
              (zbpp.wgrad_store.defer_weight_grad) into the group of the current B when a pipeline
              runner is capturing; it lands in weight.main_grad when the weight has one
              (Megatron's DDP), else in weight.grad. Outside a pipeline it runs at once: into
              main_grad when there is one (as Megatron's gradient_accumulation_fusion), else it is
              returned to autograd as Megatron's layer without fusion returns it (so
              torch.autograd.grad and create_graph work as there; zbpp.splitters.linear's docstring). With
              sequence parallelism B
              all-gathers the input again into a tensor of its own, which W reads: it stays alive
              from B until W (Megatron re-gathers into its shared buffer and runs W at once).

The weight gradient B returns is what Megatron's DDP backward hook expects of a layer that writes
main_grad itself (gradient_accumulation_fusion's contract): when the weight has main_grad and
`grad_added_to_main_grad`, a dummy (torch.empty, or zeros when `zero_out_wgrad` is set, as for a
weight tied with the embedding) and weight.grad_added_to_main_grad = True, so the hook does not add
it again; otherwise None (W fills main_grad, or .grad inside a pipeline), or outside a pipeline,
for a weight without main_grad, the gradient itself. This holds with gradient_accumulation_fusion
on or off: W always accumulates into main_grad, so the hook must never add a returned gradient.

Not split (the layer keeps Megatron's implementation; `classify` says why, and split_linear warns):
- the layer's class overrides `_forward_impl`, or its forward does not call it, or something else
  replaced the instance's `_forward_impl`;
- defer_embedding_wgrad_compute with a grad_output_buffer (the output layer): Megatron defers that
  weight gradient itself, to the pipeline flush;
- Megatron-FSDP parameters (`__fsdp_param__`: main_grad is made in the backward);
- a megatron.core whose linear_with_grad_accumulation_and_async_allreduce takes arguments this
  module does not know.
At call time the same checks fall back to Megatron's function: a frozen weight runs
linear_with_frozen_weight (nothing to defer; `classify` says "frozen"), a grad_output_buffer or an
FSDP parameter runs linear_with_grad_accumulation_and_async_allreduce, and so do a main_grad that
is not float32 (zbpp's W accumulates into fp32 only) and tensors of a dtype the W GEMM does not take
(a one-time warning names the reason).

Transformer Engine's layers (Megatron's TE layer spec) are split elsewhere: zbpp.te_layers.
"""

import dis
import inspect
import warnings

import torch
from megatron.core.tensor_parallel import layers as _ml

from .. import wgrad_store as _store
from .._wlayout import WLayout
from ..splitters._base import FROZEN, NOT_SPLIT, SPLIT

# What this module needs of megatron.core's tensor_parallel.layers: a Megatron without one of them
# gets an ImportError naming it, and zbpp.split_report lists its linear layers as not split with
# that message. The helpers newer Megatron re-exports there are found where older Megatron keeps
# them (0.9: parallel_state, torch.distributed), so megatron-core 0.9 to 0.16 are split alike.
_NEEDED = ("ColumnParallelLinear", "RowParallelLinear", "linear_with_grad_accumulation_and_async_allreduce",
           "linear_with_frozen_weight")
_missing = [n for n in _NEEDED if not hasattr(_ml, n)]
if _missing:
    raise ImportError(f"zbpp.megatron.layers: megatron.core.tensor_parallel.layers has no {', '.join(_missing)} "
                      "(zbpp splits the layers of megatron-core 0.9 to 0.16)")
_custom_fwd = getattr(_ml, "custom_fwd", lambda f: f)
_custom_bwd = getattr(_ml, "custom_bwd", lambda f: f)


def _helper(name, fallback):
    found = getattr(_ml, name, None)
    return found if found is not None else fallback()


def _global_buffer_fallback():
    from megatron.core import parallel_state
    return parallel_state.get_global_memory_buffer


def _tp_group_fallback():
    from megatron.core import parallel_state
    return lambda group=None: group if group is not None else parallel_state.get_tensor_model_parallel_group()


_get_global_memory_buffer = _helper("get_global_memory_buffer", _global_buffer_fallback)
_all_gather = _helper("dist_all_gather_func", lambda: torch.distributed.all_gather_into_tensor)
_reduce_scatter = _helper("dist_reduce_scatter_func", lambda: torch.distributed.reduce_scatter_tensor)
_tp_group_if_none = _helper("get_tensor_model_parallel_group_if_none", _tp_group_fallback)

__all__ = ["classify", "is_megatron_linear", "is_split", "split_forward_impl", "split_layer", "unsplit_layer"]

_BASES = (_ml.ColumnParallelLinear, _ml.RowParallelLinear)
_BASE_IMPLS = tuple(getattr(c, "_forward_impl", None) for c in _BASES)
_MEGATRON_FUNCS = (_ml.linear_with_grad_accumulation_and_async_allreduce, _ml.linear_with_frozen_weight)


def _stores_impl(forward):
    """Whether a forward assigns self._forward_impl itself (megatron-core before 0.10 picks the
    function again in every forward), so an instance attribute would be overwritten."""
    try:
        return any(i.opname == "STORE_ATTR" and i.argval == "_forward_impl" for i in dis.get_instructions(forward))
    except TypeError:
        return False


_REASSIGNING = {b: _stores_impl(b.forward) for b in _BASES}
_SPLIT_CLASSES = {}  # Megatron layer class -> its subclass whose _forward_impl is zbpp's


class _SplitImpl:
    """The `_forward_impl` of a layer whose Megatron forward reassigns it each call: a data
    descriptor on a subclass made for the layer's class, so the layer runs zbpp's implementation
    whatever Megatron assigns (split_forward_impl itself dispatches frozen weights to Megatron's
    linear_with_frozen_weight, as that forward would)."""

    def __get__(self, obj, owner=None):
        return split_forward_impl

    def __set__(self, obj, value):
        if value not in _MEGATRON_FUNCS:
            raise AttributeError("zbpp: this Megatron linear layer is split; zbpp.megatron.layers.unsplit_layer(layer) "
                                 "gives it back Megatron's _forward_impl before another is set")


def _split_class(cls):
    made = _SPLIT_CLASSES.get(cls)
    if made is None:
        # A module-level name, so a pickled model (torch.save) finds the class again.
        name = f"Split{cls.__name__}"
        while name in globals():
            name += "_"
        made = type(name, (cls,), {"_forward_impl": _SplitImpl(), "_zbpp_split_of": cls, "__module__": __name__})
        globals()[name] = made
        _SPLIT_CLASSES[cls] = made
    return made

# The arguments of linear_with_grad_accumulation_and_async_allreduce this module implements.
_KNOWN_ARGS = {"input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad",
               "sequence_parallel", "grad_output_buffer", "wgrad_deferral_limit", "async_grad_allreduce",
               "tp_group"}
_SIGNATURE = inspect.signature(_ml.linear_with_grad_accumulation_and_async_allreduce)
# Arguments of a newer Megatron: with a default, a call that leaves them at it is split (one that
# does not runs Megatron's function); without one, no layer is split.
_NEW_ARGS = {n: p.default for n, p in _SIGNATURE.parameters.items()
             if n not in _KNOWN_ARGS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
_UNKNOWN_ARGS = sorted(n for n, d in _NEW_ARGS.items() if d is inspect.Parameter.empty)
_MISSING_ARGS = sorted({"input", "weight", "bias", "allreduce_dgrad", "sequence_parallel"}
                       - set(_SIGNATURE.parameters))


def is_megatron_linear(module):
    """Whether `module` is a Megatron ColumnParallelLinear or RowParallelLinear (or a subclass)."""
    return isinstance(module, _BASES)


def is_split(module):
    """Whether `module`'s forward runs zbpp's split implementation."""
    return (module.__dict__.get("_forward_impl") is split_forward_impl
            or type(module).__dict__.get("_zbpp_split_of") is not None)


def classify(layer):
    """(status, reason) of a Megatron linear layer: SPLIT (its W goes to the W store),
    FROZEN (its weight is frozen now: there is no weight gradient) or NOT_SPLIT."""
    weight = getattr(layer, "weight", None)
    if weight is not None and not weight.requires_grad:
        return FROZEN, ("weight frozen (requires_grad=False): no weight gradient to defer; Megatron's "
                               "linear_with_frozen_weight runs while it stays frozen")
    reason = _refusal(layer)
    if reason is not None:
        return NOT_SPLIT, reason
    if not is_split(layer):
        return NOT_SPLIT, "not converted (zbpp.split_linear converts it)"
    if weight is None:
        return SPLIT, "the weight is passed to forward (tied with the embedding)"
    reason = _unsupported_tensors(torch.empty(0, dtype=weight.dtype), weight)
    if reason is not None:
        return NOT_SPLIT, reason
    return SPLIT, ""


def split_layer(layer):
    """Installs the split implementation on a Megatron linear layer when it can be split; returns
    whether it is split now."""
    if not is_megatron_linear(layer):
        raise TypeError(f"zbpp: {type(layer).__name__} is not a Megatron ColumnParallelLinear or "
                        "RowParallelLinear")
    if is_split(layer):
        return True
    if _refusal(layer) is not None:
        return False
    base = next(b for b in _BASES if isinstance(layer, b))
    if _REASSIGNING[base]:
        # The forward would overwrite an instance attribute: the class is swapped for a subclass
        # (parameters, buffers, state dict keys and hooks stay; only the _forward_impl lookup changes).
        layer.__class__ = _split_class(type(layer))
    else:
        layer._forward_impl = split_forward_impl  # a plain function: not bound, nothing of the layer kept
    return True


def unsplit_layer(layer):
    """Gives a split layer back Megatron's own implementation."""
    original = type(layer).__dict__.get("_zbpp_split_of")
    if original is not None:
        layer.__class__ = original
    elif is_split(layer):
        del layer._forward_impl


def _refusal(layer):
    """Why `layer` cannot be split (a sentence), or None."""
    if _UNKNOWN_ARGS or _MISSING_ARGS:
        return (f"this megatron.core's linear_with_grad_accumulation_and_async_allreduce has arguments zbpp "
                f"does not know ({', '.join(_UNKNOWN_ARGS) or 'missing ' + ', '.join(_MISSING_ARGS)})")
    cls = type(layer).__dict__.get("_zbpp_split_of") or type(layer)
    base = next(b for b in _BASES if isinstance(layer, b))
    own = layer.__dict__.get("_forward_impl")
    if _REASSIGNING[base] and own is split_forward_impl:
        own = None  # (cannot happen through split_layer; an instance attribute it would overwrite)
    if own is not None and own is not split_forward_impl and own not in _MEGATRON_FUNCS:
        return "its _forward_impl was replaced by something else than Megatron's or zbpp's"
    if own is None and getattr(cls, "_forward_impl", None) not in _BASE_IMPLS:
        return f"{cls.__name__} overrides _forward_impl (or has none); zbpp replaces Megatron's only"
    if "_forward_impl" not in base.forward.__code__.co_names:
        return f"this megatron.core's {base.__name__}.forward does not call _forward_impl"
    forward = cls.forward
    names = set(getattr(getattr(forward, "__code__", None), "co_names", ()))
    if forward is not base.forward and not {"_forward_impl", "super"} & names:
        return f"{cls.__name__} has its own forward, which does not go through Megatron's"
    config = getattr(layer, "config", None)
    deferring = getattr(config, "defer_embedding_wgrad_compute", False)
    if deferring and getattr(layer, "grad_output_buffer", None) is not None:
        return ("defer_embedding_wgrad_compute: Megatron defers this layer's weight gradient itself (to the "
                "pipeline flush, through grad_output_buffer); turn it off to let zbpp schedule this W")
    weight = getattr(layer, "weight", None)
    if weight is not None and hasattr(weight, "__fsdp_param__"):
        return "Megatron-FSDP parameter (its main_grad is made during the backward)"
    return None


def split_forward_impl(input, weight, *args, **kwargs):
    """Megatron's `_forward_impl` with the weight gradient split off into a W (module docstring)."""
    if not weight.requires_grad:
        return _ml.linear_with_frozen_weight(input, weight, *args, **kwargs)
    bound = _SIGNATURE.bind(input, weight, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if a.get("grad_output_buffer") is not None or hasattr(weight, "__fsdp_param__"):
        return _ml.linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs)
    reason = _unsupported_tensors(input, weight)
    changed = [n for n, d in _NEW_ARGS.items() if _differs(a.get(n, d), d)]
    if reason is None and changed:
        reason = f"arguments zbpp does not know were given ({', '.join(changed)})"
    if reason is not None:
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"zbpp: a Megatron linear layer runs unsplit (its weight gradient in B): {reason}",
                          stacklevel=3)
        return _ml.linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs)
    if a.get("async_grad_allreduce") is not None:
        warnings.warn("async_grad_allreduce is deprecated, not in use anymore and will be fully removed "
                      "with 0.11.0. Please use allreduce_dgrad instead.")
    sequence_parallel = bool(a["sequence_parallel"])
    allreduce_dgrad = bool(a["allreduce_dgrad"])
    tp_group = a.get("tp_group")
    if sequence_parallel or allreduce_dgrad:
        tp_group = _tp_group_if_none(tp_group)
    return _SplitLinearWithAsyncCommunication.apply(
        input, weight, a["bias"], bool(a.get("gradient_accumulation_fusion", False)), allreduce_dgrad,
        sequence_parallel, tp_group)


_warned = set()


def _differs(value, default):
    if value is default:
        return False
    try:
        return bool(value != default)
    except Exception:  # noqa: BLE001 - e.g. a tensor against None: not the default
        return True


def _unsupported_tensors(input, weight):
    """Why W cannot take these tensors (a sentence), or None."""
    if _store.store_of(weight).kernel == _store.TORCH:  # torch's ops: any floating dtype, as Megatron's
        if not input.is_floating_point() or weight.dtype != input.dtype:
            return (f"the layer's input and weight must have one floating-point dtype, got {input.dtype} and "
                    f"{weight.dtype}")
        main = getattr(weight, "main_grad", None)
        if main is not None and not main.is_floating_point():
            return f"main_grad is {main.dtype}, not a floating-point tensor"
        return None
    if input.dtype not in _store.LIBRARY_DTYPES or weight.dtype != input.dtype:
        return (f"zbpp's W GEMM takes float32, float16 or bfloat16 inputs and weights of one dtype, got "
                f"{input.dtype} and {weight.dtype}")
    main = getattr(weight, "main_grad", None)
    if main is not None and main.dtype != torch.float32:
        return (f"main_grad is {main.dtype}: zbpp's W accumulates into float32 main_grad only (Megatron's "
                "--accumulate-allreduce-grads-in-fp32)")
    return None


class _SplitLinearWithAsyncCommunication(torch.autograd.Function):
    """LinearWithGradAccumulationAndAsyncCommunication with its weight-gradient GEMM as a W."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                tp_group):
        ctx.save_for_backward(input, weight)
        # The parameter itself too: under saved-tensor hooks (PipeOffload's capture, torch's
        # save_on_cpu) ctx.saved_tensors hands back a new tensor object, and W must write the
        # parameter's own .grad and main_grad.
        ctx.weight = weight
        # As Megatron: main_grad is kept on ctx (not saved) and put back on the weight in backward.
        ctx.main_grad = getattr(weight, "main_grad", None) if gradient_accumulation_fusion else None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.tp_group = tp_group
        if sequence_parallel:
            dim_size = list(input.size())
            dim_size[0] = dim_size[0] * tp_group.size()
            total_input = _get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
            _all_gather(total_input, input, group=tp_group)
        else:
            total_input = input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        input, _ = ctx.saved_tensors
        weight = ctx.weight
        if ctx.main_grad is not None:
            weight.main_grad = ctx.main_grad
        tp_group = ctx.tp_group
        wants_input = ctx.needs_input_grad[0]
        gather = None
        if ctx.sequence_parallel:
            # W reads the gathered input after this B: it gets memory of its own, not the shared buffer.
            dim_size = list(input.size())
            dim_size[0] = dim_size[0] * tp_group.size()
            total_input = torch.empty(dim_size, dtype=input.dtype, device=input.device)
            gather = _all_gather(total_input, input, group=tp_group, async_op=True)
        else:
            total_input = input
        grad_input = grad_output.matmul(weight) if wants_input else None
        if gather is not None:
            gather.wait()

        handle = None
        result = grad_input
        if wants_input and ctx.allreduce_dgrad:
            handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
        if wants_input and ctx.sequence_parallel:
            result = torch.empty(input.size(), dtype=input.dtype, device=input.device)
            handle = _reduce_scatter(result, grad_input, group=tp_group, async_op=True)

        # W: deferred (or run now when no pipeline captures), while the collective is in flight; on
        # the tensors Megatron's W reads (prepare_input_tensors_for_wgrad_compute: contiguous, rows).
        grad_output = grad_output.contiguous()
        layout = _megatron_layout(total_input.contiguous(), grad_output)
        fused = _fused_kernel() if ctx.gradient_accumulation_fusion else None
        grad_weight = None
        if fused is not None and getattr(weight, "main_grad", None) is not None:
            # Megatron's gradient_accumulation_fusion: its own kernel, into main_grad, at W.
            x2, dy2, main = layout.x2, layout.dy2, weight.main_grad
            _store.defer_action(lambda: _fused_accumulate(fused, x2, dy2, main), x2.device)
        elif _store.store_of(total_input).capturing:
            _store.defer_linear(layout.x2, layout.dy2, weight, None, layout)
        else:  # main_grad filled now, or the gradient returned to autograd (as Megatron without fusion)
            grad_weight, _ = _store.linear_grads(layout, weight, None)
        if grad_weight is None:
            grad_weight = _dummy_weight_grad(weight, input)

        grad_bias = None
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.view(-1, grad_output.shape[-1]).sum(dim=0)
        if handle is not None:
            handle.wait()
        return result, grad_weight, grad_bias, None, None, None, None


def _megatron_layout(total_input, grad_output):
    """The W of Megatron's layer without fusion, grad_output^T @ total_input over both viewed as
    rows (contiguous): as a _WLayout for zbpp's W (no bias: B returns Megatron's bias gradient)."""
    x2 = total_input.reshape(-1, total_input.shape[-1])
    dy2 = grad_output.reshape(-1, grad_output.shape[-1])
    return WLayout(x2, dy2, True, None, [0])


def _fused_kernel():
    """The module Megatron's gradient_accumulation_fusion calls (APEX's fused_weight_gradient_mlp_cuda,
    as Megatron imported it), or None: without it Megatron refuses fusion when it builds the layer,
    so a layer that got here with fusion runs the unfused W (torch's ops into main_grad)."""
    if not getattr(_ml, "_grad_accum_fusion_available", False):
        return None
    return getattr(_ml, "fused_weight_gradient_mlp_cuda", None)


def _fused_accumulate(kernel, x2, dy2, main_grad):
    """main_grad += dy2^T x2 by Megatron's fused kernel, as its backward calls it."""
    if main_grad.dtype == torch.float32:
        kernel.wgrad_gemm_accum_fp32(x2, dy2, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernel.wgrad_gemm_accum_fp16(x2, dy2, main_grad)
    else:
        raise RuntimeError(f"zbpp: gradient accumulation fusion takes a float32, float16 or bfloat16 main_grad; "
                           f"got {main_grad.dtype}")


def _dummy_weight_grad(weight, input):
    """What B returns for the weight: Megatron's DDP hook adds a returned gradient to main_grad
    unless grad_added_to_main_grad is set; W writes main_grad itself, so B returns a dummy and sets
    it (zeros when zero_out_wgrad: the hook then adds it, with any other use's gradient, e.g. the
    embedding's of a tied weight). Without DDP's attributes: None."""
    main = getattr(weight, "main_grad", None)
    if main is None or not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    dummy = make(main.shape, dtype=input.dtype, device=input.device)
    weight.grad_added_to_main_grad = True
    return dummy
