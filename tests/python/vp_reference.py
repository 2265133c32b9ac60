#!/usr/bin/env python3
"""Record the per-rank pass order of the Vocabulary Parallelism reference 1F1B schedule, for
test_vocab_schedule.py's parity test (zbpp's 1f1b with vocab= against it, op for op).

The reference function `forward_backward_pipelining_with_vocab_parallel` (file
megatron/core/pipeline_parallel/vocab_parallel_schedule.py of sail-sg/VocabularyParallelism)
is read from a checkout (use_reference(path); $ZBPP_VP_REF in the test) and exec'd
*byte-for-byte unmodified*; nothing of it is kept in this repository.  Its `import torch` and
`from megatron... import X` statements are redirected (custom __import__ in the exec globals)
to stubs defined here:

  * torch          -> FakeTorch: tensors are `Fake` objects carrying a provenance tag
                      (kind, microbatch); streams/nvtx are no-ops; torch.distributed
                      broadcast/all_reduce are *recorders* (collective events).
  * parallel_state -> rank / world size taken from the current simulated rank.
  * forward_step / backward_step -> recorders (pass events).  The pass kind is given by the
                      model chunk (model[0]=stage F/B, [1]=lm head S/T, [2]=input emb IF/IB,
                      [3]=loss L) and the microbatch by `current_microbatch` / the tag of
                      the output tensor being back-propagated.
  * p2p wrappers (recv_forward, send_forward, ...) -> recorders with the same first/last
                      stage semantics as megatron/core/pipeline_parallel/p2p_communication.py.
  * get_args()     -> disable_backward_fusion, profile=False, schedule_timer_* chosen so that
                      the profiled branch (ScheduleTimers.joint_conclusion) is taken and
                      run_timer is False.
  * ScheduleTimers.joint_conclusion() -> [[[f, b, 0, c]]]  (the reference reads
                      conclusion[0][0][0], [0][0][1], [0][0][3]).

Every event is recorded at the moment the real code would execute it (host issue order):
  F<i>/B<i>/S<i>/T<i>/IF<i>/IB<i>/L<i> when forward_step/backward_step is called,
  i.e. IF at input_embedding_forward_step_helper() time, IB when the callback returned by
  input_embedding_backward_step_helper() is invoked; BC<k> when the broadcast is issued
  (receive_lm_head_input() on non-last ranks, broadcast_lm_head_input() on the last rank),
  RED_IF<i> when the IF callback is invoked, BC_IB<i> when input_embedding_backward_step_helper
  is called, RED_S<k>/RED_T<k> when reduce_lm_head_res_alg{1,2} issues its all-reduces.

Besides recording, the stubs check data provenance (e.g. that B<i> on the last rank consumes
the grad produced by S<i>/T<i>, that F<i> on rank 0 consumes the reduced IF<i>, ...) and the
cross-rank consistency of collective order on the lm-head group and p2p matching.

Usage:
  python vp_reference.py --reference PATH              # run the full grid, write orders.json
  python vp_reference.py --reference PATH --show 4 8 1 2 1 fused [--full]   # one configuration
"""
import argparse
import builtins
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import traceback
import types

REF_PATH = "megatron/core/pipeline_parallel/vocab_parallel_schedule.py"
FN_NAME = "forward_backward_pipelining_with_vocab_parallel"
OUT_DIR = os.getcwd()


# --------------------------------------------------------------------------------------
# Per-rank simulation context
# --------------------------------------------------------------------------------------
class Ctx:
    def __init__(self, p, rank, m, f, b, c, fused):
        self.p, self.rank, self.m = p, rank, m
        self.f, self.b, self.c = f, b, c
        self.fused = fused
        self.args = types.SimpleNamespace(
            disable_backward_fusion=not fused,
            profile=False,
            enable_vocab_parallel=True,
            # iter_counter becomes 1: >= end+1 (profiled f/b/c used), != end+1, != end+6,
            # run_timer = (end+5 >= 1 >= start) is False.
            schedule_timer_start=100,
            schedule_timer_end=-10,
        )
        self.events = []        # main list
        self.full = []          # with p2p, sub-collectives and reference line numbers
        self.coll = []          # collective ops on the lm-head group, for cross-rank check
        self.p2p = []           # list of groups; group = list of (kind, src, dst)
        self.violations = []
        self.n_recv_f = 0
        self.n_recv_b = 0
        self.sched_locals = None
        self.vin_fwd = []       # VocabInputStore.forward_cache
        self.vin_bwd = []       # VocabInputStore.backward_cache
        self.vout_mb = 0        # VocabOutputStore.microbatch_id

    @property
    def first(self):
        return self.rank == 0

    @property
    def last(self):
        return self.rank == self.p - 1


CTX = None


def _main_line():
    """Line of the reference schedule body (FN_NAME frame) currently executing."""
    fr = sys._getframe(1)
    while fr is not None and fr.f_code.co_name != FN_NAME:
        fr = fr.f_back
    return fr.f_lineno if fr is not None else -1


def _ref_line():
    """Innermost line inside the reference file."""
    fr = sys._getframe(1)
    while fr is not None and fr.f_code.co_filename != REF_PATH:
        fr = fr.f_back
    return fr.f_lineno if fr is not None else -1


def ev(name, main=True):
    if main:
        CTX.events.append(name)
    CTX.full.append(f"{name}@{_main_line()}")


def check(cond, msg):
    if not cond:
        CTX.violations.append(f"rank {CTX.rank}: {msg} (ref line {_ref_line()})")


def tag(x):
    if isinstance(x, list):
        x = x[0]
    return getattr(x, "tag", None)


# --------------------------------------------------------------------------------------
# Fake tensors
# --------------------------------------------------------------------------------------
class Fake:
    __slots__ = ("tag",)

    def __init__(self, tag=None):
        self.tag = tag

    def __repr__(self):
        return f"Fake{self.tag}"

    # value-preserving views / copies keep the provenance tag
    def _same(self, *a, **k):
        return Fake(self.tag)

    clone = detach = to = contiguous = transpose = unsqueeze = float = _same

    def __getitem__(self, idx):
        return Fake(self.tag)

    def __setitem__(self, idx, v):
        pass

    # in-place ops keep the object
    def _inplace(self, *a, **k):
        return self

    requires_grad_ = mul_ = exp_ = div_ = add_ = sub_ = _inplace
    __iadd__ = __isub__ = __imul__ = __itruediv__ = _inplace

    def _new(self, *a, **k):
        return Fake(None)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _new

    def record_stream(self, s):
        pass

    def retain_grad(self):
        pass

    def cuda(self):
        return self

    def item(self):
        return 0

    @property
    def shape(self):
        return (4, 2, 8)

    def dim(self):
        return 3

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]


class Handle:
    def wait(self):
        pass


class _Stream:
    def wait_stream(self, s):
        pass


class _Module:
    pass


def _pair_event(label, op):
    """A reduction the reference issues as a pair, MAX then SUM: the MAX is the event (the
    barrier's start), the SUM its second half. Returns the label recorded."""
    if op == "MAX":
        ev(label)
        return label
    ev(label + ".sum", main=False)
    return label + ".sum"


def _empty(shape, *a, **k):
    fr = sys._getframe(1)
    name = fr.f_code.co_name
    if name == "receive_lm_head_input":
        return Fake(("BC", fr.f_locals["microbatch_id"]))
    if name == "input_embedding_backward_step_helper":
        return Fake(("BC_IB", fr.f_locals["microbatch_id"]))
    CTX.violations.append(f"rank {CTX.rank}: unexpected torch.empty in {name}")
    return Fake(None)


# ---- collectives (lm-head group) -----------------------------------------------------
def _broadcast(tensor, src, group=None, async_op=False):
    fr = sys._getframe(1)
    name = fr.f_code.co_name
    loc = fr.f_locals
    if name in ("broadcast_lm_head_input", "receive_lm_head_input"):
        k = loc["microbatch_id"]
        check(src == CTX.p - 1, f"BC{k} root {src}")
        if name == "broadcast_lm_head_input":
            check(CTX.last, "broadcast_lm_head_input on non-last rank")
            m = CTX.m
            if k < m:
                check(tag(loc["output_tensor"]) == ("F", k),
                      f"BC{k}: lm-head input is {tag(loc['output_tensor'])}, expected F{k}")
            if k > 0:
                check(tag(loc["grad_output"]) == ("Lgrad", k - 1),
                      f"BC{k}: grad is {tag(loc['grad_output'])}, expected loss grad of {k-1}")
        else:
            check(not CTX.last, "receive_lm_head_input broadcast on last rank")
        label = f"BC{k}"
        ev(label)
    elif name == "input_embedding_backward_step_helper":
        k = loc["microbatch_id"]
        check(src == 0, f"BC_IB{k} root {src}")
        label = f"BC_IB{k}.bcast"
        if CTX.first:
            check(tag(tensor) == ("B", k), f"BC_IB{k}: rank0 sends {tag(tensor)}, expected grad of B{k}")
        ev(label, main=False)
    else:
        label = f"?bcast:{name}"
        CTX.violations.append(f"rank {CTX.rank}: unexpected broadcast in {name}")
        ev(label, main=False)
    CTX.coll.append(("broadcast", src, label))
    return Handle()


def _all_reduce(tensor, op="SUM", group=None, async_op=False):
    fr = sys._getframe(1)
    name = fr.f_code.co_name
    qual = fr.f_code.co_qualname
    loc = fr.f_locals
    if name == "reduce_lm_head_res_alg1":
        k = loc["microbatch_id"]
        if loc.get("grad_input") is not None and tensor is loc["grad_input"]:
            check(tag(tensor) == ("T", k - 1), f"RED_T{k-1}: tensor {tag(tensor)}")
            label = f"RED_T{k-1}"
            ev(label)
        else:
            check(tag(tensor) == ("S", k), f"RED_S{k}: tensor {tag(tensor)}")
            label = _pair_event(f"RED_S{k}", op)
    elif name == "reduce_lm_head_res_alg2":
        k = tag(loc["logits_max"])[1]
        check(tag(tensor) == ("S", k), f"RED_S{k} (alg2): tensor {tag(tensor)}")
        label = _pair_event(f"RED_S{k}", op)
    elif name == "callback" and "input_embedding_forward_step_helper" in qual:
        t = tag(loc["reduced_output_tensor"])
        check(t is not None and t[0] == "IF", f"RED_IF reduces {t}")
        # comm_wait_tensor's all-reduce (MAX) is the first op of the pair
        label = _pair_event(f"RED_IF{t[1]}", op)
    elif name == "input_embedding_backward_step_helper":
        k = loc["microbatch_id"]
        label = f"BC_IB{k}"       # comm_wait_tensor all-reduce, first op of the pair
        ev(label)
    else:
        label = f"?allreduce:{qual}"
        CTX.violations.append(f"rank {CTX.rank}: unexpected all_reduce in {qual}")
        ev(label, main=False)
    CTX.coll.append(("all_reduce", op, label))
    return Handle()


def _unsupported(*a, **k):
    raise RuntimeError("unsupported torch call in stubbed reference (sequence_parallel path?)")


FakeTorch = types.SimpleNamespace(
    nn=types.SimpleNamespace(Module=_Module),
    int="int", int32="int32", float32="float32", float16="float16", bfloat16="bfloat16",
    tensor=lambda *a, **k: Fake(None),
    Tensor=lambda *a, **k: Fake(None),
    empty=_empty,
    cat=lambda ts, *a, **k: Fake(tag(ts[0])),
    log=lambda x: Fake(tag(x)),
    cuda=types.SimpleNamespace(
        Stream=lambda *a, **k: _Stream(),
        current_stream=lambda *a, **k: _Stream(),
        stream=lambda s: contextlib.nullcontext(),
        current_device=lambda: 0,
        memory_allocated=lambda: 0,
        nvtx=types.SimpleNamespace(range_push=lambda *a: None, range_pop=lambda *a: None),
    ),
    distributed=types.SimpleNamespace(
        broadcast=_broadcast,
        all_reduce=_all_reduce,
        all_gather_into_tensor=_unsupported,
        get_rank=lambda: CTX.rank,
        barrier=lambda *a, **k: None,
        ReduceOp=types.SimpleNamespace(MAX="MAX", SUM="SUM"),
    ),
)


# --------------------------------------------------------------------------------------
# megatron stubs
# --------------------------------------------------------------------------------------
class Model:
    def __init__(self, kind):
        self.kind = kind


MODELS = [Model("F"), Model("S"), Model("IF"), Model("L")]

CONFIG = types.SimpleNamespace(
    overlap_p2p_comm=False,
    finalize_model_grads_func=None,
    timers=None,
    no_sync_func=None,
    grad_sync_func=None,
    num_microbatches_with_partial_activation_checkpoints=None,
    pipeline_dtype="bfloat16",
    deallocate_pipeline_outputs=False,
    variable_seq_lengths=False,
    sequence_parallel=False,
    calculate_per_token_loss=False,
)


class parallel_state:
    @staticmethod
    def get_pipeline_model_parallel_world_size():
        return CTX.p

    @staticmethod
    def get_pipeline_model_parallel_rank():
        return CTX.rank

    @staticmethod
    def is_pipeline_first_stage(ignore_virtual=False):
        return CTX.rank == 0

    @staticmethod
    def is_pipeline_last_stage(ignore_virtual=False):
        return CTX.rank == CTX.p - 1

    @staticmethod
    def get_pipeline_model_parallel_last_rank():
        return CTX.p - 1

    @staticmethod
    def get_pipeline_model_parallel_first_rank():
        return 0

    @staticmethod
    def get_lm_head_model_parallel_group():
        return "lm_head_group"

    @staticmethod
    def set_virtual_vocab_parallel_chunk(chunk):
        pass

    @staticmethod
    def get_tensor_model_parallel_world_size():
        return 1

    @staticmethod
    def get_tensor_model_parallel_rank():
        return 0

    @staticmethod
    def get_tensor_model_parallel_group():
        return "tp_group"


class ScheduleTimers:
    iter_counter = 0
    sync_timer = True

    @classmethod
    def joint_conclusion(cls, *a, **k):
        return [[[CTX.f, CTX.b, 0, CTX.c]]]

    @classmethod
    def for_chunk(cls, i):
        raise RuntimeError("run_timer should be False in the simulation")


class VocabInputStore:
    """Same semantics as megatron/core/tensor_parallel/vocab_input_store.py, per simulated rank."""

    @classmethod
    def forward_store(cls, output_tensor, handle):
        CTX.vin_fwd.append((output_tensor, handle))

    @classmethod
    def forward_get(cls, remove=True):
        output_tensor, handle = CTX.vin_fwd[0]   # IndexError exactly where the real one fails
        if remove:
            CTX.vin_fwd.pop(0)
        else:
            CTX.vin_fwd[0] = (output_tensor, None)
        return output_tensor

    @classmethod
    def backward_store(cls, grad_output):
        CTX.vin_bwd.append(grad_output)

    @classmethod
    def backward_get(cls):
        return CTX.vin_bwd.pop(0)


class _VOSMeta(type):
    @property
    def microbatch_id(cls):
        return CTX.vout_mb

    @microbatch_id.setter
    def microbatch_id(cls, v):
        CTX.vout_mb = v


class VocabOutputStore(metaclass=_VOSMeta):
    """The lm-head model's forward stores its results under microbatch_id; forward_get
    returns them.  Fakes tagged ('S', microbatch_id)."""

    @classmethod
    def forward_get(cls):
        return tuple(Fake(("S", CTX.vout_mb)) for _ in range(6))

    @classmethod
    def backward_store(cls, sum_exp_logits, logits_max, grad_output):
        pass


def _caller_locals(name):
    fr = sys._getframe(2)
    while fr is not None and fr.f_code.co_name != name:
        fr = fr.f_back
    return fr.f_locals if fr is not None else {}


def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                 forward_data_store, config, collect_non_loss_data=False,
                 checkpoint_activations_microbatch=None, is_first_microbatch=False,
                 current_microbatch=None, encoder_decoder_xattn=False, skip_loss_compute=False,
                 force_loss_compute=False, run_timer=False):
    kind = model.kind
    k = current_microbatch
    assert isinstance(input_tensor, list)
    if kind == "F":
        if CTX.first:
            # the embedding layer pops the all-reduced IF output (language_model_embedding.py:122)
            got = VocabInputStore.forward_get()
            check(tag(got) == ("IF", k), f"F{k} on rank 0 consumes {tag(got)}")
        else:
            check(tag(input_tensor) == ("RF", k), f"F{k} input is {tag(input_tensor)}")
    elif kind == "S":
        exp = ("F", k) if CTX.last else ("BC", k)
        check(tag(input_tensor) == exp, f"S{k} input is {tag(input_tensor)}, expected {exp}")
    elif kind == "L":
        loc = _caller_locals("loss_calculation_helper")
        check(tag(loc.get("sum_exp_logits")) == ("S", k) and tag(loc.get("predicted_logits")) == ("S", k),
              f"L{k} uses reduce store of {tag(loc.get('sum_exp_logits'))}")
    ev(f"{kind}{k}")
    return [Fake((kind, k))], Fake(None)


_BWD = {"F": "B", "S": "T", "IF": "IB", "L": "Lgrad"}


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config,
                  run_timer=False):
    kind, k = tag(output_tensor)
    bk = _BWD[kind]
    g = tag(output_tensor_grad)
    if bk == "B":
        if CTX.last:
            exp = ("S", k) if CTX.fused else ("T", k)
        else:
            exp = ("RB", k)
        check(g == exp, f"B{k} output grad is {g}, expected {exp}")
        if CTX.first:
            check(tag(input_tensor) == ("IF", k), f"B{k} rank-0 stored input is {tag(input_tensor)}")
        else:
            check(tag(input_tensor) == ("RF", k), f"B{k} stored input is {tag(input_tensor)}")
    elif bk == "T":
        exp = ("Lgrad", k) if CTX.last else ("BC", k + 1)
        check(g == exp, f"T{k} grad is {g}, expected {exp}")
        loc = _caller_locals("lm_head_step_helper")
        check(tag(loc.get("sum_exp_logits")) == ("S", k) and tag(loc.get("logits_max")) == ("S", k),
              f"T{k} uses reduced stats of {tag(loc.get('sum_exp_logits'))}")
    elif bk == "IB":
        exp = ("B", k) if CTX.first else ("BC_IB", k)
        check(g == exp, f"IB{k} grad is {g}, expected {exp}")
    if bk == "Lgrad":
        ev(f"Lb{k}", main=False)
    else:
        ev(f"{bk}{k}")
    return [None if x is None else Fake((bk, k)) for x in input_tensor]


# ---- p2p (semantics of p2p_communication.py: no-ops at first/last stage) -------------
def _p2p(ops, name):
    CTX.p2p.append(ops)
    ev(name, main=False)


def recv_forward(tensor_shapes, config):
    if CTX.first:
        return [VocabInputStore.forward_get(remove=False)]
    n = CTX.n_recv_f
    CTX.n_recv_f += 1
    _p2p([("recv", CTX.rank - 1, CTX.rank)], f"RF{n}")
    return [Fake(("RF", n))]


def recv_backward(tensor_shapes, config):
    if CTX.last:
        return [None]
    n = CTX.n_recv_b
    CTX.n_recv_b += 1
    _p2p([("recv", CTX.rank + 1, CTX.rank)], f"RB{n}")
    return [Fake(("RB", n))]


def send_forward(output_tensors, tensor_shapes, config, wait_on_reqs=True):
    if not CTX.last:
        t = tag(output_tensors)
        _p2p([("send", CTX.rank, CTX.rank + 1)], f"SF{t[1]}")
    return []


def send_backward(input_tensor_grads, tensor_shapes, config):
    if not CTX.first:
        t = tag(input_tensor_grads)
        _p2p([("send", CTX.rank, CTX.rank - 1)], f"SB{t[1]}")


def send_forward_recv_backward(output_tensors, tensor_shapes, config):
    if CTX.last:
        return [None]
    t = tag(output_tensors)
    n = CTX.n_recv_b
    CTX.n_recv_b += 1
    _p2p([("send", CTX.rank, CTX.rank + 1), ("recv", CTX.rank + 1, CTX.rank)], f"SF{t[1]}+RB{n}")
    return [Fake(("RB", n))]


def send_backward_recv_forward(input_tensor_grads, tensor_shapes, config):
    if CTX.first:
        return [VocabInputStore.forward_get(remove=False)]
    t = tag(input_tensor_grads)
    n = CTX.n_recv_f
    CTX.n_recv_f += 1
    _p2p([("send", CTX.rank, CTX.rank - 1), ("recv", CTX.rank - 1, CTX.rank)], f"SB{t[1]}+RF{n}")
    return [Fake(("RF", n))]


def get_tensor_shapes(**kw):
    # Called right after is_bsf/offsets/num_warmup_s_pass/num_warmup_microbatches are computed:
    # snapshot them from the reference frame instead of re-implementing the FSM.
    if CTX.sched_locals is None:
        loc = _caller_locals(FN_NAME)
        CTX.sched_locals = {
            key: (list(loc[key]) if isinstance(loc[key], list) else loc[key])
            for key in ("f", "b", "c", "is_bsf", "offsets", "num_warmup_s_pass",
                        "num_warmup_microbatches", "num_microbatches_remaining",
                        "first_stage_num_warmup_microbatches")
        }
    return [(4, 2, 8)]


STUB = types.SimpleNamespace(
    parallel_state=parallel_state,
    forward_step=forward_step,
    backward_step=backward_step,
    get_tensor_shapes=get_tensor_shapes,
    check_first_val_step=lambda first_val_step, forward_only, cond: cond,
    deallocate_output_tensor=lambda out, deallocate_pipeline_outputs=False: None,
    recv_forward=recv_forward,
    send_forward=send_forward,
    recv_backward=recv_backward,
    send_backward=send_backward,
    send_forward_recv_backward=send_forward_recv_backward,
    send_backward_recv_forward=send_backward_recv_forward,
    clear_embedding_activation_buffer=lambda config, model: None,
    bootstrap_and_profile_p2p_communication=lambda *a, **k: None,
    finish_embedding_wgrad_compute=lambda *a, **k: None,
    ScheduleTimers=ScheduleTimers,
    VocabOutputStore=VocabOutputStore,
    VocabInputStore=VocabInputStore,
    get_model_config=lambda model: CONFIG,
    get_model_type=lambda model: "encoder_or_decoder",
    get_model_xattn=lambda model: False,
    get_args=lambda: CTX.args,
)


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    if name == "torch" or name.startswith("torch."):
        return FakeTorch
    if name.startswith("megatron"):
        return STUB
    return builtins.__import__(name, globals, locals, fromlist, level)


# --------------------------------------------------------------------------------------
# Load the reference
# --------------------------------------------------------------------------------------
def load_reference(checkout):
    with open(os.path.join(checkout, REF_PATH)) as fh:
        src = fh.read()
    try:
        commit = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "(not a git checkout)"
    bdict = dict(builtins.__dict__)
    bdict["__import__"] = _import
    g = {"__name__": "vp_ref_schedule", "__builtins__": bdict}
    exec(compile(src, REF_PATH, "exec"), g)
    return g[FN_NAME], commit, hashlib.sha256(src.encode()).hexdigest()


REF_FN = REF_COMMIT = REF_SHA = None


def use_reference(checkout):
    """Loads the reference schedule from a VocabularyParallelism checkout."""
    global REF_FN, REF_COMMIT, REF_SHA
    REF_FN, REF_COMMIT, REF_SHA = load_reference(checkout)


def run_rank(p, rank, m, f, b, c, fused):
    global CTX
    CTX = Ctx(p, rank, m, f, b, c, fused)
    ScheduleTimers.iter_counter = 0
    ScheduleTimers.sync_timer = True
    err = None
    try:
        REF_FN(forward_step_func=None, data_iterator=None, model=list(MODELS),
               num_microbatches=m, seq_length=4, micro_batch_size=2)
    except Exception as e:  # record where the reference itself fails
        tb = traceback.extract_tb(e.__traceback__)
        ref = [fr for fr in tb if fr.filename == REF_PATH]
        where = f"line {ref[-1].lineno}" if ref else "stub"
        err = f"{type(e).__name__}: {e} at {where}"
    if err is None:
        check(not CTX.vin_fwd, f"VocabInputStore forward cache not drained: {[tag(t) for t, _ in CTX.vin_fwd]}")
        check(not CTX.vin_bwd, f"VocabInputStore backward cache not drained: {[tag(t) for t in CTX.vin_bwd]}")
    return CTX, err


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------
def per_rank_checks(ctx, m):
    out = []
    ev_ = ctx.events
    for kind in ("F", "B", "S", "T", "IF", "IB"):
        ids = [int(e[len(kind):]) for e in ev_ if e.startswith(kind) and e[len(kind):].isdigit()]
        if ids != list(range(m)):
            out.append(f"rank {ctx.rank}: {kind} ids {ids}")
    lids = [int(e[1:]) for e in ev_ if e[0] == "L" and e[1:].isdigit()]
    if ctx.last and lids != list(range(m)):
        out.append(f"rank {ctx.rank}: L ids {lids}")
    if not ctx.last and lids:
        out.append(f"rank {ctx.rank}: loss on non-last rank")
    pos = {e: i for i, e in enumerate(ev_)}
    for i in range(m):
        # intra-rank dependencies
        deps = [(f"IF{i}", f"RED_IF{i}"), (f"F{i}", f"B{i}"), (f"S{i}", f"RED_S{i}"),
                (f"S{i}", f"T{i}"), (f"BC_IB{i}", f"IB{i}"), (f"IF{i}", f"IB{i}")]
        if ctx.first:
            deps += [(f"RED_IF{i}", f"F{i}"), (f"B{i}", f"BC_IB{i}")]
        if ctx.last:
            deps += [(f"F{i}", f"S{i}"), (f"RED_S{i}", f"L{i}"), (f"L{i}", f"B{i}")]
            deps += [(f"RED_T{i}", f"B{i}")] if not ctx.fused else [(f"RED_S{i}", f"B{i}")]
        if not ctx.fused:
            deps += [(f"T{i}", f"RED_T{i}")]
        for a, bb in deps:
            if a not in pos or bb not in pos or pos[a] > pos[bb]:
                out.append(f"rank {ctx.rank}: order {a} -> {bb} violated")
    # collective counts
    for kind in ("BC", "RED_S", "RED_IF", "BC_IB") + (() if ctx.fused else ("RED_T",)):
        ids = [int(e[len(kind):]) for e in ev_ if e.startswith(kind) and e[len(kind):].isdigit()]
        exp = list(range(m + 1)) if kind == "BC" else list(range(m))
        if ids != exp:
            out.append(f"rank {ctx.rank}: {kind} ids {ids}")
    return out


def collective_consistency(ctxs):
    ref = ctxs[-1].coll
    bad = []
    for c in ctxs:
        if c.coll != ref:
            n = next((i for i, (x, y) in enumerate(zip(c.coll, ref)) if x != y), min(len(c.coll), len(ref)))
            bad.append(f"rank {c.rank} lm-head collective #{n}: {c.coll[n:n+1]} vs last rank {ref[n:n+1]}")
    return bad


def p2p_simulation(ctxs):
    """Rendezvous model of the pipeline p2p communicator: each _communicate call is one
    batched group (batch_p2p_comm=True default); a group completes when every op's partner
    op (k-th send src->dst <-> k-th recv at dst from src) is in the partner rank's current
    group.  Returns list of problems (mismatched counts or deadlock)."""
    p = len(ctxs)
    queues = []
    for c in ctxs:
        seq = {}
        q = []
        for grp in c.p2p:
            g2 = []
            for (kind, src, dst) in grp:
                key = (kind, src, dst)
                seq[key] = seq.get(key, 0) + 1
                g2.append((kind, src, dst, seq[key]))
            q.append(g2)
        queues.append(q)
    probs = []
    # count matching
    cnt = {}
    for q in queues:
        for g in q:
            for (kind, src, dst, n) in g:
                cnt[(kind, src, dst)] = max(cnt.get((kind, src, dst), 0), n)
    for (kind, src, dst), n in cnt.items():
        other = ("recv" if kind == "send" else "send", src, dst)
        if cnt.get(other, 0) != n:
            probs.append(f"p2p count mismatch {kind} {src}->{dst}: {n} vs {cnt.get(other, 0)}")
    if probs:
        return probs
    heads = [0] * p
    while True:
        cand = {r for r in range(p) if heads[r] < len(queues[r])}
        if not cand:
            return []
        changed = True
        while changed:
            changed = False
            for r in list(cand):
                g = queues[r][heads[r]]
                for (kind, src, dst, n) in g:
                    peer = dst if kind == "send" else src
                    want = ("recv" if kind == "send" else "send", src, dst, n)
                    if peer not in cand or want not in queues[peer][heads[peer]]:
                        cand.discard(r)
                        changed = True
                        break
        if not cand:
            stuck = {r: queues[r][heads[r]] for r in range(p) if heads[r] < len(queues[r])}
            return [f"p2p deadlock, heads: {stuck}"]
        for r in cand:
            heads[r] += 1


def run_config(p, m, f, b, c, fused):
    ctxs, errs = [], []
    for r in range(p):
        ctx, err = run_rank(p, r, m, f, b, c, fused)
        ctxs.append(ctx)
        if err:
            errs.append(f"rank {r}: {err}")
    viol = [v for c_ in ctxs for v in c_.violations]
    checks = []
    if not errs:
        for c_ in ctxs:
            checks += per_rank_checks(c_, m)
        checks += collective_consistency(ctxs)
        checks += p2p_simulation(ctxs)
    loc0 = ctxs[0].sched_locals
    entry = {
        "p": p, "m": m, "f": f, "b": b, "c": c, "fused": fused,
        "num_warmup_s_pass": loc0["num_warmup_s_pass"],
        "is_bsf": loc0["is_bsf"],
        "offsets": loc0["offsets"],
        "num_warmup_microbatches": [c_.sched_locals["num_warmup_microbatches"] for c_ in ctxs],
        "num_microbatches_remaining": [c_.sched_locals["num_microbatches_remaining"] for c_ in ctxs],
        "ranks": [c_.events for c_ in ctxs],
    }
    return entry, ctxs, errs, viol, checks


GRID_FBC = [(1, 2, 0), (1, 2, 0.5), (1, 2, 1), (2, 3, 1), (1, 1, 1)]


def fwd_before_first_b(events):
    n = 0
    for e in events:
        if e.startswith("B") and e[1:].isdigit():
            break
        if e.startswith("F") and e[1:].isdigit():
            n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", required=True, help="a sail-sg/VocabularyParallelism checkout")
    ap.add_argument("--show", nargs=6, metavar=("P", "M", "F", "B", "C", "fused|unfused"))
    ap.add_argument("--full", action="store_true",
                    help="with --show: include p2p and line numbers; without --show: also write "
                         "orders_full.json (per-rank traces with p2p ops, sub-collectives and "
                         "the schedule-body line that issued each event)")
    a = ap.parse_args()
    use_reference(a.reference)
    if a.show:
        p, m = int(a.show[0]), int(a.show[1])
        f, b, c = (float(x) if "." in x else int(x) for x in a.show[2:5])
        fused = a.show[5] == "fused"
        entry, ctxs, errs, viol, checks = run_config(p, m, f, b, c, fused)
        print(f"p={p} m={m} f={f} b={b} c={c} fused={fused}")
        for k in ("is_bsf", "offsets", "num_warmup_s_pass", "num_warmup_microbatches",
                  "num_microbatches_remaining"):
            print(f"{k}: {entry[k]}")
        for c_ in ctxs:
            print(f"rank {c_.rank}: " + " ".join(c_.full if a.full else c_.events))
        print("errors:", errs, "\nviolations:", viol, "\nchecks:", checks)
        return
    results = []
    fulls = []
    summary = []
    for p in (4, 8, 16):
        for m in sorted({p, p + 2, 2 * p, 4 * p} | ({16} if p == 4 else set())):
            for (f, b, c) in GRID_FBC:
                for fused in (True, False):
                    entry, ctxs, errs, viol, checks = run_config(p, m, f, b, c, fused)
                    problems = errs + viol + checks
                    entry["valid"] = not problems
                    if problems:
                        entry["problems"] = problems[:20]
                    entry["fwd_before_first_B"] = [fwd_before_first_b(e) for e in entry["ranks"]]
                    results.append(entry)
                    if a.full:
                        fulls.append({k: entry[k] for k in ("p", "m", "f", "b", "c", "fused", "valid")}
                                     | {"ranks_full": [c_.full for c_ in ctxs]})
                    wexp = [min(p - r, m) for r in range(p)]
                    wok = entry["num_warmup_microbatches"] == wexp
                    fexp = [min(w + 1 + (not fused), m) for w in wexp]
                    fok = entry["fwd_before_first_B"] == fexp
                    summary.append({
                        "cfg": f"p={p} m={m} f={f} b={b} c={c} fused={fused}",
                        "errors": errs, "violations": viol[:5], "n_violations": len(viol),
                        "checks": checks[:5], "n_checks": len(checks), "warmup_ok": wok,
                        "fwd_before_first_B_ok": fok,
                    })
    with open(os.path.join(OUT_DIR, "orders.json"), "w") as fh:
        json.dump(results, fh)
    if a.full:
        with open(os.path.join(OUT_DIR, "orders_full.json"), "w") as fh:
            json.dump(fulls, fh)
    with open(os.path.join(OUT_DIR, "checks.json"), "w") as fh:
        json.dump({"ref_commit": REF_COMMIT, "ref_sha256": REF_SHA, "configs": summary}, fh, indent=1)
    nbad = 0
    for s in summary:
        ok = not (s["errors"] or s["n_violations"] or s["n_checks"])
        nbad += not ok
        if not ok:
            print("INVALID", s["cfg"], (s["errors"] + s["violations"] + s["checks"])[:2])
        if not (s["warmup_ok"] and s["fwd_before_first_B_ok"]):
            print("WARMUP-MISMATCH", s["cfg"])
    print(f"{len(summary)} configs, {nbad} with problems; ref {REF_COMMIT} sha256 {REF_SHA[:16]}")


if __name__ == "__main__":
    main()
