"""The fused path of PostValidatedOptimizer: the library's norm and AdamW/SGD kernels (zb_sq_norm,
zb_optim_step, zb_optim_undo) in place of torch's optimizer step and a snapshot.

What this is: for a torch.optim.AdamW or SGD whose options the kernels implement, each step reads
the gradients where they are (fp32 main_grad, or .grad in the parameter's dtype: bf16 and fp16 are
widened inside the kernel), computes each stage's squared norm and inf/NaN flag with one zb_sq_norm
per stage and dtype, and steps the fp32 master weights with one zb_optim_step per parameter group
and gradient dtype, which first writes what it changes into an undo buffer. A step the full
gradient state refutes is undone bit for bit (zb_optim_undo) and redone with the right factor. No
gradient, parameter or optimizer state is copied per step: the undo buffer, 12 bytes per element
for AdamW (8 for SGD with momentum, 4 without), is the only extra memory, made once; with
undo_memory="host" it is pinned host memory that the kernel writes over the bus (device memory
free of it). On CUDA the kernels run on torch's current stream; on the CPU the same calls run the C
reference (the host backend), which is what the tests without a GPU exercise.

The state lives in the wrapped optimizer's `state` under torch's own keys (AdamW: step, exp_avg,
exp_avg_sq; SGD: momentum_buffer, plus _zbpp_step, the count torch's SGD does not keep), so
state_dict() and load_state_dict() carry it, step counts included, and a resumed run steps as the
uninterrupted one (tests/python/test_optim_checkpoint.py). commit() gives AdamW's step a new
tensor rather than adding to it in place: torch's load_state_dict hands the loaded dict's step
tensors to the optimizer as they are, and an in-place count would change the dict it came from.

What this is not: torch's kernels. The update follows torch.optim.AdamW and SGD (foreach=False),
to rounding; the fused and unfused paths of this wrapper each equal their own synchronous path bit
for bit, not each other.
"""

from typing import Any, NamedTuple

import torch

from . import cuda, runtime

__all__ = ["FusedStep", "fusable"]


class _Call(NamedTuple):
    """One zb_optim_step of a step: its lists, and the tensors whose addresses they hold."""
    key: Any
    op: Any
    backend: Any
    step: int
    masters: list
    device: Any
    keep: list


def _why_not(optimizer):
    """None when the kernels implement `optimizer` as it is configured, else why not."""
    kind = type(optimizer)
    if kind is torch.optim.AdamW:
        for g in optimizer.param_groups:
            for key in ("amsgrad", "maximize", "capturable", "differentiable"):
                if g.get(key):
                    return f"AdamW with {key}=True"
            if isinstance(g.get("betas", (0, 0))[0], torch.Tensor):
                return "AdamW with tensor betas"
        return None
    if kind is torch.optim.SGD:
        for g in optimizer.param_groups:
            if g.get("nesterov"):
                return "SGD with nesterov=True"
            if g.get("dampening", 0):
                return "SGD with dampening"
            if g.get("maximize") or g.get("differentiable"):
                return "SGD with maximize or differentiable"
        return None
    return f"{kind.__name__} (the kernels implement torch.optim.AdamW and SGD)"


def fusable(optimizer):
    return _why_not(optimizer) is None


def check(optimizer):
    why = _why_not(optimizer)
    if why is not None:
        raise ValueError(f"zbpp.PostValidatedOptimizer(fused=True): the fused kernels cannot run {why}; "
                         "pass fused=False to step with the optimizer itself")


class FusedStep:
    """Steps `optimizer`'s fp32 master parameters with the library's kernels. masters: the fp32
    parameters the optimizer holds (as PostValidatedOptimizer maps them)."""

    def __init__(self, optimizer, undo_memory="device"):
        check(optimizer)
        if undo_memory not in ("device", "host"):
            raise ValueError(f"zbpp.PostValidatedOptimizer: undo_memory must be 'device' or 'host', got {undo_memory!r}")
        self.optimizer = optimizer
        self.kind = "adamw" if type(optimizer) is torch.optim.AdamW else "sgd"
        self.undo_memory = undo_memory
        self._undo = {}  # op key -> uint8 buffer, kept between steps

    # ---- the norm ------------------------------------------------------------------------------

    @staticmethod
    def stage_state(grads, S, counted=None):
        """Per stage: (squared norm, inf/NaN flag) of its gradients, by zb_sq_norm per dtype and
        device, read to the host in one copy per device."""
        import ctypes

        sq = (ctypes.c_double * S)()
        bad = (ctypes.c_int32 * S)()
        pending = {}  # device -> [(stage, sq tensor, flag tensor)]
        for s, row in grads.items():
            by = {}
            for master, g in row:
                if g is None or (counted is not None and not counted(master)):
                    continue
                by.setdefault((g.device, g.dtype), []).append(g if g.is_contiguous() else g.contiguous())
            for (dev, _), ts in sorted(by.items(), key=lambda kv: str(kv[0])):
                v, f = cuda.sq_norm(ts)
                pending.setdefault(dev, []).append((s, v, f))
        for items in pending.values():
            sums = torch.cat([v for _, v, _ in items]).cpu().tolist()
            flags = torch.cat([f for _, _, f in items]).cpu().tolist()
            for (s, _, _), v, f in zip(items, sums, flags):
                sq[s] += v
                if f:
                    bad[s] = 1
        return sq, bad

    # ---- the step ------------------------------------------------------------------------------

    def _state(self, master):
        st = self.optimizer.state[master]
        if self.kind == "adamw":
            if "exp_avg" not in st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            return [st["exp_avg"]], [st["exp_avg_sq"]], int(st["step"])
        # SGD keeps no step count; a momentum buffer means a step was taken (a zero buffer, from a
        # skipped first step, makes step 2's formula give step 1's result).
        return [], [], st.get("_zbpp_step", 1 if st.get("momentum_buffer") is not None else 0)

    def plan(self, grads):
        """The calls of one step, one per parameter group, device, gradient dtype and step count,
        over the masters that have a gradient (a parameter without one this step is left alone, as
        torch does, and may then be a step behind its group: it gets a call of its own)."""
        grad_of = {id(m): g for row in grads.values() for m, g in row if g is not None}
        calls = []
        for gi, group in enumerate(self.optimizer.param_groups):
            momentum = float(group.get("momentum", 0.0)) if self.kind == "sgd" else 0.0
            by = {}
            for m in group["params"]:
                g = grad_of.get(id(m))
                if g is None:
                    continue
                s1, s2, steps = self._state(m)
                if self.kind == "sgd" and momentum != 0:
                    # The momentum buffer exists from the first step on (the kernel sets it to the
                    # gradient then); made here so the kernel has somewhere to write it.
                    st = self.optimizer.state[m]
                    if st.get("momentum_buffer") is None:
                        st["momentum_buffer"] = torch.zeros_like(m, memory_format=torch.contiguous_format)
                    s1 = [st["momentum_buffer"]]
                by.setdefault((m.device, g.dtype, steps), []).append((m, g.contiguous(), s1, s2))
            for (dev, gdtype, steps), items in sorted(by.items(), key=lambda kv: str(kv[0])):
                masters = [m for m, _, _, _ in items]
                grads_now = [g for _, g, _, _ in items]  # kept in the call: the kernels read them
                s1 = [t for _, _, a, _ in items for t in a]
                s2 = [t for _, _, _, b in items for t in b]
                betas = group.get("betas", (0.9, 0.999))
                op = runtime.OptimStep(
                    self.kind, cuda.tensor_pairs(masters, "params", dev, torch.float32),
                    cuda.tensor_pairs(grads_now, "grads", dev, gdtype),
                    cuda.tensor_pairs(s1, "state", dev), cuda.tensor_pairs(s2, "state", dev),
                    grad_dtype=cuda._dtype_name(gdtype, "gradients"), lr=float(group["lr"]), momentum=momentum,
                    beta1=float(betas[0]), beta2=float(betas[1]), eps=float(group.get("eps", 1e-8)),
                    weight_decay=float(group.get("weight_decay", 0.0)))
                calls.append(_Call((gi, str(dev), str(gdtype), steps), op, cuda.backend_for(dev), steps + 1,
                                   masters, dev, grads_now + s1 + s2))
        return calls

    def _undo_buffer(self, key, op, dev):
        n = op.undo_bytes()
        buf = self._undo.get(key)
        if buf is None or buf.numel() != n:
            pinned = self.undo_memory == "host" and dev.type == "cuda"
            buf = torch.empty(n, dtype=torch.uint8, device="cpu" if pinned else dev, pin_memory=pinned)
            self._undo[key] = buf
        return buf

    def run(self, calls, factor, undoable):
        for c in calls:
            cuda.use_current_stream(c.backend, c.device)
            undo = self._undo_buffer(c.key, c.op, c.device).data_ptr() if undoable else None
            c.op.run(c.backend, c.step, factor, undo)

    def undo(self, calls):
        for c in reversed(calls):
            cuda.use_current_stream(c.backend, c.device)
            c.op.undo(c.backend, self._undo[c.key].data_ptr(), step=c.step)

    def commit(self, calls):
        """Counts the step that stands in the optimizer's state."""
        for c in calls:
            step, masters = c.step, c.masters
            for m in masters:
                st = self.optimizer.state[m]
                if self.kind == "adamw":
                    st["step"] = torch.tensor(float(step))
                else:
                    st["_zbpp_step"] = step

    def undo_bytes(self):
        return sum(b.numel() for b in self._undo.values())
