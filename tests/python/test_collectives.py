"""Collectives over the pipeline group (zbpp.runtime.Transport.all_reduce / broadcast) on the CPU
transports a torch job gets, over gloo and over sockets, 2 and 4 ranks as processes: every rank
gets the sum in rank order, ((x0 + x1) + x2) ..., bit for bit (computed here one addition after
another), in float32 and bfloat16; max keeps NaNs; a broadcast from every root; torch.distributed's
own all_reduce agrees within float32 rounding. On a GPU (marked gpu), the same with CUDA tensors,
which go through host memory: the same bits, in place, on the device. tests/c/test_collectives.c
covers timeouts, aborts and bad arguments on the in-process transport."""

import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

import pipeline_worker  # noqa: E402


def _values(rank, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, generator=g) * torch.where(torch.arange(n) % 3 == 0, 1e6, 1.0)
    return x.to(dtype)


def _worker(rank, world, key, kind, out_dir, device="cpu"):
    import torch.distributed as dist

    from zbpp import distributed

    os.environ["ZBPP_HOST_TRANSPORT"] = kind
    pipeline_worker._init(rank, world, key)
    tt = distributed.TorchTransport(None, timeout=30.0, name=f"coll-{key}")
    t = tt.transport
    n = 5000
    out = {"kind": tt.kind}
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)

    def on_dev(v):
        # Made on the device by a kernel just enqueued: the collective must wait for it.
        return (v.to(dev) * 1).contiguous() if dev.type != "cpu" else v

    x = _values(rank, n)
    got = t.all_reduce(on_dev(x.clone()), "sum", timeout=30.0)
    out["device"] = str(got.device)
    out["sum"] = got.cpu()
    m = _values(rank, n)
    if rank == world - 1:
        m[7] = float("nan")
    out["max"] = t.all_reduce(on_dev(m), "max", timeout=30.0).cpu()
    out["bf16"] = t.all_reduce(on_dev(_values(rank, n, torch.bfloat16)), "sum", timeout=30.0).cpu()
    out["bcast"] = [t.broadcast(on_dev(_values(100 + root, 64) if rank == root else torch.zeros(64)), root).cpu()
                    for root in range(world)]
    ref = x.clone()
    dist.all_reduce(ref)
    out["torch"] = ref
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["gloo", "socket"])
def test_all_reduce_and_broadcast_are_rank_order_exact(world, kind):
    _check(world, kind, "cpu")


@pytest.mark.gpu
def test_cuda_tensors_go_through_host_memory_with_the_same_bits():
    _check(2, "socket", "cuda:0")


def _check(world, kind, device):
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, pipeline_worker.fresh_key("coll"), kind, out, device), nprocs=world, join=True)
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
    want, most = _values(0, 5000), _values(0, 5000)
    bwant = _values(0, 5000, torch.bfloat16)
    for r in range(1, world):
        want = want + _values(r, 5000)
        most = torch.maximum(most, _values(r, 5000))
        bwant = bwant + _values(r, 5000, torch.bfloat16)
    reverse = _values(world - 1, 5000)
    for r in range(world - 2, -1, -1):
        reverse = reverse + _values(r, 5000)
    if world > 2:
        assert not torch.equal(reverse, want), "the data must show the order of the additions"
    for r, got in enumerate(ranks):
        assert got["kind"] == ("gloo" if kind == "gloo" else "unix")  # one host: AF_UNIX sockets
        assert got["device"] == device, "the result stays where the tensor was"
        assert torch.equal(got["sum"], want), f"rank {r}: not the rank-order sum"
        assert torch.isnan(got["max"][7]) and torch.equal(got["max"][8:], most[8:]) and torch.equal(got["max"][:7], most[:7])
        assert torch.equal(got["bf16"], bwant), f"rank {r}: not the rank-order bfloat16 sum"
        for root in range(world):
            assert torch.equal(got["bcast"][root], _values(100 + root, 64))
        torch.testing.assert_close(got["torch"], want, rtol=1e-6, atol=1.0)
