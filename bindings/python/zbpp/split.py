"""Split backward for torch.nn.Linear: B computes the input gradient, W runs later in C.

What this is: an autograd Function whose backward returns only the input gradient (and the bias
gradient is left to W too), and pushes the weight-gradient GEMM

    dW[out, in] += dY[rows, out]^T X[rows, in]     (fp32 accumulation; the paper's W pass)

into the C W store, with X and dY kept alive until the store says it has run or dropped the
entry. `split_linear(module)` turns every nn.Linear of a module into a `SplitLinear` in place (a
class swap: parameters, state dict, hooks and requires_grad are untouched, isinstance(m, nn.Linear)
stays true). Where the gradient lands: `param.main_grad` when the parameter has one (fp32, as
Megatron's do), else `param.grad` (fp32 parameters: accumulated in place; bf16/fp16 parameters: the
fp32 product is added to .grad in the parameter's dtype when W runs, as autograd would).

Outside a pipeline (no W store capturing), a SplitLinear's backward runs its W at once through the
same C GEMM, so `loss.backward()` fills every gradient as usual and a single-process run computes
the same bits as the pipeline. Inside a pipeline the runner opens a group per B and W pops it.

What this is not: a GEMM for GPUs yet (issue 5 plugs in cuBLASLt); other parametrised layers
(LayerNorm, Embedding, ...) keep autograd's fused backward, so their gradients arrive in B.
"""

import itertools
import threading

import torch
import torch.nn.functional as F

from . import runtime

__all__ = ["SplitLinear", "split_linear", "WGradStore", "default_store", "capture"]

_DTYPE = {torch.float32: runtime.DTYPES["float32"], torch.float16: runtime.DTYPES["float16"],
          torch.bfloat16: runtime.DTYPES["bfloat16"]}


class WGradStore:
    """A C W store with the tensors its entries read kept alive until their release.

    One per process is enough (`default_store()`); the pipeline's runner uses it too, so entries
    pushed during a B land in the group the runner opened for that B.
    """

    def __init__(self):
        self.backend = runtime.Backend("host")
        self._live = {}  # token -> (tensors kept alive, action after the GEMM ran or None)
        self._tokens = itertools.count(1)
        self.store = runtime.WStore(self.backend, self._release)
        self.immediate = runtime.WStore(self.backend, self._release)
        # A runner sets this while it is inside a backward callback: pushes then go to its group.
        self.capturing = False

    def _release(self, token, ran):
        keep, after = self._live.pop(token)
        if ran and after is not None:
            after()
        del keep

    def live_entries(self):
        """Entries pushed and not yet released (0 after every complete step)."""
        return len(self._live)

    def push_linear(self, x2, dy2, weight, bias, store=None):
        """Queues dW += dy2^T x2 (and db += sum(dy2)) for a Linear; x2 [rows, in], dy2 [rows, out]."""
        dtype = _DTYPE.get(x2.dtype)
        if dtype is None or dy2.dtype != x2.dtype:
            raise TypeError(f"zbpp: split Linear supports float32, float16 and bfloat16 inputs, got "
                            f"{x2.dtype} with gradient {dy2.dtype}")
        if x2.device.type != "cpu":
            raise NotImplementedError("zbpp: the W store runs on CPU tensors in this build; the CUDA "
                                      "backend (cuBLASLt) is not available yet")
        keep = [x2, dy2]
        after = []
        dw = _target(weight, keep, after)
        db = _target(bias, keep, after) if bias is not None and bias.requires_grad else None
        token = next(self._tokens)
        self._live[token] = (keep, _chain(after))
        try:
            (store or self.store).push(dtype, x2.shape[0], x2.shape[1], dy2.shape[1], x2.data_ptr(), x2.stride(0),
                            dy2.data_ptr(), dy2.stride(0), dw.data_ptr() if dw is not None else None,
                            db.data_ptr() if db is not None else None, token)
        except BaseException:
            self._live.pop(token, None)
            raise

    def close(self):
        self.store.close()
        self.immediate.close()
        self._live.clear()
        self.backend.close()


def _target(param, keep, after):
    """The fp32 buffer W accumulates into for `param`, and what to do once it has run."""
    if param is None or not param.requires_grad:
        return None
    main = getattr(param, "main_grad", None)
    if main is not None:
        if main.dtype != torch.float32 or not main.is_contiguous() or main.shape != param.shape:
            raise TypeError(f"zbpp: main_grad must be a contiguous float32 tensor shaped like its "
                            f"parameter {tuple(param.shape)}; got {main.dtype} {tuple(main.shape)}")
        keep.append(main)
        return main
    if param.dtype == torch.float32:
        if param.grad is None:
            param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        elif not param.grad.is_contiguous():
            param.grad = param.grad.contiguous()
        keep.append(param.grad)
        return param.grad
    # Half-precision parameter without main_grad: accumulate the product in fp32, then add it to
    # .grad in the parameter's dtype, as autograd does for each backward.
    tmp = torch.zeros(param.shape, dtype=torch.float32)
    keep.append(tmp)

    def add():
        g = tmp.to(param.dtype)
        if param.grad is None:
            param.grad = g
        else:
            param.grad.add_(g)

    after.append(add)
    return tmp


def _chain(actions):
    if not actions:
        return None

    def run():
        for a in actions:
            a()

    return run


_default = None
_default_lock = threading.Lock()


def default_store():
    """This process's W store (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = WGradStore()
        return _default


class capture:
    """Within `with capture(stage, mb):` split Linears queue their W work as one group of the
    default store instead of running it; `default_store().store.pop_run(stage)` runs it later.
    The runner does this itself; use it to drive a split model by hand."""

    def __init__(self, stage, mb):
        self.stage, self.mb = stage, mb

    def __enter__(self):
        st = default_store()
        if st.capturing:
            raise RuntimeError("zbpp: capture() is already active (a runner or another capture)")
        st.store.begin(self.stage, self.mb)
        st.capturing = True
        return st

    def __exit__(self, *exc):
        st = default_store()
        st.capturing = False
        st.store.end()


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.bias = bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        bias = ctx.bias
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        if weight.requires_grad or (bias is not None and bias.requires_grad):
            x2 = x.reshape(-1, x.shape[-1])
            dy2 = dy.reshape(-1, dy.shape[-1])
            x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
            dy2 = dy2 if dy2.stride(-1) == 1 else dy2.contiguous()
            st = default_store()
            if st.capturing:
                st.push_linear(x2, dy2, weight, bias)
            else:
                # No pipeline around: run W at once through the same GEMM, so plain
                # loss.backward() works and gives the pipeline's bits.
                _run_now(st, x2, dy2, weight, bias)
        return dx, None, None


def _run_now(st, x2, dy2, weight, bias):
    # A store of its own, so an immediate group never mixes with the groups a pipeline holds.
    st.immediate.begin(0, 0)
    try:
        st.push_linear(x2, dy2, weight, bias, st.immediate)
    finally:
        # Close and pop the group even when the push failed: an empty group left behind would be
        # popped by the next backward instead of its own.
        st.immediate.end()
        st.immediate.pop_run(0)


class SplitLinear(torch.nn.Linear):
    """nn.Linear whose backward defers the weight gradient to the W store (see module docstring)."""

    def forward(self, x):
        return _SplitLinearFn.apply(x, self.weight, self.bias)


def split_linear(module):
    """Turns every nn.Linear in `module` (itself included) into a SplitLinear, in place; returns it.

    Parameters, buffers, state dict keys, hooks and requires_grad are unchanged (the class is
    swapped, nothing is copied). Subclasses of nn.Linear with their own forward are left alone,
    since their forward may not be a plain linear map; they keep autograd's fused backward.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"zbpp.split_linear expects a torch.nn.Module, got {type(module).__name__}")
    for m in module.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = SplitLinear
    return module
