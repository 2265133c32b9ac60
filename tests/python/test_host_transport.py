"""The host transport of CPU pipelines (zbpp.distributed.TorchTransport): the socket transport's
setup over the job's c10d store, and the choice between it and the gloo path (ZBPP_HOST_TRANSPORT).

  - a rank that never sets up its transport makes the others fail within their timeout with an
    error naming it (no hang);
  - a 2-rank pipeline trains bit for bit the same over AF_UNIX sockets, TCP sockets and the gloo
    fallback, and each run used the transport it asked for;
  - a rank whose process dies mid-step fails its peer at once through the closed connection (the
    error names the rank), long before the timeout;
  - a bad ZBPP_HOST_TRANSPORT value gets an error listing the allowed ones.
The transport itself (order, both-ways sends, aborts) is tested in C: tests/c/test_transport_socket.c.
"""

import os
import tempfile
import time

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

import pipeline_worker  # noqa: E402


def _spawn(fn, world, *args):
    mp.spawn(fn, args=(world, pipeline_worker.fresh_key("host"), *args), nprocs=world, join=True)


# ---- a rank that never comes ---------------------------------------------------------------------

def _absent_worker(rank, world, port, absent, out_dir):
    import torch.distributed as dist

    from zbpp import distributed

    pipeline_worker._init(rank, world, port)
    store = distributed._default_store()
    result = {}
    if rank != absent:
        t0 = time.monotonic()
        try:
            distributed.TorchTransport(None, timeout=2.0, name=f"absent-{port}").connect()
            result["error"] = None
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["seconds"] = time.monotonic() - t0
        store.add("done", 1)
    else:
        while int(store.add("done", 0)) < world - 1:  # alive, in the group, but never sets up
            time.sleep(0.05)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world,absent", [(2, 1), (3, 0)])
def test_a_rank_that_never_sets_up_is_named(world, absent):
    with tempfile.TemporaryDirectory() as out:
        _spawn(_absent_worker, world, absent, out)
        for r in range(world):
            if r == absent:
                continue
            got = torch.load(os.path.join(out, f"rank{r}.pt"))
            assert got["error"] is not None, f"rank {r} set up a transport without rank {absent}"
            assert "TimeoutError" in got["error"] and f"rank(s) {absent} " in got["error"], got["error"]
            assert got["seconds"] < 30, got  # bounded by the 2 s timeout, not by gloo's 60 s


# ---- the same training over every host transport --------------------------------------------------

def _train_worker(rank, world, port, kinds, out_dir):
    import torch.distributed as dist

    import zbpp
    from zbpp.examples import gpt

    pipeline_worker._init(rank, world, port)
    results = {}
    for kind in kinds:
        os.environ["ZBPP_HOST_TRANSPORT"] = kind
        modules = gpt.build_stages(pipeline_worker.model_config(4), 2 * world, seed=5)
        probe = zbpp.Schedule.generate("zb-v", p=world, m=4, v=2)
        mine = probe.rank_stages(rank)
        probe.close()
        stages = [zbpp.PipelineStage(zbpp.split_linear(modules[s]), s, 2 * world, "cpu") for s in mine]
        sched = zbpp.ScheduleZBVZeroBubble(stages, 4, loss_fn=gpt.loss_fn, timeout=60.0)
        params = [p for st in stages for p in st.submod.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
        data = gpt.Batches(8, 8, seed=5)
        losses = []
        for _ in range(3):
            x, y = data.next()
            got = []
            args = (x,) if sched.holds_first else ()
            kw = {"target": y, "losses": got} if sched.holds_loss else {}
            sched.step(*args, **kw)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append([float(v) for v in got])
        used = sched.transport.kind
        sched.close()
        results[kind] = {"used": used, "losses": losses,
                         "params": [p.detach().clone() for s in mine for p in modules[s].parameters()]}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_sockets_and_gloo_train_bit_for_bit_alike():
    kinds = ["socket", "tcp", "gloo"]
    with tempfile.TemporaryDirectory() as out:
        _spawn(_train_worker, 2, kinds, out)
        for r in range(2):
            got = torch.load(os.path.join(out, f"rank{r}.pt"))
            assert got["socket"]["used"] == "unix", got["socket"]["used"]  # one host: AF_UNIX
            assert got["tcp"]["used"] == "tcp"
            assert got["gloo"]["used"] == "gloo"
            for kind in ("socket", "tcp"):
                assert got[kind]["losses"] == got["gloo"]["losses"], (kind, got[kind]["losses"], got["gloo"]["losses"])
                for i, (a, b) in enumerate(zip(got[kind]["params"], got["gloo"]["params"])):
                    assert torch.equal(a, b), f"rank {r}: parameter {i} differs between {kind} and gloo"


# ---- a rank that dies --------------------------------------------------------------------------------

class _DieAt(torch.nn.Module):
    def __init__(self, inner, call):
        super().__init__()
        self.inner, self.call, self.calls = inner, call, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.call:
            os._exit(3)
        return self.inner(x)


def _death_worker(rank, world, port, out_dir):
    import zbpp
    from zbpp.examples import gpt

    pipeline_worker._init(rank, world, port)
    modules = gpt.build_stages(pipeline_worker.model_config(2), world, seed=1)
    mod = zbpp.split_linear(modules[rank])
    if rank == 1:
        mod = _DieAt(mod, 3)
    stage = zbpp.PipelineStage(mod, rank, world, "cpu")
    # A long timeout: the failure must come from the closed connection.
    sched = zbpp.Schedule1F1B(stage, 4, loss_fn=gpt.loss_fn, timeout=120.0)
    data = gpt.Batches(8, 8, seed=1)
    t0, error = time.monotonic(), None
    try:
        for _ in range(3):
            x, y = data.next()
            sched.step(x) if rank == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        error = f"{type(exc).__name__}: {exc}"
    torch.save({"error": error, "seconds": time.monotonic() - t0, "kind": sched.transport.kind},
               os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # the group lost a rank: no orderly teardown


def test_a_dead_rank_fails_its_peer_through_the_connection():
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_death_worker, args=(2, pipeline_worker.fresh_key("host"), out), nprocs=2,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + 100
        while not all(p.exitcode is not None for p in ctx.processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in ctx.processes:
            if p.exitcode is None:
                p.kill()
        got = torch.load(os.path.join(out, "rank0.pt"))
        assert got["kind"] == "unix"
        assert got["error"] is not None and "rank 1" in got["error"], got["error"]
        assert "closed" in got["error"], got["error"]
        assert got["seconds"] < 60, got  # the connection, not the 120 s timeout


def test_bad_choice_is_refused(monkeypatch):
    from zbpp import distributed

    monkeypatch.setenv("ZBPP_HOST_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="socket, unix, tcp, gloo"):
        distributed.host_transport_kind()
