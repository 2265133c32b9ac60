"""zbpp's split layers, where their users look for them: B computes the input gradient, W runs later.

What this is: the public face of the splitters and the W store, under the names zbpp has always
had. `split_linear(module)` splits every linear layer of a module it can in place (torch's
nn.Linear becomes a SplitLinear; Megatron-LM's ColumnParallelLinear / RowParallelLinear and
Transformer Engine's linear modules are split their own way), `split_report(module)` says for each
whether it is split, frozen or not split and why, and a split layer's backward pushes its weight
gradient into the W store, which a pipeline's W op runs.

Where things live (one module per concern, none importing another in a circle):

- zbpp.wgrad_store: WGradStore, default_store, capture, defer_weight_grad, defer_action; which
  kernel runs W (WGradStore.kernel: "torch", torch's own ops, bit for bit nn.Linear's and
  Megatron's gradients; or the C library's GEMM, "cblas" / "cublaslt"), devices and streams.
- zbpp.splitters: the registry a stage asks (split, report, partition, autograd_splitter) and the
  families: splitters.linear (SplitLinear), splitters.megatron (zbpp.megatron.layers),
  splitters.te (zbpp.te_layers); every other parameter is the autograd-graph splitter's.

What this is not: a layer library. Other parametrised layers (LayerNorm, Embedding, ...) keep
autograd's fused backward unless a schedule splits them through the graph (zbpp.splitters).
"""

from .splitters import report as split_report
from .splitters import split as split_linear
from .splitters._base import FROZEN, NOT_SPLIT, SPLIT, SplitEntry, SplitReport
from .splitters.linear import SplitLinear
from .splitters.linear import _SplitLinearFn  # noqa: F401 - zbpp._autograd_split looks for it here
from .wgrad_store import WGradStore, capture, default_store, defer_action, defer_weight_grad
from .wgrad_store import _DTYPE  # noqa: F401 - the library GEMM's dtypes, by their older name
from .wgrad_store import store_of as _store_of  # noqa: F401 - older callers' name

__all__ = ["SplitLinear", "split_linear", "split_report", "SplitReport", "SplitEntry", "WGradStore",
           "default_store", "capture", "defer_weight_grad", "defer_action", "SPLIT", "FROZEN", "NOT_SPLIT"]
