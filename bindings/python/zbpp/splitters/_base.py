"""What every splitter shares: a layer's split status and the report that lists them.

What this is: the three statuses (SPLIT, FROZEN, NOT_SPLIT), SplitEntry and SplitReport, and
frozen_or(). The layer families (linear.py, megatron.py, te.py, and the implementations they drive:
zbpp.megatron.layers, zbpp.te_layers) import these and nothing of the registry, so no module
imports another in a circle.
"""

from typing import NamedTuple

__all__ = ["SPLIT", "FROZEN", "NOT_SPLIT", "SplitEntry", "SplitReport", "frozen_or"]

SPLIT = "split"          # W of this layer goes to the W store
FROZEN = "frozen"        # nothing to defer: no trainable weight (no weight gradient at all)
NOT_SPLIT = "not split"  # has a weight gradient, and it runs inside B


class SplitEntry(NamedTuple):
    name: str       # the qualified module name ("" for the module itself)
    kind: str       # the layer's class name
    status: str     # SPLIT, FROZEN or NOT_SPLIT
    reason: str     # why (empty for a plain split layer)


class SplitReport:
    """What `split_report(module)` found: `entries` (one SplitEntry per linear layer, in module
    order), and the lists `split`, `frozen` and `not_split` of them. str() gives a table."""

    def __init__(self, entries):
        self.entries = list(entries)

    def _with(self, status):
        return [e for e in self.entries if e.status == status]

    @property
    def split(self):
        return self._with(SPLIT)

    @property
    def frozen(self):
        return self._with(FROZEN)

    @property
    def not_split(self):
        return self._with(NOT_SPLIT)

    def __iter__(self):
        return iter(self.entries)

    def __len__(self):
        return len(self.entries)

    def __repr__(self):
        return (f"SplitReport(split={len(self.split)}, frozen={len(self.frozen)}, "
                f"not_split={len(self.not_split)})")

    def __str__(self):
        if not self.entries:
            return "no linear layers"
        names = [e.name or "<module>" for e in self.entries]
        width = max(len(n) for n in names)
        lines = []
        for n, e in zip(names, self.entries):
            line = f"{n:<{width}}  {e.kind:<30}  {e.status}"
            lines.append(line + (f": {e.reason}" if e.reason else ""))
        return "\n".join(lines)

    def warning_text(self):
        """One message for the layers not split, grouped by reason."""
        by_reason = {}
        for e in self.not_split:
            by_reason.setdefault(e.reason, []).append(f"{e.name or '<module>'} ({e.kind})")
        parts = [f"{', '.join(names)}: {reason}" for reason, names in by_reason.items()]
        return (f"zbpp.split_linear: {len(self.not_split)} linear layer(s) not split, so their weight "
                "gradients run inside B (no deferred W): " + "; ".join(parts))


def frozen_or(m, found):
    """FROZEN when every parameter of `m` is frozen (nothing to defer), else `found`."""
    params = list(m.parameters())
    if params and not any(p.requires_grad for p in params):
        return FROZEN, "no trainable parameters: no weight gradient to defer"
    return found
