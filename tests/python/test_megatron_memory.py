"""--zero-bubble-max-pending-backward auto: the memory limit from measured memory (zbpp.megatron.memory)."""

import pytest

pytest.importorskip("torch")


def test_limit_counts_the_microbatches_that_fit_beside_the_rest():
    from zbpp.megatron.memory import limit_from

    GiB = 1 << 30
    # 80 GiB device, 85%: 68 GiB usable. Peak 40 GiB while 4 microbatches of 2 GiB were alive: the
    # rest is 32 GiB, so 36 GiB of activations fit: 18 microbatches, more than 2p = 8, so 8.
    assert limit_from(2 * GiB, 40 * GiB, 4, 80 * GiB, 85, 4) == 8
    # Tight: the rest is 60 GiB, 8 GiB left: 4 microbatches of 2 GiB, which is p.
    assert limit_from(2 * GiB, 68 * GiB, 4, 80 * GiB, 85, 4) == 4
    # Between p and 2p: 12 GiB left, 6 microbatches.
    assert limit_from(2 * GiB, 64 * GiB, 4, 80 * GiB, 85, 4) == 6
    # Never below 1F1B's p (the schedule needs it), even when the budget is already exceeded.
    assert limit_from(2 * GiB, 79 * GiB, 4, 80 * GiB, 85, 4) == 4
    # A forward that keeps nothing: memory does not bind.
    assert limit_from(0, 10 * GiB, 4, 80 * GiB, 85, 4) == 8
    # A lower percentile lowers it.
    assert limit_from(2 * GiB, 40 * GiB, 4, 80 * GiB, 50, 4) == 4


@pytest.mark.gpu
def test_meter_measures_a_forward_on_cuda():
    import torch

    from zbpp.megatron.memory import Meter

    dev = torch.device("cuda")
    meter = Meter(dev)
    keep = []
    meter.forward(lambda: keep.append(torch.empty(1 << 20, dtype=torch.uint8, device=dev)))
    meter.forward(lambda: keep.append(torch.empty(1 << 20, dtype=torch.uint8, device=dev)))
    assert min(meter.deltas) >= 1 << 20 and meter.max_live == 2
    meter.backward_done()
    assert meter.live == 1
    assert 1 <= meter.limit(85, 1, None) <= 2
