"""PipelineStage: one stage of the pipeline on this rank, and _adopt, which takes torch's stages too.

What this is: the stage class a script builds (its module, its index and the pipeline's size, its
device and group, split_backward and dw_builder), with torch's per-chunk calls that custom functions
make inside a running schedule (forward_one_chunk, backward_one_chunk, ...), and _adopt, which
turns a stage torch made (torch's PipelineStage, or what torch's Pipe.build_stage returns) into a
zbpp one. Scripts import it from zbpp.pipelining (or zbpp.pipelining.stage, torch's path).
What this is not: what runs the stage (PipelineSchedule, zbpp/pipelining/__init__.py) or
build_stage for a traced pipeline (stage.py).
"""

import ast
import inspect
import os

import torch

from .. import cuda
from ..distributed import group_rank, group_size

# PipelineStage's arguments before split_backward, with their defaults, in torch 2.13's order.
_ARGS = (("submodule", inspect.Parameter.empty), ("stage_index", inspect.Parameter.empty),
         ("num_stages", inspect.Parameter.empty), ("device", None), ("input_args", None), ("output_args", None),
         ("output_grads", None), ("input_grads", None), ("group", None), ("dw_builder", None), ("get_mesh", None))


def _torch_order():
    """The installed torch's PipelineStage.__init__ parameter names, in order, or None.

    Why: a call written for the installed torch must bind the same way here, and torch moved
    `group` (position 6 in 2.10 to 2.12, 8 in 2.13, which put output_grads and input_grads before
    it and get_mesh after). Read from torch's source, not imported: torch.distributed.pipelining
    costs about a second to import and importing zbpp.pipelining stays cheap. Where the source
    cannot be read (a torch installed without its .py files), torch's class is imported after all."""
    try:
        path = os.path.join(os.path.dirname(torch.__file__), "distributed", "pipelining", "stage.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, TypeError, ValueError):
        tree = None
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == "PipelineStage":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return [a.arg for a in item.args.posonlyargs + item.args.args][1:]
    try:
        from ._torch import need

        return list(inspect.signature(need("stage").PipelineStage.__init__).parameters)[1:]
    except Exception:  # noqa: BLE001 (no torch pipelining at all: torch 2.13's order, which zbpp documents)
        return None


def _signature():
    """PipelineStage.__init__'s signature: the installed torch's positional order for the names
    zbpp shares with it (up to the first one zbpp does not know), then the rest keyword-only."""
    defaults = dict(_ARGS)
    order = _torch_order() or [name for name, _ in _ARGS]
    positional = []
    for name in order:
        if name not in defaults:
            break
        positional.append(name)
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD)]
    params += [P(name, P.POSITIONAL_OR_KEYWORD, default=defaults[name]) for name in positional]
    params += [P(name, P.KEYWORD_ONLY, default=default) for name, default in _ARGS if name not in positional]
    params.append(P("split_backward", P.KEYWORD_ONLY, default=True))
    return inspect.Signature(params)


_SIGNATURE = _signature()


class PipelineStage:
    """One stage of the pipeline on this rank (torch.distributed.pipelining.PipelineStage's shape).

    submodule: the layers of this stage; stage_index in [0, num_stages); device: where its tensors
    live ("cpu", or a CUDA device: one GPU per rank, all of a rank's stages on it); group: the
    pipeline's process group (None: the default group, or a single process when torch.distributed
    is not initialised).
    The arguments are the installed torch's, in its order (torch 2.13's: output_grads and
    input_grads before group, get_mesh after dw_builder; on torch 2.10 to 2.12, which lack those
    three, they are keyword-only and group is the seventh, as there). input_args and output_args (torch's example
    tensors for the boundaries): when every stage of the pipeline has both, the boundaries' shapes
    come from them and no shape inference runs, as in torch; otherwise the first step infers them.
    output_grads and input_grads are accepted for compatibility (gradients have their activation's
    shape). get_mesh (torch's callback for DTensor boundaries) is accepted too; zbpp's boundaries
    carry plain tensors.
    split_backward (zbpp's, default True): under a schedule with W ops (the zero-bubble kinds),
    each backward of this stage is split into B (the input gradient, sent upstream at once) and W
    (the weight gradients, run at the schedule's W op), for any module: its nn.Linear layers become
    zbpp.SplitLinear (W is a GEMM in zbpp's W store), every other parameter gets its W through the
    autograd graph (zbpp/_autograd_split.py, torch's semantics; the first stage, whose input needs no
    gradient, runs its whole backward at W, as torch's does). False: the backward runs whole at B
    and W ops run only what layers split by hand (zbpp.split_linear) deferred. Schedules without W
    ops (1F1B, GPipe, Interleaved1F1B) run the backward whole either way.
    dw_builder: as torch's, a function that returns a function computing the stage's weight
    gradients: the stage's backward then runs autograd's full backward (the module's own hooks
    decide what it leaves for later), and each W (BACKWARD_WEIGHT) runs the function dw_builder()
    returned at that microbatch's B; a fused backward runs it at once. It takes the place of
    split_backward.
    After a step the last stage holds its microbatches' outputs in `output_chunks` (as torch's);
    clear_runtime_states() empties it, and every step starts with it.
    """

    def __init__(self, *args, **kwargs):
        try:
            bound = _SIGNATURE.bind(self, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"zbpp.PipelineStage: {exc}") from None
        bound.apply_defaults()
        self._init(**{k: v for k, v in bound.arguments.items() if k != "self"})

    __init__.__signature__ = _SIGNATURE

    def _init(self, submodule, stage_index, num_stages, device, input_args, output_args, output_grads, input_grads,
              group, dw_builder, get_mesh, split_backward):
        if not isinstance(submodule, torch.nn.Module):
            raise TypeError(f"zbpp.PipelineStage: submodule must be a torch.nn.Module, got {type(submodule).__name__}")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"zbpp.PipelineStage: num_stages must be an int >= 1, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"zbpp.PipelineStage: stage_index {stage_index!r} is out of range; "
                             f"it must be in [0, {num_stages - 1}] for num_stages={num_stages}")
        if dw_builder is not None and not callable(dw_builder):
            raise TypeError(f"zbpp.PipelineStage: dw_builder must be a function that returns the weight-gradient "
                            f"function, got {type(dw_builder).__name__}")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        try:
            self.device = cuda.device_of(device)
        except ValueError as exc:
            raise ValueError(f"zbpp.PipelineStage: {str(exc).replace('zbpp: ', '', 1)}") from None
        self.group = group
        self.group_rank = group_rank(group)
        self.group_size = group_size(group)
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.dw_builder = dw_builder
        self.get_mesh = get_mesh
        self._user_args = (input_args, output_args)  # torch's example tensors: complete on every stage, no inference
        self.split_backward = bool(split_backward)
        self.has_backward = True
        self.output_chunks = []
        self.fwd_cache = {}
        self.stage_index_to_group_rank = {}

    def clear_runtime_states(self):
        """Forgets the last step's outputs (output_chunks) and cached forwards, as torch's does."""
        self.output_chunks.clear()
        self.fwd_cache.clear()

    # ---- torch's calls, for the custom functions of _PipelineScheduleRuntime (_custom.py) ----------
    # Inside such a function they run this stage's work for the action being run: the runner has
    # received the inputs (args/kwargs are used on stage 0 only, as zbpp split them) and sends the
    # outputs after the function returns.

    def _runtime(self, call):
        schedule = self.__dict__.get("_zb_schedule")
        schedule = schedule() if schedule is not None else None
        if schedule is None:
            raise RuntimeError(f"zbpp: stage {self.stage_index}.{call}() runs inside a custom function of a "
                               "running schedule (_PipelineScheduleRuntime.register_custom_function) only")
        return schedule

    def forward_one_chunk(self, fwd_chunk_id, args=None, kwargs=None, save_forward_output=True):
        """torch's: this stage's forward of microbatch fwd_chunk_id; returns its output."""
        return self._runtime("forward_one_chunk")._custom_run("F", self.stage_index, fwd_chunk_id)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False,
                           retain_graph_for_packed_imgs=False):
        """torch's: this stage's backward of microbatch bwd_chunk_id, as the action says (a full
        backward runs its W at once after the function returns, a split one at its W op)."""
        self._runtime("backward_one_chunk")._custom_run("B", self.stage_index, bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        """torch's: inside the custom function of a BACKWARD_WEIGHT action, runs the function
        dw_builder returned at that microbatch's B (zbpp's own W work for it has run at the W op)."""
        self._runtime("backward_weight_one_chunk")._custom_run_w(self.stage_index, bwd_chunk_id)

    def set_local_fwd_input(self, prev_stage_outputs, mb_index):
        """torch's hand-over between stages of one rank: zbpp's runner does it itself."""

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
        """torch's hand-over between stages of one rank: zbpp's runner does it itself."""

    def get_local_bwd_output(self, mb_index):
        """torch's hand-over between stages of one rank: zbpp's runner does it itself (None)."""
        return None

    def scale_grads(self, grad_scale_factor):
        """torch's: divides this stage's gradients by grad_scale_factor now; the schedule's own
        scaling at the end of the step then leaves this stage alone."""
        self._runtime("scale_grads")._custom_scale(self, grad_scale_factor)

    def __repr__(self):
        return f"<zbpp.PipelineStage {self.stage_index}/{self.num_stages} on rank {self.group_rank}>"


def _adopt(stage, who):
    """zbpp's stage for a stage object: itself, or for a stage torch made (torch's PipelineStage,
    or what torch's Pipe.build_stage returns) a zbpp PipelineStage over the same module, index,
    device and group, so scripts that build their stages with torch's classes run on zbpp too."""
    if isinstance(stage, PipelineStage):
        return stage
    try:
        from ._torch import need

        base = need("stage")._PipelineStageBase
    except ImportError:  # a torch without torch.distributed.pipelining made no stages
        base = None
    if base is not None and isinstance(stage, base):
        if getattr(stage, "submod", None) is None or not hasattr(stage, "stage_index") or not hasattr(stage, "device"):
            return stage  # a stand-in with only the pipeline's shape (torch's tests' mocks): planned, not run
        from .stage import from_torch_stage

        return from_torch_stage(stage)
    raise TypeError(f"zbpp.{who}: expected a zbpp.PipelineStage (or a stage torch.distributed.pipelining made), "
                    f"or a list of them; got {type(stage).__name__}")
