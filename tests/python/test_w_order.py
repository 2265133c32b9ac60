"""A stage's W ops may run in another order than its B ops (a schedule from CSV; torch's grammar
allows it, and zbpp's validator too): every microbatch's weight gradient is still added, on 2
ranks over gloo, for a stage on the last rank and one holding the loss. Before zbpp.wgrad_store's
fix, the first B's W wrote the gradient instead of adding to it, so whatever ran before it was
lost (a 5-15% error here, silently)."""

import os
import sys
import tempfile

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_worker  # noqa: E402
import vocab_worker  # noqa: E402
import zbpp  # noqa: E402


def _reversed_w(stage):
    """ZB-V at p = 2, m = 4 with `stage`'s W ops moved to the end of its rank's list, last
    microbatch first."""
    s = zbpp.Schedule.generate("zb-v", p=2, m=4, v=2)
    ops = [[(o.type, o.stage, o.mb) for o in s.rank_ops(r)] for r in range(2)]
    r = s.stage_rank(stage)
    ws = [o for o in ops[r] if o[0] == "W" and o[1] == stage]
    ops[r] = [o for o in ops[r] if not (o[0] == "W" and o[1] == stage)] + ws[::-1]
    s.close()
    t = zbpp.Schedule.from_ops(ops, 4, placement="v", v=2)
    t.validate()
    try:
        return t.to_csv()
    finally:
        t.close()


def _reference():
    V, m = 37, 4
    emb, out, blocks = vocab_worker.build(V, 8)
    x, y = vocab_worker.batches(V, m, 1)[0]
    for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
        h = emb(xi)
        for b in blocks:
            h = b(h)
        torch.nn.functional.cross_entropy(out(h).reshape(-1, V), yi.reshape(-1)).backward()
    return [b[0].weight.grad / m for b in blocks]  # the schedule divides by m (scale_grads)


@pytest.mark.parametrize("stage", [2, 3], ids=["middle-stage", "loss-stage"])
def test_every_microbatch_counts_whatever_the_w_order(stage):
    csv = _reversed_w(stage)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(vocab_worker.run_csv_grads, args=(2, pipeline_worker.fresh_key("w"), csv, out), nprocs=2, join=True)
        got = {}
        for r in range(2):
            got.update(torch.load(os.path.join(out, f"rank{r}.pt")))
    ref = _reference()
    for k, g in sorted(got.items()):
        torch.testing.assert_close(g, ref[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"block {k}: {m}")
