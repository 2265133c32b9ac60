"""runtime.Runner from Python without torch: the caller's allocator (zb_runner_config_t.alloc_cb)
gets every message buffer at creation and each back at close, none during iterations, and an
allocator that fails makes creation fail with its own exception as the cause."""

import ctypes

import pytest

from zbpp import Schedule, ZbError, runtime


def _runner(allocator, kind="interleaved-1f1b", v=2):
    """One rank holding every stage of a loop (stage hand-offs stay on the rank)."""
    schedule = Schedule.generate(kind, p=1, m=4, v=v)
    backend = runtime.Backend("host")
    store = runtime.WStore(backend, lambda token, ran: None)
    calls = []

    def forward(stage, mb, inp, out):
        calls.append(("F", stage, mb))
        if out:
            ctypes.memset(out, stage + 1, 16)
        if inp:
            assert ctypes.string_at(inp, 16) == bytes([stage]) * 16  # what the previous stage wrote

    def backward(stage, mb, gout, gin):
        calls.append(("B", stage, mb))
        if gin:
            ctypes.memset(gin, 7, 16)

    sizes = [16] * (schedule.stages - 1)
    run = runtime.Runner(schedule, 0, backend, store, None, sizes, forward, backward, allocator=allocator)
    return run, calls, (schedule, backend, store)


class Counting:
    def __init__(self):
        self.live = {}
        self.allocs = self.frees = 0

    def alloc(self, nbytes):
        buf = ctypes.create_string_buffer(nbytes)
        addr = ctypes.addressof(buf)
        self.live[addr] = buf
        self.allocs += 1
        return addr

    def free(self, addr):
        del self.live[addr]
        self.frees += 1


def test_the_callers_allocator_holds_every_buffer_from_create_to_close():
    counting = Counting()
    run, calls, keep = _runner((counting.alloc, counting.free))
    at_create = counting.allocs
    assert at_create > 0
    for _ in range(3):
        run.run()
    assert counting.allocs == at_create, "a buffer was allocated inside an iteration"
    assert len([c for c in calls if c[0] == "F"]) == 3 * 4 * 2
    run.close()
    assert counting.frees == counting.allocs and not counting.live
    for obj in reversed(keep):
        obj.close()


def test_an_allocator_that_fails_fails_creation_with_its_exception():
    def broken(nbytes):
        raise MemoryError(f"no room for {nbytes} bytes")

    with pytest.raises(ZbError) as err:
        _runner((broken, lambda addr: None))
    assert isinstance(err.value.__cause__, MemoryError)
    assert "alloc_cb" in str(err.value)


def test_the_nccl_abort_signal_over_a_store_keeps_the_first_failure(tmp_path):
    """The NCCL transport's abort signal (zb_abort_signal_t) over a torch Store, as its watchdog
    calls it: nothing until a rank publishes, then that rank's message on every rank; a second
    failure does not replace the first."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    poll, publish = runtime._store_signal(store, "zbpp/abort/test")
    buf = ctypes.create_string_buffer(64)
    assert poll(None, ctypes.addressof(buf), 64) == 0
    publish(None, b"rank 2 aborted: the forward callback raised")
    publish(None, b"rank 0: the send of 16 bytes to rank 1 has not finished")
    assert poll(None, ctypes.addressof(buf), 64) == 1
    assert buf.value == b"rank 2 aborted: the forward callback raised"
    small = ctypes.create_string_buffer(8)  # cut to the caller's buffer, NUL-terminated
    assert poll(None, ctypes.addressof(small), 8) == 1
    assert small.value == b"rank 2 "


def _staged_rank(rank, fd, got, errors, staged=True):
    """Rank `rank` of a 2-rank 1F1B over a socket transport, staged (Transport.staged) or not:
    activations carry (stage, mb) so the receiver checks what arrived."""
    schedule = Schedule.generate("1f1b", p=2, m=4)
    backend = runtime.Backend("host")
    store = runtime.WStore(backend, lambda token, ran: None)
    sock = runtime.Transport.socket(rank, 2, [fd if r != rank else -1 for r in range(2)])
    tr = runtime.Transport.staged(sock) if staged else sock

    def forward(stage, mb, inp, out):
        if inp:
            got.append(("F", stage, mb, ctypes.string_at(inp, 16)))
        if out:
            ctypes.memmove(out, bytes([stage + 1, mb]) * 8, 16)

    def backward(stage, mb, gout, gin):
        if gout:
            got.append(("B", stage, mb, ctypes.string_at(gout, 16)))
        if gin:
            ctypes.memmove(gin, bytes([100 + stage, mb]) * 8, 16)

    run = runtime.Runner(schedule, rank, backend, store, tr, [16], forward, backward, timeout_s=20.0)
    try:
        for _ in range(2):
            run.run()
        run.close()
        if staged:
            with pytest.raises(ZbError, match="still used"):
                sock.close()  # the staged transport holds it
            tr.close()
        sock.close()
    except BaseException as exc:  # noqa: BLE001 - a thread's failure: the test reads it
        errors.append(exc)
    finally:
        run.close()
        tr.close()
        sock.close()
        store.close()
        backend.close()
        schedule.close()


@pytest.mark.parametrize("staged", [True, False])
def test_the_staged_transport_carries_a_runner_over_sockets(staged):
    # The staged transport (host copies around a host transport; the pipeline's answer to ranks
    # sharing a GPU) carries every activation and gradient to its stage, as the socket one does.
    import socket
    import threading

    a, b = socket.socketpair()
    got = [[], []]
    errors = []
    threads = [threading.Thread(target=_staged_rank, args=(r, s.detach(), got[r], errors, staged))
               for r, s in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    want_f = [("F", 1, mb, bytes([1, mb]) * 8) for mb in range(4)] * 2  # stage 0 -> 1
    want_b = [("B", 0, mb, bytes([101, mb]) * 8) for mb in range(4)] * 2  # stage 1 -> 0
    assert got[1] == want_f
    assert got[0] == want_b


def test_the_runner_calls_vocab_at_every_vocabulary_pass_in_list_order():
    """A schedule with Vocabulary Parallelism's passes runs them through vocab= (the runner's
    vocab_cb) between its other ops, in the list's order; without vocab= creation says what it
    needs; an exception in the pass fails the run with that exception."""
    schedule = Schedule.generate("1f1b", p=1, m=3, vocab=2, vocab_times={"s": 0.5, "t": 0.5})
    backend = runtime.Backend("host")
    store = runtime.WStore(backend, lambda token, ran: None)
    calls = []

    def forward(stage, mb, inp, out):
        calls.append(("F", mb))

    def backward(stage, mb, gout, gin):
        calls.append(("BW", mb))

    def vocab(kind, mb):
        calls.append((kind, mb))

    with pytest.raises(ZbError, match="vocab_cb; set it"):
        runtime.Runner(schedule, 0, backend, store, None, [], forward, backward)
    run = runtime.Runner(schedule, 0, backend, store, None, [], forward, backward, vocab=vocab)
    run.run()
    assert calls == [(op.type, op.mb) for op in schedule.rank_ops(0)]
    assert {kind for kind, _ in calls} == {"IF", "F", "S", "T", "BW", "IB"}

    def broken(kind, mb):
        if kind == "T":
            raise RuntimeError("the T pass broke")

    run2 = runtime.Runner(schedule, 0, backend, store, None, [], forward, backward, vocab=broken)
    with pytest.raises(ZbError, match=r"T\(mb 0\): the vocabulary pass callback") as failed:
        run2.run()
    assert "the T pass broke" in str(failed.value.__cause__)
    run.close(), run2.close()
