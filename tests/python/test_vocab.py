"""Vocabulary Parallelism's passes in the torch layer (zbpp.vocab) on CPU over gloo, 2 and 4 ranks
as processes: the output layer's per-token cross entropy and its gradients (input and weight) are
the unsharded layer's within float32 rounding, fused (Vocab-2) and unfused (Vocab-1), with label
smoothing as torch's F.cross_entropy has it, for a vocabulary that the ranks divide and one they
do not (padded as Megatron pads); Megatron-core's own VocabParallelCrossEntropy on the same shards
gives the same loss and gradients (with $ZBPP_MEGATRON_LM); the embedding forward is exact and its
gradient the unsharded one's; tied weights get both gradients; gather() gives the whole weight
back."""

import os
import sys
import tempfile

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

import pipeline_worker  # noqa: E402

T, H = 24, 16
TOL = dict(rtol=2e-5, atol=2e-6)


def _data(V):
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(V, H, generator=g) * 0.5
    emb = torch.randn(V, H, generator=g) * 0.5
    h = torch.randn(T, H, generator=g) * 2
    target = torch.randint(0, V, (T,), generator=g)
    grad_loss = torch.rand(T, generator=g) / T
    return weight, emb, h, target, grad_loss


def _reference(weight, h, target, grad_loss, smoothing):
    w = weight.clone().requires_grad_(True)
    x = h.clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(x @ w.t(), target, reduction="none", label_smoothing=smoothing)
    loss.backward(grad_loss)
    return loss.detach(), x.grad, w.grad


def _megatron(out, h, target, grad_loss, tr):
    """Megatron-core's VocabParallelCrossEntropy (its static steps) on this rank's shard, with
    zbpp's collectives where Megatron all-reduces over its tensor-parallel group."""
    sys.path.insert(0, os.environ["ZBPP_MEGATRON_LM"])
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as M

    logits = h @ out.weight.detach().t()
    lp, mx = M.calculate_logits_max(logits)
    tr.all_reduce(mx, "max")
    mask, masked_1d, predicted, sum_exp, exp_logits = M.calculate_predicted_logits(lp, target, mx, out.start, out.end)
    tr.all_reduce(predicted, "sum")
    tr.all_reduce(sum_exp, "sum")
    softmax, loss = M.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    grad_2d, arange_1d, update, grad_input = M.prepare_gradient_calculation_operands(softmax, mask)
    grad_logits = M.calculate_gradients(grad_2d, arange_1d, masked_1d, update, grad_input, grad_loss)
    grad_h = tr.all_reduce((grad_logits @ out.weight.detach()).contiguous(), "sum")
    return loss, grad_h, grad_logits.t() @ h


def _worker(rank, world, key, V, out_dir):
    import torch.distributed as dist

    from zbpp import distributed, vocab

    pipeline_worker._init(rank, world, key)
    tr = distributed.TorchTransport(None, timeout=30.0, name=f"vocab-{key}").transport
    weight, emb_w, h, target, grad_loss = _data(V)
    res = {}
    for fused in (True, False):
        for smoothing in (0.0, 0.1):
            out = vocab.VocabParallelOutput(weight, rank, world, tr, fused=fused, label_smoothing=smoothing)
            loss, grad_h = out.forward_backward(h, target, grad_loss)
            res[(fused, smoothing)] = (loss, grad_h, out.weight.grad.clone(), out.start, out.real)
    res["gather"] = vocab.VocabParallelOutput(weight, rank, world, tr).gather()
    if os.environ.get("ZBPP_MEGATRON_LM") and V % world == 0:
        out = vocab.VocabParallelOutput(weight, rank, world, tr)
        res["megatron"] = _megatron(out, h, target, grad_loss, tr)
    # The input embedding, tied to the output layer: IF, then S/C0/T, then IB from rank 0.
    emb = vocab.VocabParallelEmbedding(emb_w, rank, world, tr)
    tied = vocab.VocabParallelOutput(tied=emb)
    res["embed"] = emb.embed(target)
    tied.forward_backward(h, target, grad_loss)
    grad_e = h * 0.25 if rank == 0 else torch.empty(T, H)  # stage 0's gradient, broadcast to all
    emb.embed_backward(target, grad_e, root=0)
    res["tied"] = (emb.weight.grad.clone(), emb.start, emb.real)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world,V", [(2, 40), (4, 40), (4, 37), (4, 5)])  # 5: rank 3 holds only padding
def test_vocab_parallel_output_and_embedding_equal_the_unsharded_layers(world, V):
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, pipeline_worker.fresh_key("vocab"), V, out), nprocs=world, join=True)
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
    weight, emb_w, h, target, grad_loss = _data(V)
    covered = 0
    for (fused, smoothing) in [(True, 0.0), (True, 0.1), (False, 0.0), (False, 0.1)]:
        ref_loss, ref_gh, ref_gw = _reference(weight, h, target, grad_loss, smoothing)
        for r, res in enumerate(ranks):
            loss, grad_h, grad_w, start, real = res[(fused, smoothing)]
            what = f"rank {r}, fused={fused}, label_smoothing={smoothing}"
            torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{what}: loss: {m}")
            torch.testing.assert_close(grad_h, ref_gh, **TOL, msg=lambda m: f"{what}: input gradient: {m}")
            torch.testing.assert_close(grad_w[:real], ref_gw[start:start + real], **TOL,
                                       msg=lambda m: f"{what}: weight gradient: {m}")
            assert not grad_w[real:].any(), f"{what}: padding rows got a gradient"
            covered += real if fused and not smoothing else 0
    assert covered == V, "the shards cover the vocabulary once"
    for r, res in enumerate(ranks):
        assert torch.equal(res["gather"], weight), f"rank {r}: gather() is not the whole weight"
        assert torch.equal(res["embed"], emb_w[target]), f"rank {r}: the embedding is not exact"
    # Tied: the shared shard's gradient is the output layer's plus the embedding's.
    w = emb_w.clone().requires_grad_(True)
    x = h.clone()
    torch.nn.functional.cross_entropy(x @ w.t(), target, reduction="none").backward(grad_loss)
    torch.nn.functional.embedding(target, w).backward(h * 0.25)
    for r, res in enumerate(ranks):
        grad, start, real = res["tied"]
        torch.testing.assert_close(grad[:real], w.grad[start:start + real], **TOL)
    if os.environ.get("ZBPP_MEGATRON_LM") and V % world == 0:
        assert "megatron" in ranks[0], "Megatron-core's cross entropy did not run"
        for r, res in enumerate(ranks):
            m_loss, m_gh, m_gw = res["megatron"]
            loss, grad_h, grad_w, start, real = res[(True, 0.0)]
            torch.testing.assert_close(loss, m_loss, **TOL)
            torch.testing.assert_close(grad_h, m_gh, **TOL)
            torch.testing.assert_close(grad_w, m_gw, **TOL)


@pytest.mark.parametrize("fused", [True, False])
def test_ignored_targets_count_for_nothing(fused):
    """Targets equal to ignore_index (-100, F.cross_entropy's): no loss, no gradient from them,
    whatever gradient the caller gives their rows; the mean is over the others (one rank)."""
    from zbpp.vocab import VocabParallelOutput

    weight, _, h, target, grad_loss = _data(37)
    target = torch.where(torch.arange(T) % 4 == 0, torch.full_like(target, -100), target)
    out = VocabParallelOutput(weight, 0, 1, fused=fused, label_smoothing=0.1)
    loss, grad_h = out.forward_backward(h, target, grad_loss)
    ref_loss, ref_h, ref_w = _reference(weight, h, target, grad_loss, 0.1)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(grad_h, ref_h, **TOL)
    torch.testing.assert_close(out.weight.grad, ref_w, **TOL)
    torch.testing.assert_close(out.mean(loss, target), torch.nn.functional.cross_entropy(
        h @ weight.t(), target, label_smoothing=0.1), **TOL)


def test_bad_arguments_say_what_is_allowed():
    from zbpp import vocab

    with pytest.raises(ValueError, match=r"rank 4 in 0\.\.3"):
        vocab.vocab_shard_range(10, 4, 4)
    with pytest.raises(ValueError, match=r"whole \[vocab, hidden\] weight"):
        vocab.VocabParallelOutput(torch.zeros(4), 0, 2, None)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
        vocab.VocabParallelOutput(torch.zeros(4, 2), 0, 1, None, label_smoothing=1.0)
    with pytest.raises(ValueError, match="2 ranks need their transport"):
        vocab.VocabParallelOutput(torch.zeros(4, 2), 0, 2, None)
    weight, _, h, target, grad_loss = _data(40)
    alone = vocab.VocabParallelOutput(weight)  # one rank: nothing to combine
    loss, grad_h = alone.forward_backward(h, target, grad_loss)
    ref_loss, ref_gh, ref_gw = _reference(weight, h, target, grad_loss, 0.0)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(grad_h, ref_gh, **TOL)
    torch.testing.assert_close(alone.weight.grad, ref_gw, **TOL)
    with pytest.raises(ValueError, match=r"vocabulary ids in 0\.\.39 or ignore_index \(-100\)"):
        alone.s_pass(h, torch.full((T,), -1))
    assert vocab.vocab_shard_range(37, 3, 4) == (30, 40, 40)
    assert vocab.vocab_shard_range(37, 0, 4, pad_multiple=8) == (0, 16, 64)  # Megatron: a multiple of 8 x 4
