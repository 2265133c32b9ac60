"""Boundary buffers: how a stage's output tensors are described, packed and checked.

What this is: the helpers the schedule uses to describe an activation ((dtype, shape) per tensor),
lay it out in one runner buffer (16-byte aligned), view a buffer as typed tensors, send a
description as 64 numbers (shape inference), and the errors for metadata that does not fit
(torch's PipeliningMetadataError).
What this is not: the transfers themselves (the C runner's, or _agree.py's for set-up messages).
"""

import ctypes
import re

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
            raise _metadata_error(TypeError)(f"zbpp: stage {stage} must return tensors (or a tuple of them) to "
                                             f"pass to the next stage; got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise _metadata_error(TypeError)(f"zbpp: stage {stage} returns a {t.dtype} tensor; allowed: "
                                             + ", ".join(str(d) for d in _DTYPES))
        meta.append((t.dtype, tuple(t.shape)))
    return meta


def _itemsize(dtype):
    return dtype.itemsize


def _layout(meta):
    """Byte offsets of each tensor in a boundary buffer and its total size."""
    key = tuple(meta)
    got = _LAYOUTS.get(key)
    if got is None:
        offsets, size = [], 0
        for dtype, shape in meta:
            size = (size + _ALIGN - 1) // _ALIGN * _ALIGN
            offsets.append(size)
            n = 1
            for d in shape:
                n *= d
            size += n * _itemsize(dtype)
        got = _LAYOUTS[key] = (offsets, size)
        if len(_LAYOUTS) > 4096:  # shapes that change every microbatch: keep the cache bounded
            _LAYOUTS.clear()
            _LAYOUTS[key] = got
    return got


# Layouts by metadata (a tuple of (dtype, shape) pairs): computed once per boundary and per shape,
# since the per-op path asks for them at every forward and backward.
_LAYOUTS = {}


def _buffer(addr, nbytes):
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device="cpu")
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
        out.append(raw[off:off + n * _itemsize(dtype)].view(dtype).view(shape))
    return out


def _encode(meta):
    enc = [len(meta)]
    for dtype, shape in meta:
        enc += [_DTYPES.index(dtype), len(shape), *shape]
    if len(enc) > _META_LEN:
        raise ValueError(f"zbpp: a stage output with {len(meta)} tensors is too large to describe "
                         f"(at most {_META_LEN} numbers of metadata)")
    return torch.tensor(enc + [0] * (_META_LEN - len(enc)), dtype=torch.int64, device="cpu")


def _decode(t):
    v = t.tolist()
    n, k, meta = v[0], 1, []
    for _ in range(n):
        dtype, ndim = _DTYPES[v[k]], v[k + 1]
        meta.append((dtype, tuple(v[k + 2:k + 2 + ndim])))
        k += 2 + ndim
    return meta




_ERRORS = {}


def _torch_metadata_error():
    try:
        from ._utils import PipeliningMetadataError
    except ImportError:  # a torch without torch.distributed.pipelining
        return RuntimeError
    return PipeliningMetadataError


def _metadata_error(base=ValueError):
    """The error for boundary metadata zbpp cannot carry or that changed (a stage's output that is
    not tensors, a dtype the runner cannot send, a shape that differs from the boundary's): torch's
    PipeliningMetadataError, as a class that is also `base` (the ValueError or TypeError zbpp
    raised before, so `except ValueError` still catches it)."""
    key = ("PipeliningMetadataError", base)
    if key not in _ERRORS:
        _ERRORS[key] = type("PipeliningMetadataError", (_torch_metadata_error(), base),
                            {"__module__": "zbpp.pipelining"})
    return _ERRORS[key]


def _shape_error():
    """The error for a boundary whose shape or dtype changed: torch's PipeliningShapeError (its
    PipeliningMetadataError on a torch that has only that name), also a ValueError."""
    key = ("PipeliningShapeError", ValueError)
    if key not in _ERRORS:
        try:
            from ._utils import PipeliningShapeError as base
        except ImportError:
            base = RuntimeError
        _ERRORS[key] = type("PipeliningShapeError", (base, ValueError), {"__module__": "zbpp.pipelining"})
    return _ERRORS[key]


# What a rank that did not fail itself raises when the first failure (published by the rank where
# it happened, _agree.py) was a metadata error: the error it got (the ZbError of the failure path,
# or the RuntimeError of a closed pipeline at its next step) as a PipeliningMetadataError too, so
# `except PipeliningMetadataError` catches it on every rank. The published text names the type
# ("rank 0 failed first: F(stage 0, mb 3) at step 2: PipeliningShapeError: ...").
_PEER_FAILURE = re.compile(r"failed first: [^:]*: (PipeliningShapeError|PipeliningMetadataError): ")


def _as_metadata_error(err, failed):
    """err (a ZbError or RuntimeError this rank got because of the pipeline's first failure,
    `failed` as published) as a PipeliningMetadataError when that failure was one; None when it
    was not, or err is one already."""
    base = _torch_metadata_error()
    if isinstance(err, base) or not failed or not _PEER_FAILURE.search(failed):
        return None
    from .._lib import ZbError

    if isinstance(err, ZbError):
        key = ("peer", ZbError)
        if key not in _ERRORS:
            _ERRORS[key] = type("PipeliningMetadataError", (ZbError, base), {"__module__": "zbpp.pipelining"})
        made = _ERRORS[key](err.code, err.message, err.name)
    else:
        made = _metadata_error(RuntimeError)(*err.args)
    return made.with_traceback(err.__traceback__)


_DIFFERENT_SIZES = ("microbatches of different sizes (a batch that does not split evenly) run only when every "
                    "stage is on one rank: between ranks the runner's buffers have one size per boundary")


class _BoundaryBuffers:
    """PipelineSchedule's side of the runner's boundary buffers (a mixin): checking what a stage
    returns against its boundary, lending outputs to the runner without a copy, and viewing the
    runner's buffers as tensors.

    Shapes per microbatch: a boundary's buffers are sized once, from microbatch 0 at shape
    inference, and a boundary that crosses ranks must keep that shape and dtype. A boundary inside
    this rank may change shape from one microbatch to the next (a batch that torch.tensor_split
    cut into sizes 22, 21, 21 on a one-rank pipeline): the output is lent to the runner as it is,
    with its own layout, and the next stage takes those very tensors (_in_views), so nothing is
    sized from microbatch 0; the gradient goes back the same way."""

    def _check_boundary(self, s, i, outs):
        """Raises torch's metadata error (_shape_error) for stage s's output of microbatch i when
        its boundary cannot carry it."""
        meta = self._meta[s]
        got = _meta_of(outs, s)
        if got == meta:
            return
        local = self.schedule.stage_rank(s + 1) == self.rank
        same_dtypes = [d for d, _ in got] == [d for d, _ in meta]
        if local and self._lending and same_dtypes:
            return  # handed to this rank's next stage as it is (the class docstring)
        what = "dtype mismatch" if not same_dtypes else "shape mismatch"
        hint = "shapes and dtypes must not change"
        if same_dtypes and not local:
            hint = _DIFFERENT_SIZES
        elif same_dtypes:
            hint = ("shapes may change only where the runner hands tensors on as they are, not with a custom "
                    "OVERLAP_F_B function (its pairs copy through buffers of one size)")
        raise _shape_error()(f"zbpp: stage {s} {what}: it returned {[(str(d), sh) for d, sh in got]} for "
                             f"microbatch {i}, but the boundary was set up for "
                             f"{[(str(d), sh) for d, sh in meta]}; {hint}")

    def _lend(self, boundary, tensors, inputs=()):
        """Hands the runner this op's output for `boundary` without a copy: the tensor itself when
        the output is one contiguous tensor, else one buffer they are packed into (a copy each),
        and a copy too when the output is the op's input (a stage that passes its input on), whose
        memory may be the runner's. Laid out as the tensors are (their shapes may differ from the
        boundary's on this rank, see the class docstring). Kept alive here until the runner
        releases it."""
        t0 = tensors[0] if len(tensors) == 1 else None
        if t0 is not None and t0.is_contiguous() and not _shares_storage(t0, inputs):
            keep, typed = t0, [t0]
            size = t0.numel() * _itemsize(t0.dtype)  # one tensor: its layout is itself
        else:
            own = [(t.dtype, tuple(t.shape)) for t in tensors]
            _, size = _layout(own)
            keep = torch.empty(size, dtype=torch.uint8, device=self.device if self._cuda else "cpu")
            typed = _typed(keep, own)
            for view, t in zip(typed, tensors):
                view.copy_(t)
        token = next(self._lend_ids)
        addr = keep.data_ptr() if size else 0
        self._runner.lend_output(addr, token)  # recorded only once the runner has it
        self._lent[token] = (keep, typed, addr)
        if addr:
            self._lent_at[addr] = typed

    def _release_lent(self, token):
        """The runner is done with a lent buffer: its send has finished, or the stage of this rank
        that took it as input has run its W."""
        keep, typed, addr = self._lent.pop(token, (None, None, 0))
        if addr and self._lent_at.get(addr) is typed:
            del self._lent_at[addr]

    def _in_views(self, addr, boundary):
        """An op's input: the tensors this rank lent for it (a stage of this rank produced it), or
        views of the runner's buffer."""
        lent = self._lent_at.get(addr) if addr else None
        return lent if lent is not None else self._views(addr, boundary)

    def _views(self, addr, boundary):
        """Typed tensors over a runner buffer of `boundary` (host memory, or device memory wrapped
        as CUDA tensors: every copy in and out then runs on torch's current stream, the runner's
        compute stream)."""
        meta = self._meta[boundary]
        if self._dviews is None:
            # The runner's buffers live as long as it does and are reused op after op, so the views
            # over one are made once (per boundary and metadata: a new shape inference makes new ones).
            key = (addr, boundary)
            got = self._host_views.get(key)
            if got is None or got[0] is not meta:
                got = self._host_views[key] = (meta, _views(addr, meta))
            return got[1]
        dv = self._dviews
        return dv.get(addr, boundary, lambda a: _typed(dv.buffer(a, _layout(meta)[1]), meta))
