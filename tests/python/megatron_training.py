"""Megatron-LM's own training loop functions, on CPU over gloo, with Megatron's schedule or zbpp's.

Where megatron_real.py writes out small what megatron/training would do, this runs Megatron-LM's
own code as pretrain_gpt.py would: a stock Megatron-LM checkout (core_v0.16.1, the one whose
megatron.core is the installed megatron-core 0.16.1) supplies megatron.training and pretrain_gpt.py,
and each worker

    parses Megatron's arguments (megatron.training.arguments.parse_args / validate_args, from an
    argv, with zbpp.megatron.add_arguments as extra_args_provider under zbpp) and sets its globals
    (set_global_variables, without a tokenizer: the data are token ids already),
    initialises the model parallel state (initialize_model_parallel, with pretrain_gpt's
    get_embedding_ranks, or zbpp.megatron.v_embedding_ranks for a V schedule),
    builds model, optimizer and learning-rate scheduler with setup_model_and_optimizer(
    partial(model_provider, gpt_builder)) (wrapped in zbpp.megatron.v_model_provider for V): get_model,
    Megatron's DDP, get_megatron_optimizer (Adam, fp32, grad clipping at 1.0: Megatron's defaults)
    and OptimizerParamScheduler,
    wires config as train() does (grad_scale_func, timers, finalize_model_grads_func) and takes
    forward_backward_func as train() does (training.get_forward_backward_func(), which
    zbpp.megatron.patch() replaces),
    and per step calls training.train_step(pretrain_gpt.forward_step, ...) and
    training.evaluate(pretrain_gpt.forward_step, ...) (pretrain_gpt's get_batch and loss_func
    included).

Only the weights are set from outside (megatron_real.set_weights: from each parameter's global name,
so they do not depend on the placement) and the data (megatron_real.make_batch, keyed by (step,
microbatch), the dicts pretrain_gpt's get_batch reads).

API (in the calling process; the work runs in spawned workers, so a script using it needs the
`if __name__ == "__main__":` guard):

    run_cases(checkout, cases, world=2, timeout=60) -> [Result or WorkerError]
        checkout: the Megatron-LM checkout's root; cases: dicts of CASE_DEFAULTS' keys. The cases
        share workers (importing megatron.training takes about 10 s) until one fails; the cases
        after a failed one run in fresh workers. `timeout` is per case (also gloo's and zbpp's);
        workers that hang are killed and their Python stacks come back in the WorkerError.
    differences(a, b, grad_norm_exact=True, tolerance=None) -> [str]
        what differs between two Results (bit for bit unless told otherwise)
    fork_cases(fork_root, cases, world=2, timeout=60) -> [per-rank results or WorkerError]
        the reference fork's side (see "The reference fork" below)

Result (a dict; tensors on CPU): per step, from the last pipeline rank, where Megatron reads them:
    losses[step]       the loss_dict train_step returned ({"lm loss": tensor})
    eval_losses[step]  the total_loss_dict evaluate returned after that step
    skipped[step], grad_norm[step], lr[step]   train_step's skipped_iter and grad_norm, and the
                       learning rate the scheduler set (optimizer.param_groups[0]["lr"])
and merged over the ranks by global name (megatron_real.global_names):
    params[step]       the parameters after train_step (after the optimizer step)
    grads[step]        main_grad after train_step (the gradients the optimizer stepped with,
                       clipped in place by Megatron's optimizer when the norm exceeds --clip-grad)
    init_params        the parameters before the first step
    ranks[r]           what rank r reported: coords, chunks (vp_stage of each model chunk), its own
                       losses / eval_losses, ran (the forward_backward_func train_step used, with
                       zbpp's schedule kind), reads (per train_step / evaluate call: the batch ids
                       each model chunk's iterator gave, in order), split (the layers
                       zbpp.split_linear split / did not), gemms_run (W GEMMs of zbpp's store)
                       and w_kernel (the store's kernel),
                       optimizer (the class get_megatron_optimizer made)
    case               the case

Under a V placement the grad norm may differ from Megatron's 1F1B in its last bit, the gradients
being the same: get_grad_norm_fp32 all-reduces per-rank partial sums of squares, and V puts other
parameters on each rank. With clipping that difference reaches the clipped gradients.

Shims, applied in the workers only and documented where they are defined: training_import_shims()
(Python packages megatron.training imports and these paths never use, stood in for when not
installed), training_cpu_patches() (the torch.cuda calls of megatron/training and megatron.core's
optimizer on these paths, on top of megatron_real.cpu_patches()), and for the fork
fork_import_shims().
"""

import contextlib
import datetime
import importlib.util
import itertools
import os
import signal
import sys
import types
from pathlib import Path

import megatron_real as mr

VOCAB = mr.VOCAB
SEQ = mr.SEQ
MICRO_BATCH = mr.MICRO_BATCH
HIDDEN = mr.HIDDEN
HEADS = mr.HEADS
LAYERS = 4

CASE_DEFAULTS = dict(
    pp=2,
    v_order=False,        # two model chunks per rank built in V order (zbpp.megatron.v_model_provider,
                          # v_embedding_ranks); else one chunk of LAYERS / pp layers per rank
    use_zbpp=False,       # zbpp.megatron.patch() before the model is built
    zbpp_kind=None,       # zbpp.megatron.configure(kind=...); None: the schedule from Megatron's args
    flags=(),             # more Megatron argv (e.g. the zero-bubble flags zbpp reads from get_args())
    split=True,           # zbpp.split_linear on every chunk (under Megatron's schedule each W runs in its B)
    steps=2,
    m=4,                  # microbatches per step (--global-batch-size m * micro batch, one data parallel rank)
    optimizer="adam",
    clip_grad=1.0,        # Megatron's default
    lr=0.01,
    plan_from_measured=None,  # zbpp.megatron.configure(plan_from_measured=...); None: zbpp's default
    vocab=False,          # the model built by zbpp.megatron.vocab_model_provider (give --enable-vocab-parallel
                          # in flags): the word embedding and output layer split over the pipeline ranks
                          # (megatron_real.set_weights / named_tensors set and report them whole)
)


class WorkerError(mr.WorkerError):
    """A worker raised, or the workers hung; the message holds their tracebacks or stacks."""


# =====================================================================================================
# Shims (workers only)
# =====================================================================================================

def _stand_in(name, **attrs):
    """A module `name` in sys.modules with `attrs`; any other attribute raises ImportError when used."""
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__zbpp_stand_in__ = True

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ImportError(f"{name} is not installed; zbpp's test put a stand-in in its place, and "
                          f"{name}.{attr} is not in it")

    module.__getattr__ = __getattr__
    sys.modules[name] = module
    return module


def _refuse(what):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{what} is not available in zbpp's CPU test (a stand-in)")
    return refuse


def training_import_shims():
    """Stand-ins for the packages megatron.training (core_v0.16.1) imports at module level and the
    paths tested here never use, installed only for those missing from the environment (the
    megatron-core wheel does not depend on them). Each, and what imports it:

    - six: megatron/training/tokenizer/bert_tokenization.py (`six.PY3` inside the BERT tokenizer);
      reached by `megatron.training` -> global_vars -> tokenizer. No tokenizer is built here.
    - regex: megatron/training/tokenizer/gpt2_tokenization.py (`import regex as re`, used when a
      GPT-2 tokenizer is built).
    - yaml (PyYAML): megatron/training/yaml_arguments.py, which at import registers a resolver and a
      constructor (no-ops here); used only with --yaml-cfg.
    - megatron.core.transformer.custom_layers.batch_invariant_kernels: imports triton (absent from
      CPU torch); megatron/training/initialize.py imports enable_batch_invariant_mode from it, for
      --batch-invariant-mode.
    - megatron.rl (pydantic): megatron/training/training.py imports
      megatron.rl.parallel_utils.build_inference_pg_collection unconditionally (RL training only);
      megatron.rl's __init__ needs pydantic.

    Returns the names stood in for."""
    done = training_import_shims_basic()
    if importlib.util.find_spec("triton") is None:
        refuse = _refuse("--batch-invariant-mode (triton)")
        _stand_in("megatron.core.transformer.custom_layers.batch_invariant_kernels",
                  enable_batch_invariant_mode=refuse, disable_batch_invariant_mode=refuse,
                  set_batch_invariant_mode=refuse, is_batch_invariant_mode_enabled=lambda: False)
        done.append("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    if importlib.util.find_spec("pydantic") is None:
        rl = _stand_in("megatron.rl")
        rl.__path__ = []  # a package: `from megatron.rl import rl_utils` fails with ImportError (caught)
        _stand_in("megatron.rl.parallel_utils",
                  build_inference_pg_collection=_refuse("megatron.rl (pydantic)"))
        done.append("megatron.rl")
    return done


def training_cpu_patches():
    """The monkeypatches megatron/training (core_v0.16.1) and megatron.core's optimizer need on a
    CPU-only torch on the paths tested here, on top of megatron_real.cpu_patches()
    (torch.cuda.current_device -> "cpu",
    synchronize a no-op, "cuda" tensors made on the CPU, Megatron's RNG tracker), which covers
    megatron.core and most of megatron/training too (get_model's `model_module.cuda(...)`,
    get_batch_on_this_tp_rank's `.cuda(non_blocking=True)`, evaluate's `torch.tensor(...).cuda()`,
    the timers' and train_step's reductions made on torch.cuda.current_device()).

    1. torch.cuda.Stream / torch.cuda.current_stream / torch.cuda.stream: get_model builds the DDP
       wrappers on a side stream (`ddp_stream = torch.cuda.Stream(); ddp_stream.wait_stream(
       torch.cuda.current_stream()); with torch.cuda.stream(ddp_stream): ...`). A CPU-only torch
       raises on the first two; here they are a stand-in stream whose waits do nothing, and
       torch.cuda.stream(...) a null context.

    2. Tensor.type() (the form without arguments, which names the type) answers the CUDA name of
       a CPU tensor: "torch.cuda.FloatTensor" for a float32 one. megatron.core's optimizer checks
       the name: clip_grad_by_total_norm_fp32 asserts `param.grad.type() ==
       'torch.cuda.FloatTensor'` before scaling the gradients (FP32Optimizer.step, whenever the
       grad norm exceeds --clip-grad). A torch function mode, entered for the rest of the worker's
       life like megatron_real's; Tensor.type(dtype) conversions pass through untouched.

    Not needed: anything of initialize_megatron (not called: it asserts CUDA unless allow_no_cuda,
    sets the CUDA device, seeds CUDA generators and compiles the dataset helpers; the workers
    do its parts themselves: parse_args / validate_args / set_global_variables, gloo's
    init_process_group, initialize_model_parallel, and megatron_real's RNG tracker).
    """
    import torch

    class _Stream:
        """A stand-in CUDA stream: every wait and synchronisation is a no-op (CPU work is in order)."""

        def wait_stream(self, other):
            return None

        def wait_event(self, event):
            return None

        def synchronize(self):
            return None

        def query(self):
            return True

    # 1
    torch.cuda.Stream = lambda *args, **kwargs: _Stream()
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()

    # 2
    from torch.overrides import TorchFunctionMode

    class _CudaTypeNames(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                if name.startswith("torch.") and not name.startswith("torch.cuda."):
                    name = "torch.cuda." + name[len("torch."):]
                return name
            return func(*args, **kwargs)

    _CudaTypeNames().__enter__()


# =====================================================================================================
# One case in one worker
# =====================================================================================================

def _argv(case):
    """Megatron's command line for the case (what a user would give pretrain_gpt.py)."""
    argv = [
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--ffn-hidden-size", str(4 * HIDDEN), "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(case["m"] * MICRO_BATCH),
        "--pipeline-model-parallel-size", str(case["pp"]),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        # No Transformer Engine / apex on CPU: Megatron's local layers, no fused kernels.
        "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--use-cpu-initialization", "--distributed-backend", "gloo",
        "--optimizer", case["optimizer"], "--lr", str(case["lr"]), "--min-lr", "0",
        "--clip-grad", str(case["clip_grad"]),
        "--train-iters", "10", "--eval-iters", "1", "--eval-interval", "1",
    ]
    if case["v_order"]:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(LAYERS // (2 * case["pp"]))]
    return argv + list(case["flags"])


class _LoggingIterator:
    """An iterator over the batches of several steps that records the id of each batch it gives."""

    def __init__(self, batches, log):
        self.batches, self.log = iter(batches), log

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.batches)
        self.log.append(batch["id"])
        return batch


def _iterators(phase, case, dp_rank, chunks, logs):
    """One iterator per model chunk over every step's microbatches (as Megatron's
    build_train_valid_test_data_iterators gives one per virtual stage)."""
    data = dict(mr.DEFAULTS, seq_length=SEQ, micro_batch_size=MICRO_BATCH, vocab=VOCAB, attention_mask=True)
    its = []
    for c in range(chunks):
        batches = itertools.chain.from_iterable(mr.batches(s, case["m"], dp_rank, phase, data)
                                                for s in range(case["steps"]))
        its.append(_LoggingIterator(batches, logs[c]))
    return its if chunks > 1 else its[0]


def _zbpp():
    if str(mr.PYTHON_SRC) not in sys.path:
        sys.path.insert(0, str(mr.PYTHON_SRC))
    import zbpp.megatron
    return zbpp.megatron


def _detach(value):
    import torch

    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _run_case(case, timeout, progress):
    from functools import partial

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training import arguments, global_vars
    from megatron.training import training as mt

    import pretrain_gpt
    from gpt_builders import gpt_builder
    from model_provider import model_provider

    zb = _zbpp() if case["use_zbpp"] else None
    progress("arguments")
    sys.argv = ["pretrain_gpt.py"] + _argv(case)
    args = arguments.parse_args(extra_args_provider=zb.add_arguments if zb is not None else None)
    args.padded_vocab_size = VOCAB  # what building the tokenizer sets; the data are token ids
    arguments.validate_args(args)
    global_vars.set_global_variables(args, build_tokenizer=False)
    try:
        progress("initialize_model_parallel")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            distributed_timeout_minutes=max(1, int(timeout // 60) + 1),
            get_embedding_ranks=(zb.v_embedding_ranks if case["v_order"] else pretrain_gpt.get_embedding_ranks),
        )
        if zb is not None:
            zb.patch()
            zb.configure(kind=case["zbpp_kind"], timeout=float(timeout), plan_from_measured=case["plan_from_measured"])
        tp_rank = ps.get_tensor_model_parallel_rank()
        dp_rank = ps.get_data_parallel_rank()

        progress("setup_model_and_optimizer")
        provider = partial(model_provider, gpt_builder)
        if case["v_order"]:
            provider = zb.v_model_provider(provider)
        if case["vocab"]:
            provider = zb.vocab_model_provider(provider)
        model, optimizer, scheduler = mt.setup_model_and_optimizer(provider, ModelType.encoder_or_decoder)
        # Placement-independent weights, in place (the fp32 optimizer steps these very tensors).
        mr.set_weights(model, args.tensor_model_parallel_size, tp_rank)
        split = None
        if case["split"]:
            import zbpp
            for chunk in model:
                zbpp.split_linear(chunk, warn=False)
            reports = [zbpp.split_report(chunk) for chunk in model]
            split = {"split": [e.name for r in reports for e in r.split],
                     "not_split": [(e.name, e.reason) for r in reports for e in r.not_split]}

        # train()'s wiring of config (megatron/training/training.py, train()): no overlapped
        # gradient reduction or parameter gather here, so no no_sync / grad_sync / param_sync.
        config = get_model_config(model[0])
        config.grad_scale_func = optimizer.scale_loss
        config.timers = global_vars.get_timers()
        from megatron.core.distributed import finalize_model_grads
        config.finalize_model_grads_func = finalize_model_grads
        forward_backward_func = mt.get_forward_backward_func()  # as train() takes it

        chunks = len(model)
        train_logs = [[] for _ in range(chunks)]
        eval_logs = [[] for _ in range(chunks)]
        train_iter = _iterators("train", case, dp_rank, chunks, train_logs)
        valid_iter = _iterators("eval", case, dp_rank, chunks, eval_logs)

        result = {
            "coords": {"rank": dist.get_rank(), "pp": ps.get_pipeline_model_parallel_rank(), "tp": tp_rank,
                       "dp": dp_rank},
            "chunks": [getattr(mr._unwrap(c), "vp_stage", None) for c in model],
            "split": split,
            "init_params": mr.named_tensors(model, "param"),
            "init_params_local": sorted(n for c in model for n, _ in mr._unwrap(c).named_parameters()),
            "losses": [], "eval_losses": [], "skipped": [], "grad_norm": [], "lr": [],
            "params": [], "grads": [], "reads": [], "ran": set(),
            "optimizer": type(optimizer).__name__,
        }
        store = None
        if case["split"]:
            from zbpp.split import default_store
            store = default_store()
            store.gemms_run = 0
        for chunk in model:
            chunk.train()
        for step in range(case["steps"]):
            progress(f"step {step}: train_step")
            args.curr_iteration = step
            for log in train_logs:
                log.clear()
            out = mt.train_step(pretrain_gpt.forward_step, train_iter, model, optimizer, scheduler, config,
                                forward_backward_func, iteration=step)
            loss_dict, skipped, _ckpt, should_exit, _code, grad_norm = out[:6]
            if should_exit:
                raise RuntimeError("train_step asked to exit")
            ran = f"{forward_backward_func.__module__}.{forward_backward_func.__name__}"
            if zb is not None:
                sched = zb.current_schedule()
                ran += f" [{getattr(getattr(sched, 'schedule', None), 'kind', None)}]"
                plan = getattr(sched, "schedule", None)
                mine = plan.rank_ops(sched.rank) if plan is not None else []
                result.setdefault("offloads", []).append(sum(op.type == "OFFLOAD" for op in mine))
            result["ran"].add(ran)
            result["losses"].append(_detach(loss_dict))
            result["skipped"].append(skipped)
            result["grad_norm"].append(grad_norm)
            result["lr"].append(optimizer.param_groups[0]["lr"])
            result["grads"].append(mr.named_tensors(model, "grad"))
            result["params"].append(mr.named_tensors(model, "param"))
            result["reads"].append(("train", step, [list(log) for log in train_logs]))

            progress(f"step {step}: evaluate")
            for log in eval_logs:
                log.clear()
            total_loss_dict, _non_loss, timelimit = mt.evaluate(
                pretrain_gpt.forward_step, valid_iter, model, None, config, verbose=False, eval_iters=1)
            if timelimit:
                raise RuntimeError("evaluate hit its time limit")
            result["eval_losses"].append(_detach(total_loss_dict))
            result["reads"].append(("eval", step, [list(log) for log in eval_logs]))
            if any(chunk.training is False for chunk in model):
                raise AssertionError("evaluate left a model chunk in eval mode")
        # The W GEMMs zbpp's store ran (split layers: in zbpp's W passes, or inside each B under
        # Megatron's own schedule).
        result["gemms_run"] = store.gemms_run if store is not None else None
        # Their kernel: "torch" (torch's own ops: Megatron's bits) or the library's GEMM.
        result["w_kernel"] = store.kernel if store is not None else None
        progress("done")
        return result
    finally:
        with contextlib.suppress(Exception):
            if zb is not None:
                zb.reset()
                zb.unpatch()
                zb.configure()
        # Megatron's own teardown of its globals (args, timers, microbatch calculator, parallel
        # state, rerun state machine); the process groups stay (gloo keeps them cheaply).
        mt.destroy_global_state()


def _setup_training(root, progress):
    """The training workers' imports: the Megatron-LM checkout's root after site-packages (`megatron`
    is a namespace package in both, so megatron.core stays the installed megatron-core, the same
    0.16.1 sources, and megatron.training, pretrain_gpt, gpt_builders and model_provider come from
    the checkout), the CPU patches and the import shims."""
    if root not in sys.path:
        sys.path.append(root)
    progress("import megatron")
    import megatron.core  # noqa: F401
    mr.cpu_patches()
    training_cpu_patches()
    training_import_shims()
    import megatron.training.training  # noqa: F401
    import pretrain_gpt  # noqa: F401


def _worker(rank, world, init_file, out_dir, cases, timeout, library, mode, root):
    """One process: its set-up (mode "training": _setup_training; "fork": _setup_fork), gloo over a
    file:// rendezvous, the cases in order. Rank 0 writes case<i>.pkl with every rank's result; a
    rank that raises writes error<rank>.txt."""
    import faulthandler
    import warnings

    out = Path(out_dir)
    stacks = open(out / f"stack{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    progress_file = out / f"progress{rank}.txt"
    where = {"case": None}

    def progress(text):
        progress_file.write_text(f"case {where['case']}: {text}\n")

    try:
        os.environ["ZBPP_LIBRARY"] = library
        # What torchrun would set; Megatron's parse_args reads them.
        os.environ["RANK"] = str(rank)
        os.environ["LOCAL_RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world)
        if str(mr.PYTHON_SRC) not in sys.path:
            sys.path.insert(0, str(mr.PYTHON_SRC))
        warnings.filterwarnings("ignore")
        import logging
        logging.disable(logging.WARNING)
        progress("import torch")
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        setup, run_case = (_setup_training, _run_case) if mode == "training" else (_setup_fork, _run_fork_case)
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            setup(root, progress)
        progress("init_process_group")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            for index, case in cases:
                where["case"] = index
                mr.deliver(out, index, rank, world, run_case(case, timeout, progress))
        progress("finished")
        dist.destroy_process_group()
    except BaseException:
        mr.fail(out, rank, where["case"])


# =====================================================================================================
# The calling side
# =====================================================================================================


def _spawn(world, indexed_cases, timeout, mode, root):
    """megatron_real's supervisor (progress, timeouts, tracebacks and stacks) over this module's
    workers."""
    return mr._spawn(world, indexed_cases, timeout, target=_worker, extra=(mode, root))


def _assemble(per_rank, case):
    last = next(r for r in per_rank if r["coords"]["pp"] == case["pp"] - 1 and r["coords"]["dp"] == 0
                and r["coords"]["tp"] == 0)
    steps = case["steps"]
    return {
        "case": case,
        "losses": last["losses"],
        "eval_losses": last["eval_losses"],
        "skipped": last["skipped"],
        "grad_norm": last["grad_norm"],
        "lr": last["lr"],
        "params": [mr._merge(per_rank, "params", s) for s in range(steps)],
        "grads": [mr._merge(per_rank, "grads", s) for s in range(steps)],
        "init_params": mr._merge(per_rank, "init_params"),
        "ranks": per_rank,
    }


def _run_all(world, full, timeout, mode, root, assemble):
    results = [None] * len(full)
    pending = list(enumerate(full))
    while pending:
        done, failure, failed = _spawn(world, pending, timeout, mode, root)
        for index, gathered in done.items():
            results[index] = assemble(gathered, full[index])
        if failure is None:
            for i, _ in pending:
                if i not in done:
                    results[i] = WorkerError(f"case {i} produced no result")
            break
        if failed is None or failed not in dict(pending):
            failed = next(i for i, _ in pending if i not in done)
        results[failed] = failure
        pending = [(i, c) for i, c in pending if i not in done and i != failed]
    return results


def run_cases(checkout, cases, world=2, timeout=60):
    """Runs each case (a dict of CASE_DEFAULTS' keys) on `world` workers with Megatron-LM from
    `checkout`; returns, per case, its Result or the WorkerError it failed with."""
    full = []
    for c in cases:
        unknown = set(c) - set(CASE_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown case settings: {sorted(unknown)}")
        full.append(dict(CASE_DEFAULTS, **c))
    return _run_all(world, full, timeout, "training", str(Path(checkout).resolve()), _assemble)


def differences(a, b, grad_norm_exact=True, tolerance=None):
    """What differs between two Results: losses, eval losses, skipped iterations, learning rates,
    gradients, parameters and grad norms. Bit for bit, unless tolerance=(rtol, atol) is given (then
    tensors and grad norms are compared as torch.testing.assert_close would); grad_norm_exact=False
    lets the grad norms alone differ by 1e-6 relative."""
    import torch

    diffs = []

    def cmp(where, x, y):
        if torch.is_tensor(x) and torch.is_tensor(y):
            if x.dtype != y.dtype or x.shape != y.shape:
                diffs.append(f"{where}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
            elif tolerance is not None:
                if not torch.allclose(x, y, rtol=tolerance[0], atol=tolerance[1]):
                    delta = (x.double() - y.double()).abs().max().item()
                    diffs.append(f"{where}: not close (max |diff| {delta:.3g})")
            elif not torch.equal(x, y):
                delta = (x.double() - y.double()).abs().max().item()
                diffs.append(f"{where}: differs (max |diff| {delta:.3g})")
        elif tolerance is not None and isinstance(x, float) and isinstance(y, float):
            if abs(x - y) > tolerance[1] + tolerance[0] * abs(y):
                diffs.append(f"{where}: {x!r} not close to {y!r}")
        elif x != y:
            diffs.append(f"{where}: {x!r} != {y!r}")

    for field in ("losses", "eval_losses"):
        if len(a[field]) != len(b[field]):
            diffs.append(f"{field}: {len(a[field])} vs {len(b[field])} steps")
        for step, (da, db) in enumerate(zip(a[field], b[field])):
            if set(da) != set(db):
                diffs.append(f"{field}[{step}]: keys {sorted(da)} vs {sorted(db)}")
                continue
            for k in da:
                cmp(f"{field}[{step}][{k!r}]", da[k], db[k])
    for field in ("skipped", "lr"):
        for step, (x, y) in enumerate(zip(a[field], b[field])):
            cmp(f"{field}[{step}]", x, y)
    for step, (x, y) in enumerate(zip(a["grad_norm"], b["grad_norm"])):
        if grad_norm_exact or tolerance is not None or x is None or y is None:
            cmp(f"grad_norm[{step}]", x, y)
        elif abs(x - y) > 1e-6 * max(abs(x), abs(y)):
            diffs.append(f"grad_norm[{step}]: {x!r} vs {y!r}")
    for field in ("init_params", "grads", "params"):
        xs, ys = a[field], b[field]
        if field == "init_params":
            xs, ys = [xs], [ys]
        for step, (da, db) in enumerate(zip(xs, ys)):
            if set(da) != set(db):
                diffs.append(f"{field}[{step}]: names differ: {sorted(set(da) ^ set(db))}")
            for name in sorted(set(da) & set(db)):
                cmp(f"{field}[{step}][{name}]", da[name], db[name])
    return diffs


# =====================================================================================================
# The reference fork (sail-sg/zero-bubble-pipeline-parallelism)
# =====================================================================================================
#
# Its training loop does not run on a CPU-only torch without apex / Transformer Engine. What blocks
# it (the fork's megatron.core is its own 0.9.0rc0 copy; with the import stand-ins below it imports):
#
# - Post-validation (--enable-optimizer-post-validation) exists only on MixedPrecisionOptimizer
#   (fp16 / bf16: Float16OptimizerWithFloat16Params, DistributedOptimizer): FP32Optimizer has no
#   pre_step / recv_post_validation / post_validation, and the fork's train_step calls
#   optimizer.pre_step() once post_validation_enabled turns on, so fp32 training cannot take that
#   path at all.
# - Float16OptimizerWithFloat16Params.__init__ sorts parameters by their CUDA type names
#   (param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'], else
#   'torch.cuda.FloatTensor', else TypeError), and MegatronOptimizer.__init__ allocates
#   torch.cuda.IntTensor([0]) / torch.cuda.FloatTensor([0]), which a CPU-only torch refuses
#   ("type torch.cuda.IntTensor not available"); the grad scaler's found_inf / _scale tensors are
#   made with device='cuda'.
# - The norm and clipping of pre_step / post_validation run apex's CUDA kernels: `import amp_C`
#   (multi_tensor_l2norm in do_clac_local_grad_norm, multi_tensor_scale in downscale_gradient); a
#   rolled-back step needs apex's FusedAdam (zbpp_optimizer_helper.rollback_optimizer_step asserts
#   the optimizer is one and reads its param_groups_master).
# - Module-level imports without fallbacks: apex.optimizers.FusedAdam (zbpp_optimizer_helper, imported
#   by the optimizer), flash_attn.flash_attn_interface (megatron/legacy/model/transformer.py, imported
#   by megatron.training), pynvml (megatron/core/gpu_affinity.py), pulp (the ILP scheduler,
#   zerobubble/scheduler/zb.py, imported by the zero-bubble runtime), pkg_resources (setuptools;
#   tensor_parallel/random.py), six / regex / yaml as for stock Megatron-LM.
#
# So instead of its train_step, the fork's own post-validation methods are driven by zbpp: the
# norm-only path of pre_step (recv_pre_step, partially_reduce_local_total_norm, send_pre_step: the
# forward pass of the partial norm down the pipeline; CPU tensors, gloo) and then, as the fork's
# train_step does, `get_forward_backward_func()(..., optimizer=optimizer)` with zbpp.megatron.patch()
# in place, which must run the fork's recv_post_validation / send_post_validation / post_validation
# in the fork's order and return what the fork's runtime returns. The steps themselves (the local
# optimizer step, rollback) are the CUDA-only part above and are not run.

def fork_import_shims():
    """Stand-ins for the packages the fork's megatron.training / megatron.core import at module level
    without a fallback, installed only for those missing (see the comment above). Returns their names."""
    import packaging.version  # noqa: F401 (a dependency of torch; the fork reads pkg_resources.packaging)
    import packaging

    done = training_import_shims_basic()
    if importlib.util.find_spec("pkg_resources") is None:
        _stand_in("pkg_resources", packaging=packaging)
        done.append("pkg_resources")
    if importlib.util.find_spec("flash_attn") is None:
        _stand_in("flash_attn").__path__ = []
        refuse = _refuse("flash_attn")
        _stand_in("flash_attn.flash_attn_interface", _flash_attn_varlen_forward=refuse,
                  _flash_attn_varlen_backward=refuse)
        done.append("flash_attn")
    if importlib.util.find_spec("pynvml") is None:
        _stand_in("pynvml")
        done.append("pynvml")
    if importlib.util.find_spec("apex") is None:
        _stand_in("apex").__path__ = []  # a package: apex.<anything else> fails with ImportError (caught)

        class FusedAdam:  # never instantiated: only isinstance() checks on a rollback see it
            def __init__(self, *args, **kwargs):
                raise RuntimeError("apex's FusedAdam is not available in zbpp's CPU test (a stand-in)")

        _stand_in("apex.optimizers", FusedAdam=FusedAdam)
        done.append("apex")
    if importlib.util.find_spec("pulp") is None:
        _stand_in("pulp")
        done.append("pulp")
    return done


def training_import_shims_basic():
    """six, regex, yaml: what stock Megatron-LM's and the fork's megatron.training both import (see
    training_import_shims)."""
    done = []
    if importlib.util.find_spec("six") is None:
        _stand_in("six", PY2=False, PY3=True)
        done.append("six")
    if importlib.util.find_spec("regex") is None:
        _stand_in("regex")
        done.append("regex")
    if importlib.util.find_spec("yaml") is None:
        _stand_in("yaml", add_implicit_resolver=lambda *a, **k: None, add_constructor=lambda *a, **k: None)
        done.append("yaml")
    return done


# --no-pre-communication-optimization: the fork's default (on) gives its pipeline and tensor parallel
# groups torch.distributed.ProcessGroupNCCL.Options (high-priority streams) in
# initialize_model_parallel, which a CPU-only torch does not have.
FORK_ARGV = ["--enable-zero-bubble", "--enable-optimizer-post-validation", "--no-pre-communication-optimization"]


def _fork_args():
    """The fork's global args: its own parse_args over FORK_ARGV (its defaults for everything else;
    validate_args is not run: it wants a model and a world size)."""
    from megatron.training.arguments import parse_args

    argv = sys.argv
    sys.argv = ["pretrain_gpt.py"] + FORK_ARGV
    try:
        return parse_args()
    finally:
        sys.argv = argv


def _setup_fork(root, progress):
    """The fork first on sys.path: its own megatron.core (0.9.0rc0) shadows the installed one."""
    if root in sys.path:
        sys.path.remove(root)
    sys.path.insert(0, root)
    progress("import the fork")
    shims = fork_import_shims()
    import megatron.core
    if not str(Path(megatron.core.__file__).resolve()).startswith(str(Path(root).resolve())):
        raise RuntimeError(f"megatron.core came from {megatron.core.__file__}, not from the fork at {root}")
    import megatron.training.training  # noqa: F401
    from megatron.training.global_vars import set_args
    set_args(_fork_args())
    _setup_fork.shims = shims


def _undecorated(fn):
    """The function under the fork's decorators: functools.wraps ones (torch.no_grad) by __wrapped__,
    and nvtx_profile, whose wrapper `profile(*args, **kwargs)` keeps the function in its closure."""
    seen = set()
    while id(fn) not in seen:
        seen.add(id(fn))
        if hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
            continue
        inner = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                 if callable(getattr(c, "cell_contents", None)) and hasattr(c.cell_contents, "__code__")]
        if len(inner) == 1:
            fn = inner[0]
            continue
        break
    return fn


def _returns(tree):
    """The arity of each `return` of a function's AST (not of nested functions): len of a tuple, 1
    for another expression, 0 for a bare return."""
    import ast

    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Return):
                v = child.value
                out.append(0 if v is None else len(v.elts) if isinstance(v, ast.Tuple) else 1)
            visit(child)

    visit(tree)
    return out


def _function_ast(source_text, name):
    import ast

    for node in ast.walk(ast.parse(source_text)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _calls_in(func_node, attr):
    """Per call of `<something>.attr(...)` in a function's AST: (number of positional args, the names
    it is assigned to, or None)."""
    import ast

    out = []
    for node in ast.walk(func_node):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            f = call.func
            if (isinstance(f, ast.Attribute) and f.attr == attr) or (isinstance(f, ast.Name) and f.id == attr):
                target = node.targets[0]
                names = ([e.id if isinstance(e, ast.Name) else None for e in target.elts]
                         if isinstance(target, ast.Tuple) else [getattr(target, "id", None)])
                out.append((len(call.args), names))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            if (isinstance(f, ast.Attribute) and f.attr == attr) or (isinstance(f, ast.Name) and f.id == attr):
                out.append((len(node.value.args), None))
    return out


def _fork_report(root):
    """What the fork defines for post-validation, from the imported classes (inspect) and the
    sources of its runtime and train_step (ast), and the order its scheduler gives the
    post-validation nodes on each stage."""
    import ast
    import inspect
    import io
    import textwrap

    import megatron.core
    from megatron.core.optimizer import distrib_optimizer as fdo
    from megatron.core.optimizer import optimizer as fo
    from megatron.core.pipeline_parallel.zerobubble.scheduler import basic1f1b, passes, zbv, zbv_greedy
    from megatron.core.pipeline_parallel.zerobubble.scheduler.graph import FuncType, GraphConfig

    report = {"megatron_core": megatron.core.__file__, "shims": getattr(_setup_fork, "shims", None),
              "version": getattr(getattr(megatron.core, "package_info", None), "__version__", None)}
    methods = {}
    for cls in (fo.MegatronOptimizer, fo.MixedPrecisionOptimizer, fo.Float16OptimizerWithFloat16Params,
                fo.FP32Optimizer, fo.ChainedOptimizer, fdo.DistributedOptimizer):
        for name in ("pre_step", "recv_post_validation", "send_post_validation", "post_validation"):
            fn = getattr(cls, name, None)
            if fn is None:
                methods[f"{cls.__name__}.{name}"] = None
                continue
            inner = _undecorated(fn)
            params = inspect.signature(inner).parameters.values()
            tree = ast.parse(textwrap.dedent(inspect.getsource(inner))).body[0]
            methods[f"{cls.__name__}.{name}"] = {
                "params": [(p.name, p.kind.name, p.default is inspect.Parameter.empty) for p in params],
                "returns": sorted(set(_returns(tree))),
                "defined_in": inner.__qualname__,
            }
    report["methods"] = methods
    report["post_validation_enabled_default"] = "self.post_validation_enabled = False" in inspect.getsource(
        fo.MegatronOptimizer.__init__)

    runtime = (Path(root) / "megatron/core/pipeline_parallel/zerobubble/runtime.py").read_text()
    until = _function_ast(runtime, "run_until_post_validation")
    report["runtime"] = None if until is None else {
        "post_validation": _calls_in(until, "post_validation"),
        "recv_post_validation": _calls_in(until, "recv_post_validation"),
        "send_post_validation": _calls_in(until, "send_post_validation"),
        "returns": [[e.id for e in r.value.elts] for r in ast.walk(until)
                    if isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple)],
    }
    training = (Path(root) / "megatron/training/training.py").read_text()
    step = _function_ast(training, "train_step")
    report["train_step"] = None if step is None else {
        "optimizer_call": _calls_in(step, "run_forward_backward_func"),
        "optimizer_kwarg": "kwargs[\"optimizer\"] = optimizer" in ast.get_source_segment(training, step),
    }

    pv = {FuncType.RECV_POST_VALIDATION: "recv", FuncType.SEND_POST_VALIDATION: "send",
          FuncType.POST_VALIDATION: "post"}

    def config(p, m, chunks):
        return GraphConfig(cost_f=[1000.0] * p, cost_b=[1000.0] * p, cost_w=[1000.0] * p, cost_comm=1.0,
                           mem_f=[2.0] * p, mem_b=[-1.0] * p, mem_w=[-1.0] * p, max_mem=None,
                           print_scaling=1000, max_chunks=chunks, n_stages=p, n_micro=m)

    orders = {}
    with contextlib.redirect_stdout(io.StringIO()):  # the fork's scheduler prints its schedules
        for p in (2, 3, 4):
            m = 2 * p
            # As the fork's runtime builds them (zerobubble/runtime.py): ZB-V (mem setup zb) with
            # zbv.PipelineGraph, V-Half / V-Min with zbv_greedy; a one-chunk schedule (1F1B's order:
            # the fork's own zb.create_schedule is an ILP needing pulp) through the same passes.
            c = config(p, m, 1)
            built = {"1f1b": passes.run_schedule_passes(c, basic1f1b.create_schedule(c), post_validation=True)}
            c = config(p, m, 2)
            graph = zbv.PipelineGraph(p, m, 1000, 1000, 1000, 1, f_mem=2, b_mem=-1, w_mem=-1, max_mem=None)
            built["zb-v"] = passes.run_schedule_passes(c, graph.create_schedule(c), post_validation=True,
                                                       validate=False)
            for setup, kind in (("half", "v-half"), ("min", "v-min")):
                c = config(p, m, 2)
                graph = zbv_greedy.PipelineGraph(p, m, setup, 1000, 1000, 1000, 1)
                built[kind] = passes.run_schedule_passes(c, graph.create_schedule(c), post_validation=True)
            for kind, stages in built.items():
                orders[(kind, p)] = [[pv[n.type] for n in nodes if n.type in pv] for nodes in stages]
    report["orders"] = orders
    return report


def _no_forward_step(data_iterator, model):
    raise AssertionError("forward_backward_func(..., optimizer=...) ran a forward step")


def _fork_post_validation(case, timeout):
    """The fork's post-validation protocol over `world` pipeline ranks, its norm part run by the
    fork's own methods and its second half by zbpp's forward_backward_func(optimizer=...), looked up
    as the fork's train_step does. Per iteration: (zbpp's return value, do_this_step,
    the fork's fully reduced states on this rank)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    world, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(pipeline_model_parallel_size=world,
                                 distributed_timeout_minutes=max(1, int(timeout // 60) + 1))
    zb = _zbpp()
    try:
        patched = zb.patch()
        zb.configure(timeout=float(timeout))
        # The optimizer's post-validation state without its CUDA-only construction (see above):
        # what MegatronOptimizer.__init__ sets for it, no grad scaler (fp32 loss scale 1).
        opt = object.__new__(Float16OptimizerWithFloat16Params)
        opt.config = OptimizerConfig(clip_grad=case["clip_grad"])
        opt.grad_scaler = None
        opt.partial_reduced_total_norm = torch.FloatTensor([0])
        opt.local_total_norm = None
        opt.send_next_reqs, opt.send_prev_reqs = [], []
        opt.do_prev_step = opt.do_this_step = False
        opt.post_validation_enabled = True
        model = [torch.nn.Linear(1, 1)]
        out = []
        for squares in case["local_squares"]:
            # pre_step's norm part, the fork's own calls in its order (optimizer.py, pre_step).
            opt.recv_pre_step()
            opt.local_total_norm = torch.tensor([float(squares[rank])])
            prev_coeff, this_coeff, _ = opt.partially_reduce_local_total_norm(opt.config.clip_grad)
            opt.send_pre_step()
            opt.do_prev_step, opt.do_this_step = prev_coeff >= 1.0, this_coeff >= 1.0  # can_local_step
            # The fork's train_step: run_forward_backward_func(optimizer).
            from megatron.core.pipeline_parallel import get_forward_backward_func
            fbf = get_forward_backward_func()
            result = fbf(forward_step_func=_no_forward_step, data_iterator=None, model=model,
                         num_microbatches=1, seq_length=1, micro_batch_size=1, decoder_seq_length=None,
                         forward_only=False, optimizer=opt)
            states = {k: (v.item() if hasattr(v, "item") else v)
                      for k, v in getattr(opt, "fully_reduced_global_states", {}).items()}
            out.append({"result": result, "do_this_step": opt.do_this_step, "states": states,
                        "fbf": f"{fbf.__module__}.{fbf.__name__}"})
        # The last iteration's sends to the previous rank (send_post_validation's), which the fork
        # waits for in the next step's recv_pre_step.
        for req in opt.send_prev_reqs + opt.send_next_reqs:
            req.wait()
        return {"rank": rank, "iterations": out, "patched": patched}
    finally:
        with contextlib.suppress(Exception):
            zb.reset()
            zb.unpatch()
            zb.configure()
        ps.destroy_model_parallel()


def _run_fork_case(case, timeout, progress):
    progress(case["what"])
    if case["what"] == "report":
        import torch.distributed as dist
        return _fork_report(case["root"]) if dist.get_rank() == 0 else None
    return _fork_post_validation(case, timeout)


def fork_cases(fork_root, cases, world=2, timeout=60):
    """Runs the fork cases on `world` workers with the fork's megatron first on sys.path. A case is
    {"what": "report"} (rank 0's _fork_report) or {"what": "post_validation", "local_squares":
    [[per-rank squared local grad norm] per iteration], "clip_grad": c} (every rank's
    _fork_post_validation). Returns, per case, the list of per-rank results or a WorkerError."""
    root = str(Path(fork_root).resolve())
    full = [dict(c, root=root) for c in cases]
    return _run_all(world, full, timeout, "fork", root, lambda gathered, case: gathered)
