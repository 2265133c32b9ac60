"""Boundary buffers: how a stage's output tensors are described, packed and split.

What this is: the helpers the schedule uses to describe an activation ((dtype, shape) per tensor),
lay it out in one runner buffer (16-byte aligned), view a buffer as typed tensors, send a
description as 64 numbers (shape inference), and split a batch into microbatches along dim 0.
What this is not: the transfers themselves (the C runner's, or _agree.py's for set-up messages).
"""

import ctypes

import torch

_META_TAG = 1 << 20  # shape inference messages; the runner's channels use small tags
_META_LEN = 64
_ALIGN = 16
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _meta_of(tensors, stage):
    meta = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"zbpp: stage {stage} must return tensors (or a tuple of them) to pass to "
                            f"the next stage; got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"zbpp: stage {stage} returns a {t.dtype} tensor; allowed: "
                            + ", ".join(str(d) for d in _DTYPES))
        meta.append((t.dtype, tuple(t.shape)))
    return meta


def _layout(meta):
    """Byte offsets of each tensor in a boundary buffer and its total size."""
    offsets, size = [], 0
    for dtype, shape in meta:
        size = (size + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets.append(size)
        n = 1
        for d in shape:
            n *= d
        size += n * torch.empty((), dtype=dtype).element_size()
    return offsets, size


def _buffer(addr, nbytes):
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)


def _shares_storage(t, others):
    """Whether tensor t lives in the memory of any tensor of `others`."""
    try:
        mine = t.untyped_storage().data_ptr()
        return any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() == mine for o in others)
    except (RuntimeError, AttributeError):  # a tensor without storage (meta, some subclasses)
        return False


def _views(addr, meta):
    return _typed(_buffer(addr, _layout(meta)[1]), meta)


def _typed(raw, meta):
    """Typed, shaped views of a uint8 buffer laid out by _layout."""
    offsets, _ = _layout(meta)
    out = []
    for (dtype, shape), off in zip(meta, offsets):
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        out.append(raw[off:off + nbytes].view(dtype).view(shape))
    return out


def _encode(meta):
    enc = [len(meta)]
    for dtype, shape in meta:
        enc += [_DTYPES.index(dtype), len(shape), *shape]
    if len(enc) > _META_LEN:
        raise ValueError(f"zbpp: a stage output with {len(meta)} tensors is too large to describe "
                         f"(at most {_META_LEN} numbers of metadata)")
    return torch.tensor(enc + [0] * (_META_LEN - len(enc)), dtype=torch.int64)


def _decode(t):
    v = t.tolist()
    n, k, meta = v[0], 1, []
    for _ in range(n):
        dtype, ndim = _DTYPES[v[k]], v[k + 1]
        meta.append((dtype, tuple(v[k + 2:k + 2 + ndim])))
        k += 2 + ndim
    return meta



_SHAPE_ERROR = []


def _shape_error():
    """The error for a boundary whose shape or dtype changed: torch's PipeliningShapeError (its
    PipeliningMetadataError on a torch that has only that name), also a ValueError."""
    if not _SHAPE_ERROR:
        try:
            from ._utils import PipeliningShapeError as base
        except ImportError:
            base = RuntimeError
        _SHAPE_ERROR.append(type("PipeliningShapeError", (base, ValueError), {"__module__": "zbpp.pipelining"}))
    return _SHAPE_ERROR[0]


def _split(value, m, what):
    """Splits a tensor (dim 0) or a tuple/list/dict of them into m microbatches; other values are
    handed to every microbatch unchanged."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % m != 0:
            size = "a scalar" if value.dim() == 0 else f"batch size {value.shape[0]}"
            raise ValueError(f"zbpp: {what} has {size}, which does not split into n_microbatches={m} "
                             f"equal microbatches along dim 0; make the batch a multiple of {m}")
        return list(value.chunk(m, dim=0))
    if isinstance(value, (tuple, list)):
        parts = [_split(v, m, f"{what}[{i}]") for i, v in enumerate(value)]
        return [type(value)(p[i] for p in parts) for i in range(m)]
    if isinstance(value, dict):
        parts = {k: _split(v, m, f"{what}[{k!r}]") for k, v in value.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(m)]
    return [value] * m

