"""The W store of split layers: where a B puts the weight-gradient work that a W op runs later.

What this is: WGradStore, a C W store (zbpp.runtime.WStore: groups of entries, one group per B,
popped by a W op in B order) together with the tensors its entries read, kept alive until the store
says it has run or dropped the entry; one per device and process (`default_store(device)`), which
a pipeline's runner uses too. capture() opens a group by hand. The pushes a layer makes from its
backward: `defer_weight_grad(x, dy, weight, bias)`, the W of a linear map,

    dW[out, in] += dY[rows, out]^T X[rows, in]      db[out] += sum over rows of dY

into the group of the current B when a runner (or capture()) is capturing on the tensors' device,
at once otherwise; and `defer_action(fn, device)` for W work a layer keeps itself (Transformer
Engine's backward_dw, Megatron's fused kernel).

Which kernel runs a linear map's W is the store's `kernel`:

- "torch" (wherever libzbpp_torch.so loads, CPU and CUDA alike): the ops torch's autograd runs for
  nn.Linear's backward, in its order (zbpp::linear_wgrad, csrc/torch/linear_wgrad.cpp; the layout
  of the tensors it reads: zbpp._wlayout): dW = mm(dY2^T, X2) over the tensors as autograd's
  addmm/mm has them, the bias's sum_to, the dtype conversion autocast's casts add, then
  AccumulateGrad's .grad = g or .grad += g; main_grad += g as Megatron's DDP hook adds .grad to it.
  They run from C++ when the store releases the entry. Gradients are nn.Linear's (and Megatron's)
  bit for bit.
- "cblas" / "cublaslt": the C library's GEMM (the C-only path, and where libzbpp_torch.so is not
  built): fp32 accumulation straight into main_grad or an fp32 .grad; a half-precision .grad gets
  the product formed in fp32 and rounded once. Another summation order than torch's (about 1e-7
  relative in fp32).

Devices: CPU tensors use the host backend, CUDA tensors the device's CUDA backend, and every run,
torch's ops included, is issued on torch's current stream of the device. The caching allocator's
rule is kept: the store gives back an entry once its work is enqueued, and X and dY are then
dropped; that is safe when it ran on the stream they were used on at push time, and otherwise they
get record_stream(run stream) first, so their memory is not reused before W has read them. Work
pushed on one stream and run on another is ordered by making the run stream wait for the push
stream (as torch requires of any cross-stream use).

Counting: each WGradStore counts the W entries it ran (`gemms_run`) and dropped unrun
(`gemms_dropped`), immediate runs included; tests use them to check every split layer's W ran.

What this is not: a splitter. Which layers push here, and how, is zbpp.splitters' business.
"""

import itertools
import os
import threading

import torch

from . import _ops, cuda, runtime
from ._wlayout import WLayout, autograd_layout, dy_t_x

# store_of, defer_linear and linear_grads are for the layer splitters (zbpp.splitters), which give
# the layout of their tensors themselves.
__all__ = ["WGradStore", "default_store", "capture", "defer_weight_grad", "defer_action", "store_of",
           "defer_linear", "linear_grads", "TORCH", "CBLAS", "CUBLASLT", "ENV_KERNEL", "LIBRARY_DTYPES"]

_DTYPE = {torch.float32: runtime.DTYPES["float32"], torch.float16: runtime.DTYPES["float16"],
          torch.bfloat16: runtime.DTYPES["bfloat16"]}
LIBRARY_DTYPES = frozenset(_DTYPE)  # what the library's GEMM takes (the "torch" kernel: any floating dtype)

# Where a store's W GEMMs run (WGradStore.kernel): torch's own ops, or the C library's GEMM.
TORCH = "torch"
CBLAS = "cblas"
CUBLASLT = "cublaslt"
ENV_KERNEL = "ZBPP_WGRAD_KERNEL"
_NOW = 0  # push_linear's store for "run it now" (zbpp::linear_wgrad's store argument)
_U64 = (1 << 64) - 1


class WGradStore:
    """A C W store with the tensors its entries read kept alive until their release.

    One per device and process is enough (`default_store(device)`); the pipeline's runner uses it
    too, so entries pushed during a B land in the group the runner opened for that B.
    """

    def __init__(self, device=None, kernel=None):
        self.device = cuda.device_of(device) if device is not None else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        self.backend = cuda.backend_for(self.device) if self.is_cuda else runtime.Backend("host")
        self._live = {}  # token -> (tensors kept alive, action after the GEMM ran or None, push stream)
        # Entries zbpp::linear_wgrad pushed (the library keeps their tensors; on CUDA these are
        # kept here too, for record_stream at release): token -> (tensors, push stream or None).
        self._torch_live = {}
        self._kernel = None
        if kernel is None and os.environ.get(ENV_KERNEL):
            try:
                self.kernel = os.environ[ENV_KERNEL]
            except ValueError as exc:
                raise ValueError(f"${ENV_KERNEL}: {exc}") from None
        else:
            self.kernel = kernel
        self._tokens = itertools.count(1)
        self._run_stream = None  # CUDA: the stream the backend was last pointed at by prepare_run
        self._push_streams = {}  # CUDA: stream handle -> [stream, live entries pushed on it]
        before = self.prepare_run if self.is_cuda else None
        self.store = runtime.WStore(self.backend, self._release, before_run=before)
        self.immediate = runtime.WStore(self.backend, self._release, before_run=before)
        self._capturing = False
        self._scratch = None  # push_action's dw: see there
        self._add_scratches = {}  # (shape, dtype) -> the product of an added gradient (_push_torch)
        self._adds = {}  # token -> [(target, scratch)]: added after the entry ran (_release)
        # W GEMMs this store has run (released with ran) and dropped (cleared or closed unrun),
        # over both its stores (pipeline groups and immediate runs). Plain counters: read them,
        # or set them back to 0, between steps.
        self.gemms_run = 0
        self.gemms_dropped = 0
        # Called as hook(token) after each entry is released (run or dropped): how a caller learns
        # that the W work it is waiting for is done (zbpp.megatron starts gradient reduction so).
        self.release_hooks = []

    @property
    def kernel(self):
        """Where this store's linear-layer W runs: "torch" (torch's own ops, the ones autograd runs
        for nn.Linear's weight gradient, through libzbpp_torch.so's zbpp::linear_wgrad: gradients
        equal nn.Linear's and Megatron's bit for bit), or the C library's GEMM, "cblas" on the host
        and "cublaslt" on CUDA (the C-only path; another summation order). By default "torch"
        wherever libzbpp_torch.so loads, else the library's; $ZBPP_WGRAD_KERNEL or setting this
        (between steps, with nothing pending) chooses: "torch", "library" (the library's GEMM of
        this device), "cblas" or "cublaslt". W work a layer keeps itself (defer_action: Transformer
        Engine's, Megatron's fused accumulation) runs its own kernels either way."""
        return self._kernel

    @kernel.setter
    def kernel(self, name):
        library = CUBLASLT if self.is_cuda else CBLAS
        if name is None:
            name = TORCH if _ops.stable() is not None else library
            if name == library and _ops.stable_unavailable().endswith(_ops.MISSING):
                # A build without the torch ops (pip's build isolation hides torch from the build):
                # the split layers' W then sums in another order than torch's own backward.
                from ._notice import notice

                notice("no-torch-ops", f"zbpp: this installation has no {_ops.TORCH_LIB_NAME} (built by a Python "
                                       "without torch 2.10+, as pip's isolated build is), so split layers' weight gradients run "
                                       f"through the library's {library} GEMM, not torch's ops: equal to rounding, "
                                       "not bit for bit with torch. Reinstall with `pip install "
                                       "--no-build-isolation ...` to build it")
        if name == "library":
            name = library
        if name not in (TORCH, library):
            raise ValueError(f"zbpp: the W kernel of {self.device} is 'torch', 'library' or '{library}'; got {name!r}")
        if name == TORCH and _ops.stable() is None:
            raise ValueError(f"zbpp: the W kernel 'torch' needs libzbpp_torch.so: {_ops.stable_unavailable()}")
        if name != self._kernel and (self._live or self._torch_live):
            raise RuntimeError(f"zbpp: the W kernel of {self.device} cannot change while W entries are pending "
                               f"({len(self._live) + len(self._torch_live)}); change it between steps")
        self._kernel = name

    @property
    def capturing(self):
        """True while a runner is inside a backward callback (or capture() is active): pushes then
        go to its group. Setting it also binds this store to the device for the stable-ABI op
        zbpp::wgrad_deferred (_ops.py), when that library is loaded."""
        return self._capturing

    @capturing.setter
    def capturing(self, on):
        self._capturing = bool(on)
        key = self.device.index if self.is_cuda else _ops.CPU_KEY
        if self.is_cuda and key is None:
            key = torch.cuda.current_device()
        run = self._run_stream
        _ops.bind(key, self.store.handle if on else None, run.cuda_stream if (on and run is not None) else None)

    def prepare_run(self):
        """CUDA: points the backend at torch's current stream (GEMMs then run there) and makes that
        stream wait for the streams pending entries were pushed on. Called by pop_run from Python;
        a runner's owner calls it before zb_runner_run, whose W ops pop in C."""
        if not self.is_cuda:
            return None
        stream = cuda.use_current_stream(self.backend, self.device)
        for other, _count in self._push_streams.values():
            if other.cuda_stream != stream.cuda_stream:
                stream.wait_stream(other)
        self._run_stream = stream
        return stream

    def _release(self, token, ran):
        if token & _ops.TOKEN_BIT:  # pushed by a stable-ABI op, which keeps its tensors itself
            keep, pushed = self._torch_live.pop(token, ((), None))
            adds = self._adds.pop(token, None)
            after = None
            try:
                _ops.release(token, ran)  # zbpp::linear_wgrad's entries run torch's ops here
            except BaseException:
                self.gemms_dropped += 1
                if pushed is not None:
                    self._forget_push_stream(pushed)
                raise
            if ran and adds:
                for target, scratch in adds:
                    target.add_(scratch)
        else:
            keep, after, pushed = self._live.pop(token)
        if ran:
            self.gemms_run += 1
        else:
            self.gemms_dropped += 1
        if pushed is not None:
            self._forget_push_stream(pushed)
            run = self._run_stream
            # ran = 1 comes back once the GEMM is enqueued on the run stream. The tensors it reads
            # were last used on the push stream; when that is another stream, tell the caching
            # allocator, or their blocks could be handed out (on the push stream) before it ran.
            if ran and run is not None and run.cuda_stream != pushed.cuda_stream:
                for t in keep:
                    t.record_stream(run)
        if ran and after is not None:
            after()
        del keep
        if self.release_hooks:
            for hook in list(self.release_hooks):
                hook(token)

    def _forget_push_stream(self, stream):
        entry = self._push_streams.get(stream.cuda_stream)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._push_streams[stream.cuda_stream]

    def live_tokens(self):
        """The tokens of the entries pushed from Python (zbpp::linear_wgrad's included) and not yet
        released."""
        return set(self._live) | set(self._torch_live)

    def live_entries(self):
        """Entries pushed (from Python or by zbpp::wgrad_deferred) and not yet released (0 after
        every complete step)."""
        return len(self._live) + _ops.live(self.store.handle) + _ops.live(self.immediate.handle)

    def push_linear(self, x2, dy2, weight, bias, store=None, fresh=False, layout=None):
        """Queues dW += dy2^T x2 (and db += sum(dy2)) for a Linear; x2 [rows, in], dy2 [rows, out].
        weight or bias None (or not requiring grad): no gradient for it. store: the WStore whose
        open group gets the entry (default: self.store), or 0 to run it now.

        With the "torch" kernel the gradients are autograd's for F.linear over these x2 and dy2
        (`layout`, a zbpp._wlayout.WLayout, says how autograd's ops read them when they came from other shapes;
        see autograd_layout): torch's ops, run at W, accumulated as AccumulateGrad does.

        fresh=True (a backward that returns its gradients to autograd): a parameter without
        main_grad gets its gradient in a new tensor (the parameter's dtype with the "torch" kernel;
        fp32, or the parameter's dtype on CUDA's half path, with the library's) instead of .grad;
        returns (dw, db), those tensors or None, filled once W has run."""
        if self._kernel == TORCH:
            return self._push_torch(x2, dy2, weight, bias, store, fresh, layout)
        dy2 = _rows(dy2)
        dtype = _DTYPE.get(x2.dtype)
        if dtype is None or dy2.dtype != x2.dtype:
            raise TypeError(f"zbpp: split Linear supports float32, float16 and bfloat16 inputs, got "
                            f"{x2.dtype} with gradient {dy2.dtype}")
        if x2.device != self.device or dy2.device != self.device:
            raise ValueError(f"zbpp: the W store of {self.device} got tensors on {x2.device} and {dy2.device}; "
                             "use default_store(device) of the tensors' device")
        if weight is None or not weight.requires_grad:
            if bias is not None and bias.requires_grad:
                return None, self._push_bias_only(dy2, bias, store, fresh)
            return None, None
        x2 = _rows(x2)  # only the weight's GEMM reads x
        if self.is_cuda:
            return self._push_cuda(x2, dy2, weight, bias, dtype, store, fresh)
        keep = [x2, dy2]
        after = []
        dw = _target(weight, keep, after, fresh)
        # The host backend adds dy's rows one by one to db: into a zeroed buffer of its own, then
        # added to .grad, the sum is autograd's (old + this backward's), so a pipeline's W and a
        # plain backward (which returns db to autograd) give the same bits.
        db = _target(bias, keep, after, fresh, apart=True) if bias is not None and bias.requires_grad else None
        token = next(self._tokens)
        self._live[token] = (keep, _chain(after), None)
        try:
            (store or self.store).push(dtype, x2.shape[0], x2.shape[1], dy2.shape[1], x2.data_ptr(), x2.stride(0),
                            dy2.data_ptr(), dy2.stride(0), dw.data_ptr() if dw is not None else None,
                            db.data_ptr() if db is not None else None, token)
        except BaseException:
            self._live.pop(token, None)
            raise
        return _returned(weight, dw, fresh), _returned(bias, db, fresh)

    def _push_torch(self, x2, dy2, weight, bias, store, fresh, layout):
        """push_linear with the "torch" kernel: one zbpp::linear_wgrad entry (see its docstring)."""
        if not x2.is_floating_point() or dy2.dtype != x2.dtype:
            raise TypeError(f"zbpp: split Linear needs floating-point inputs of one dtype, got {x2.dtype} with "
                            f"gradient {dy2.dtype}")
        if x2.device != self.device or dy2.device != self.device:
            raise ValueError(f"zbpp: the W store of {self.device} got tensors on {x2.device} and {dy2.device}; "
                             "use default_store(device) of the tensors' device")
        if layout is None:
            layout = WLayout(x2, dy2, dy_t_x(weight), None, [0])
        w = weight if weight is not None and weight.requires_grad else None
        b = bias if bias is not None and bias.requires_grad else None
        if w is None and b is None:
            return None, None
        dw, dw_add = _torch_target(w, fresh)
        db, db_add = _torch_target(b, fresh)
        adds = None
        if not self.is_cuda and (dw_add or db_add):
            # An added gradient (autograd's in-place add to .grad, or main_grad +=): the op writes
            # the product into a scratch of the target's shape, and Python adds it in place after
            # the op ran (_release). The stable ABI has no in-place add, so the op would otherwise
            # make the sum in a new tensor and copy it back: an allocation and a pass over the
            # gradient more per entry, which showed in bench_torch's W ops. The scratch holds the
            # product in its own dtype (the inputs'), so the add rounds once, as the sum did (a
            # bf16 main_grad gets fp32 products added, as Megatron's hook adds .grad). One scratch
            # per shape and dtype serves every entry: entries run one at a time, each add right
            # after its product.
            adds = []
            if dw_add:
                adds.append((dw, self._add_scratch(dw, layout.x2.dtype)))
                dw, dw_add = adds[-1][1], False
            if db_add:
                adds.append((db, self._add_scratch(db, layout.dy2.dtype)))
                db, db_add = adds[-1][1], False
        handle = _NOW if store is _NOW else (store or self.store).handle.value
        pushed = None
        if self.is_cuda and handle != _NOW:
            pushed = torch.cuda.current_stream(self.device)
            run = self._run_stream
            if self.capturing and run is not None and run.cuda_stream != pushed.cuda_stream:
                run.wait_stream(pushed)  # as _push_cuda: the runner runs this W on its stream
        token = _ops.stable().linear_wgrad(layout.x2, layout.dy2, dw, db, layout.bias_of, layout.bias_dims,
                                           layout.dy_t_x, dw_add, db_add, handle)
        token &= _U64  # the op returns it as an int64; the store hands it back unsigned
        if adds:
            if token:
                self._adds[token] = adds
            else:  # ran within the call
                for target, scratch in adds:
                    target.add_(scratch)
        if token:
            if pushed is not None:
                self._torch_live[token] = ((layout.x2, layout.dy2, layout.bias_of), pushed)
                entry = self._push_streams.setdefault(pushed.cuda_stream, [pushed, 0])
                entry[1] += 1
            else:
                self._torch_live[token] = ((), None)
        else:
            self.gemms_run += 1
        return _returned(w, dw, fresh), _returned(b, db, fresh)

    def _add_scratch(self, target, dtype):
        key = (tuple(target.shape), dtype)
        got = self._add_scratches.get(key)
        if got is None:
            got = self._add_scratches[key] = torch.empty(target.shape, dtype=dtype, device=self.device)
        return got

    def push_action(self, action, keep=(), store=None):
        """Queues a W that is Python work, not a GEMM zbpp makes: `action()` runs when the entry's
        group is popped (a W op), in group order with the GEMM entries. For layers that keep their
        own weight-gradient work until told to run it (Transformer Engine's backward_dw). The entry
        is an empty GEMM (no rows) whose release runs the action; it counts in gemms_run. On CUDA the
        action runs when the W op is issued, with torch's current stream the run stream."""
        # The entry's GEMM is empty (no rows: it writes nothing), but it needs a dw pointer: one
        # scratch float per store serves every such entry.
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = torch.zeros(1, dtype=torch.float32, device=self.device)
        kept = list(keep)
        token = next(self._tokens)
        pushed = torch.cuda.current_stream(self.device) if self.is_cuda else None
        self._live[token] = (kept, action, pushed)
        if pushed is not None:
            entry = self._push_streams.setdefault(pushed.cuda_stream, [pushed, 0])
            entry[1] += 1
        try:
            (store or self.store).push(_DTYPE[torch.float32], 0, 1, 1, None, 1, None, 1, scratch.data_ptr(), None,
                                       token)
        except BaseException:
            self._live.pop(token, None)
            if pushed is not None:
                self._forget_push_stream(pushed)
            raise

    def _push_bias_only(self, dy2, bias, store, fresh=False):
        """A frozen weight with a trainable bias: no GEMM, only the bias's column sums, as W work
        in the same place in the group (what nn.Linear computes for it: dy summed over rows).
        Returns the fresh gradient tensor (see push_linear) or None."""
        keep, after = [dy2], []
        db = _target(bias, keep, after, fresh)
        then = _chain(after)

        def add_sums():
            db.add_(dy2.sum(0, dtype=torch.float32))
            if then is not None:
                then()

        self.push_action(add_sums, keep=keep, store=store)
        return _returned(bias, db, fresh)

    def _push_cuda(self, x2, dy2, weight, bias, dtype, store, fresh=False):
        has_db = bias is not None and bias.requires_grad
        # The entry's dw and db share one dw_dtype. The input dtype (bf16/fp16) written with
        # overwrite is used only when every target is a .grad of exactly that dtype: the GEMM then
        # sums in fp32 and rounds once, the same value the CPU path gets from its fp32 buffer and
        # .to(dtype). Anything else (main_grad, fp32 .grad, a mix) accumulates in fp32.
        targets = [weight] + ([bias] if has_db else [])
        half = dtype != _DTYPE[torch.float32] and all(
            p.requires_grad and getattr(p, "main_grad", None) is None and p.dtype == x2.dtype for p in targets)
        stream = torch.cuda.current_stream(self.device)
        keep = [x2, dy2]
        after = []
        if half:  # (weight.requires_grad holds here: half needs every target trainable)
            # With no rows the GEMM has nothing to write (the host backend returns early), so the
            # "product" must start as zeros there; otherwise every element is overwritten.
            empty = x2.shape[0] == 0
            dw = _fresh_half(weight, keep, after, empty, fresh)
            db = _fresh_half(bias, keep, after, empty, fresh) if has_db else None
        else:
            dw = _target(weight, keep, after, fresh)
            db = _target(bias, keep, after, fresh) if has_db else None
        token = next(self._tokens)
        self._live[token] = (keep, _chain(after), stream)
        entry = self._push_streams.setdefault(stream.cuda_stream, [stream, 0])
        entry[1] += 1
        run = self._run_stream
        if self.capturing and run is not None and run.cuda_stream != stream.cuda_stream:
            # A runner is active and will run this W on its stream from C (no prepare_run then):
            # order it after everything this push depends on.
            run.wait_stream(stream)
        try:
            (store or self.store).push(dtype, x2.shape[0], x2.shape[1], dy2.shape[1], x2.data_ptr(), x2.stride(0),
                                       dy2.data_ptr(), dy2.stride(0), dw.data_ptr(),
                                       db.data_ptr() if db is not None else None, token,
                                       dw_dtype=dtype if half else _DTYPE[torch.float32], overwrite=half)
        except BaseException:
            self._live.pop(token, None)
            self._forget_push_stream(stream)
            raise
        return _returned(weight, dw, fresh), (_returned(bias, db, fresh) if has_db else None)

    def close(self):
        self.store.close()
        self.immediate.close()
        self._live.clear()
        self._torch_live.clear()
        self._adds.clear()
        self._push_streams.clear()
        if not self.is_cuda:
            self.backend.close()  # the CUDA backend is the device's, shared (cuda.backend_for)


def _fresh_half(param, keep, after, zeros, fresh=False):
    """CUDA, bf16/fp16 parameter without main_grad: W writes the product (rounded once) into a fresh
    tensor of the parameter's dtype, which is then added to .grad as autograd would (or, fresh,
    returned to autograd, which adds it)."""
    make = torch.zeros if zeros else torch.empty
    tmp = make(param.shape, dtype=param.dtype, device=param.device)
    keep.append(tmp)
    if fresh:
        return tmp

    def add():
        if param.grad is None:
            param.grad = tmp
        else:
            param.grad.add_(tmp)

    after.append(add)
    return tmp


def _target(param, keep, after, fresh=False, apart=False):
    """The fp32 buffer W accumulates into for `param`, and what to do once it has run. For a
    parameter without main_grad, fresh: a new zero buffer, which the caller returns to autograd;
    apart: a new zero buffer added to .grad after W (.grad itself otherwise, when fp32)."""
    if param is None or not param.requires_grad:
        return None
    main = getattr(param, "main_grad", None)
    if main is not None:
        if main.dtype != torch.float32 or not main.is_contiguous() or main.shape != param.shape:
            raise TypeError(f"zbpp: main_grad must be a contiguous float32 tensor shaped like its "
                            f"parameter {tuple(param.shape)}; got {main.dtype} {tuple(main.shape)}")
        if main.device != param.device:
            raise TypeError(f"zbpp: main_grad is on {main.device} but its parameter on {param.device}")
        keep.append(main)
        return main
    if fresh:
        buf = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        keep.append(buf)
        return buf
    if param.dtype == torch.float32 and not apart:
        if param.grad is None:
            param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        elif not param.grad.is_contiguous():
            param.grad = param.grad.contiguous()
        keep.append(param.grad)
        return param.grad
    # Half-precision parameter without main_grad (or apart): accumulate the product in fp32, then
    # add it to .grad in the parameter's dtype, as autograd does for each backward.
    tmp = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    keep.append(tmp)

    def add():
        g = tmp.to(param.dtype)
        if param.grad is None:
            param.grad = g
        else:
            param.grad.add_(g)

    after.append(add)
    return tmp


def _torch_target(param, fresh):
    """Where zbpp::linear_wgrad puts `param`'s gradient, and whether it adds (else writes): .grad,
    made as zeros at the first push of a step, and every W adds into it, or main_grad += it
    (Megatron's DDP hook adds .grad to main_grad so), or a new tensor for a fresh backward to
    return to autograd. Every W adds (none writes): a stage's W ops may run in another order than
    its B ops pushed them (a schedule from CSV, or one the local search reordered), and the first
    to push need not be the first to run; a write would then drop what ran before it. Adding to
    zeros gives what autograd's first gradient gives (x + 0 == x)."""
    if param is None:
        return None, False
    main = getattr(param, "main_grad", None)
    if main is not None:
        if main.shape != param.shape or not main.is_floating_point() or main.device != param.device:
            raise TypeError(f"zbpp: main_grad must be a floating-point tensor shaped like its parameter "
                            f"{tuple(param.shape)} on {param.device}; got {main.dtype} {tuple(main.shape)} on "
                            f"{main.device}")
        return main, True
    if fresh:
        return torch.empty(param.shape, dtype=param.dtype, device=param.device), False
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad, True


def _returned(param, buf, fresh):
    """What a fresh push returns for `param`: its new gradient tensor, or None (no gradient, or it
    went to main_grad)."""
    if not fresh or buf is None or getattr(param, "main_grad", None) is not None:
        return None
    return buf


def _chain(actions):
    if not actions:
        return None

    def run():
        for a in actions:
            a()

    return run


_defaults = {}
_default_lock = threading.Lock()
_exit_registered = False


def default_store(device=None):
    """This process's W store for a device (created on first use); None means the CPU store."""
    key = "cpu" if device is None else str(torch.device(device))
    st = _defaults.get(key)
    if st is not None:
        return st
    global _exit_registered
    dev = cuda.device_of(device) if device is not None else torch.device("cpu")
    with _default_lock:
        st = _defaults.get(str(dev))
        if st is None:
            st = WGradStore(dev)
            if st.is_cuda and not _exit_registered:
                # The stores must be destroyed before the device backends they borrow.
                cuda.at_exit(_close_defaults)
                _exit_registered = True
            _defaults[str(dev)] = st
        # "cuda" (no index) follows the current device, so only exact names are remembered.
        return st


def _close_defaults():
    for st in {id(s): s for s in _defaults.values()}.values():
        st.close()
    _defaults.clear()


class capture:
    """Within `with capture(stage, mb):` split Linears queue their W work as one group of the
    default store instead of running it; `default_store().store.pop_run(stage)` runs it later.
    The runner does this itself; use it to drive a split model by hand. device: the store of that
    device (default: the CPU store); on CUDA, pop_run runs on torch's current stream then."""

    def __init__(self, stage, mb, device=None):
        self.stage, self.mb, self.device = stage, mb, device

    def __enter__(self):
        st = default_store(self.device)
        if st.capturing:
            raise RuntimeError("zbpp: capture() is already active (a runner or another capture)")
        st.store.begin(self.stage, self.mb)
        st.capturing = True
        return st

    def __exit__(self, *exc):
        st = default_store(self.device)
        st.capturing = False
        st.store.end()


def store_of(t):
    """The default store of a tensor's device."""
    return default_store(None if t.device.type == "cpu" else t.device)


def linear_grads(layout, weight, bias):
    """Outside a pipeline: the weight and bias gradients of a linear layer (its WLayout) for a
    backward to return to autograd, (dW, db); None for a parameter not given or with main_grad (its
    gradient is added there, Megatron's fused accumulation). With grad mode on (create_graph=True)
    they are differentiable torch ops, nn.Linear's own. Otherwise they come from the store's W, as a
    pipeline's: with the "torch" kernel the same ops, in the parameter's dtype; with the library's
    its GEMM, into new fp32 tensors (autograd rounds them to the parameter's dtype and adds them to
    .grad: what the pipeline's W adds; zbpp.splitters.linear's docstring)."""
    if weight is None and bias is None:
        return None, None
    x2, dy2 = layout.x2, layout.dy2
    st = store_of(x2)
    if not torch.is_grad_enabled():
        return _run_now(st, x2, dy2, weight, bias, fresh=True, layout=layout)
    fused = [p if p is not None and getattr(p, "main_grad", None) is not None else None for p in (weight, bias)]
    dw = db = None
    if weight is not None and fused[0] is None:
        dw = dy2.t().mm(x2) if layout.dy_t_x else x2.t().mm(dy2).t()
    if bias is not None and fused[1] is None:
        of = layout.bias_of if layout.bias_of is not None else dy2
        db = (of.sum(layout.bias_dims, keepdim=True) if layout.bias_dims else of).view(dy2.shape[-1])
    if fused[0] is not None or fused[1] is not None:
        of = layout.bias_of.detach() if layout.bias_of is not None else None
        flat = layout._replace(x2=x2.detach(), dy2=dy2.detach(), bias_of=of)
        _run_now(st, flat.x2, flat.dy2, *fused, layout=flat)
    return dw, db


def _rows(t):
    """t [rows, cols] as the W store reads it: row-major, a row's elements next to each other and
    rows at least a row apart (the leading dimension the store is given is stride(0)). Anything
    else is copied: a broadcast input (x.expand(...), stride 0) would otherwise make the GEMM read
    rows that are not there."""
    if t.shape[0] > 1 and t.stride(-1) == 1 and t.stride(0) >= t.shape[1]:
        return t
    return t.contiguous()


def defer_weight_grad(x, dy, weight, bias=None):
    """The W of a linear map y = x W^T (+ b), from inside its B: dW += dy^T x (and db += sum(dy)
    when bias is given) over x [..., in] and dy [..., out], into main_grad or .grad (see the module
    docstring). Pushed to the group of the current B when a runner (or capture()) is capturing on
    the tensors' device, run at once otherwise (still into main_grad or .grad: zbpp's own layers
    return their gradients to autograd there instead). x and dy are kept alive until W has run."""
    defer_linear(x, dy, weight, bias, autograd_layout(x, dy, weight, bias))


def defer_linear(x, dy, weight, bias, layout):
    """defer_weight_grad with autograd's layout of the tensors given (see autograd_layout), which
    the "torch" kernel follows; the library's GEMM reads x and dy flattened to rows."""
    x2, dy2 = layout.x2, layout.dy2
    st = store_of(x2)
    if st.capturing:
        st.push_linear(x2, dy2, weight, bias, layout=layout)
    else:
        # No pipeline around: run W at once through the same ops, so plain
        # loss.backward() works and gives the pipeline's bits.
        _run_now(st, x2, dy2, weight, bias, layout=layout)


def defer_action(action, device=None):
    """A W that is Python work (see WGradStore.push_action), from inside a B: pushed to the group of
    the current B when a runner (or capture()) is capturing on `device`, run at once otherwise."""
    st = default_store(None if device is None or torch.device(device).type == "cpu" else device)
    if st.capturing:
        st.push_action(action)
        return
    st.immediate.begin(0, 0)  # as _run_now: through the store, so it is counted the same way
    try:
        st.push_action(action, store=st.immediate)
    finally:
        st.immediate.end()
        st.immediate.pop_run(0)


def _run_now(st, x2, dy2, weight, bias, fresh=False, layout=None):
    if st.kernel == TORCH:  # zbpp::linear_wgrad runs it within the call
        return st.push_linear(x2, dy2, weight, bias, _NOW, fresh, layout)
    # A store of its own, so an immediate group never mixes with the groups a pipeline holds.
    st.immediate.begin(0, 0)
    try:
        return st.push_linear(x2, dy2, weight, bias, st.immediate, fresh)
    finally:
        # Close and pop the group even when the push failed: an empty group left behind would be
        # popped by the next backward instead of its own.
        st.immediate.end()
        st.immediate.pop_run(0)
