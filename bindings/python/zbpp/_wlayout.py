"""How torch's autograd reads a linear layer's tensors for its weight gradient (the W of F.linear).

What this is: the description zbpp::linear_wgrad (csrc/torch/linear_wgrad.cpp) needs to run the ops
autograd runs, in its order, for y = F.linear(x, weight, bias) with output gradient dy: which
[rows, in] and [rows, out] views its mm/addmm saw, which transpose mm_mat2_backward takes, and
what sum_to reduces for the bias. Layers that are not nn.Linear (Megatron's) build their own.
What this is not: the W itself (zbpp.wgrad_store pushes it; the library runs it).
"""

import os
from typing import NamedTuple

import torch

__all__ = ["WLayout", "autograd_layout", "dy_t_x"]


class WLayout(NamedTuple):
    """How autograd's backward of F.linear reads a layer's tensors for W (csrc/torch/linear_wgrad.cpp):
    x2 and dy2 as its mm/addmm has them, [rows, in] and [rows, out]; dy_t_x: dW = dy2^T x2 (else
    (x2^T dy2)^T: a weight whose transpose is not column-major); the bias gradient: bias_of (None:
    dy2) summed over bias_dims, kept, viewed [out]."""
    x2: torch.Tensor
    dy2: torch.Tensor
    dy_t_x: bool
    bias_of: object
    bias_dims: list


def dy_t_x(weight):
    """mm_mat2_backward's choice for mat2 = weight.t(): dy2^T x2 when weight.t() is column-major."""
    return weight is None or weight.dim() != 2 or (weight.stride(1) == 1 and weight.stride(0) == weight.shape[1])


_FLATTEN_3D = os.environ.get("TORCH_LINEAR_FLATTEN_3D", "") in ("1", "ON", "on", "true", "True")


def autograd_layout(x, dy, weight, bias):
    """The WLayout of y = F.linear(x, weight, bias) with output gradient dy, as torch's at::linear
    builds its graph: a 2-d input, or a contiguous one with a 1-d contiguous bias, goes through
    addmm(bias, x2, W^T) on x viewed [rows, in] (its bias gradient: dy2 summed over rows); any other
    input through matmul(x, W^T), which folds x into the same x2 (a copy when no view fits), plus
    the bias added in place (its gradient: dy summed over every leading dimension)."""
    fin, fout = x.shape[-1], dy.shape[-1]
    flat = True
    if x.dim() != 2:
        flat = bias is not None and bias.dim() == 1 and bias.is_contiguous() and x.is_contiguous()
        if bias is not None and not flat and x.dim() == 3 and _FLATTEN_3D:
            x, flat = x.contiguous(), True  # torch's TORCH_LINEAR_FLATTEN_3D
        x = x.reshape(-1, fin)
        dy = dy.reshape(-1, fout) if flat else dy
    dy2 = dy if flat else dy.reshape(-1, fout)
    if flat or bias is None:
        return WLayout(x, dy2, dy_t_x(weight), None, [0])
    return WLayout(x, dy2, dy_t_x(weight), dy, list(range(dy.dim() - 1)))
