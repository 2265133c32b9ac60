"""--zero-bubble-max-pending-backward auto: the memory limit of --enable-zero-bubble's schedule from
measured memory, as the reference fork does.

The first training call runs zb-auto at limit p (1F1B's peak: p microbatches' activations per rank)
and measures, on each rank, what one microbatch's forward leaves allocated on the device (the
activations kept for its backward) and the peak allocation of the step. What is not activations
(parameters, gradients, optimizer state, workspaces) is the peak minus the activations held at
the peak. The limit is then the number of microbatches whose activations fit in
--zero-bubble-adaptive-memory-limit-percentile percent of the device's memory beside that, the
smallest over the pipeline's ranks (one schedule for all), between p and 2p (2p already gives
zb-auto ZB-H2's freedom; more buys nothing). After the first call the schedule plans again for it
in place (PipelineSchedule.replan, with the measured costs once the timer iterations have given
some), so the profiling of --zero-bubble-pipeline-timers-* goes on undisturbed.

Without CUDA there is no device memory to measure: the limit stays p.
"""

import torch
import torch.distributed as dist


def limit_from(activation_bytes, peak_bytes, held_at_peak, total_bytes, percentile, p):
    """The memory limit in microbatches (an int in [p, 2p]) for one rank: activation_bytes of one
    microbatch, the step's peak allocation peak_bytes while held_at_peak microbatches' activations
    were alive, total_bytes of device memory of which percentile percent may be used."""
    if activation_bytes <= 0:
        return 2 * p  # nothing measurable is kept between F and B: memory does not bind
    baseline = max(0, peak_bytes - held_at_peak * activation_bytes)
    budget = total_bytes * percentile / 100.0 - baseline
    fit = int(budget // activation_bytes)
    return max(p, min(2 * p, fit))


class Meter:
    """Measures one training call's forwards on a CUDA device (see the module docstring)."""

    def __init__(self, device):
        self.device = device
        self.deltas = []
        self.live = 0
        self.max_live = 0
        torch.cuda.reset_peak_memory_stats(device)

    def forward(self, run):
        before = torch.cuda.memory_allocated(self.device)
        out = run()
        self.deltas.append(torch.cuda.memory_allocated(self.device) - before)
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        return out

    def backward_done(self):
        self.live = max(0, self.live - 1)

    def limit(self, percentile, p, group):
        """This rank's limit, then the smallest over the pipeline (every rank calls it)."""
        act = max(self.deltas) if self.deltas else 0
        total = torch.cuda.get_device_properties(self.device).total_memory
        mine = limit_from(act, torch.cuda.max_memory_allocated(self.device), self.max_live, total, percentile, p)
        t = torch.tensor([mine], dtype=torch.int64, device=self.device if _device_group(group) else "cpu")
        if dist.is_available() and dist.is_initialized() and p > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())


def _device_group(group):
    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return False
