"""Vocabulary Parallelism's lanes (zbpp/pipelining/_vocab.py): one kind of pass's collectives in
microbatch order, on a thread, a transport and (CUDA) a stream of their own (_Lane); the values the
runner's thread hands to a lane's job (_Box); and what both wait with (_await), bounded by the
schedule's timeout and watching the pipeline's failure key.

Why lanes, and why not on the compute stream: _vocab.py's module docstring and _Lane's.
"""

import contextlib
import queue
import threading
import time

import torch

_NOT_YET = object()


_job = threading.local()  # in a lane's thread: the compute stream of the job it runs (_handoff)


def _handoff(*tensors):
    """Tensors a lane's job made on the lane's stream that the pipeline's compute stream reads
    later (results, and what the job leaves in the passes' state): torch's allocator must not give
    their memory to the lane's stream again before the compute stream is done with them
    (record_stream). Nested tuples and lists are walked; anything else is ignored."""
    stream = getattr(_job, "compute", None)
    if stream is None:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)
        elif isinstance(t, (tuple, list)):
            _handoff(*t)


def _await(cv, check, timeout, peer_failure, what, after):
    """check() under cv until it gives something other than _NOT_YET (it may raise), bounded by
    `timeout` seconds; between waits, the pipeline's failure key (peer_failure) is looked at, so a
    failure elsewhere ends the wait at once. `after`: the timeout message's tail."""
    deadline = time.monotonic() + timeout
    while True:
        with cv:
            got = check()
            if got is not _NOT_YET:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"zbpp vocab_parallel: {what} did not come within {timeout:g} s{after}")
            cv.wait(min(left, 0.2))
            got = check()
            if got is not _NOT_YET:
                return got
        failed = peer_failure()
        if failed is not None:
            raise RuntimeError(f"zbpp vocab_parallel: {what}: the pipeline failed: {failed}")


class _Lane:
    """One kind of pass's collectives, in microbatch order, on a thread and a transport of their
    own: start(mb, fn) queues fn(transport); wait(mb) gives its result. Each step is an epoch: a
    job left from a step that failed records nothing in the next.

    CUDA (stream: the lane's own): a job runs on the lane's stream, after an event the compute
    stream recorded when the job was queued, so it reads what the pass made and nothing the
    compute stream was given later. Not on the compute stream itself: there the runner makes the
    stream wait for NCCL receives (on the device) that may need this very collective on another
    rank first, and the job's copy to the host would wait for them: a deadlock. The job ends with
    its stream synchronised, so its results are complete when wait() gives them, and hands what it
    made to the compute stream (_handoff)."""

    def __init__(self, name, transport, timeout, peer_failure, device=None, stream=None):
        self.name, self.transport, self.timeout, self._peer_failure = name, transport, timeout, peer_failure
        self.device, self.stream = device, stream
        self.jobs, self.cv = queue.Queue(), threading.Condition()
        self.results, self.started, self.failed, self.epoch = {}, set(), None, 0
        self._thread = threading.Thread(target=self._run, name=f"zbpp-vocab-{name}", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            epoch, mb, fn, ready, compute, default = job
            try:
                result, err = self._call(fn, ready, compute, default), None
            except BaseException as exc:  # noqa: BLE001 - the waiting side raises it
                result, err = None, exc
            with self.cv:
                if epoch == self.epoch:
                    if err is not None and self.failed is None:
                        self.failed = (mb, err)
                    self.results[mb] = result
                    self.cv.notify_all()
            del job, fn, result, err  # nothing of a microbatch outlives its job here

    def start(self, mb, fn):
        """Queues fn, from the runner's thread, after the pass's work that fn reads was given to
        the compute stream (see the class docstring). fn runs with the default device of the
        caller (torch's is per thread)."""
        ready = compute = None
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.device)
            ready = torch.cuda.Event()
            ready.record(compute)
        with self.cv:
            self.started.add(mb)
            epoch = self.epoch
        self.jobs.put((epoch, mb, fn, ready, compute, torch.get_default_device()))

    def _call(self, fn, ready, compute, default):
        with torch.device(default) if default.type != "cpu" else contextlib.nullcontext():
            if self.stream is None:
                return fn(self.transport)
            _job.compute = compute
            try:
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(ready)
                    result = fn(self.transport)
                    _handoff(result)
                    return result
            finally:
                _job.compute = None
                self.stream.synchronize()  # done on the device before anyone is given the result

    def take(self, mb, what):
        """wait(mb), and the result is let go here (its last reader)."""
        got = self.wait(mb, what)
        with self.cv:
            self.results[mb] = None
        return got

    def _raise_failed(self):
        mb, err = self.failed
        raise RuntimeError(f"zbpp vocab_parallel: the {self.name} collective of microbatch {mb} failed: "
                           f"{type(err).__name__}: {err}") from err

    def wait(self, mb, what):
        """The result of microbatch mb's job; raises when a job of this lane failed, when the
        pipeline failed elsewhere (its failure key), or after the schedule's timeout."""
        def check():
            if self.failed is not None:
                self._raise_failed()
            return self.results[mb] if mb in self.results else _NOT_YET

        return _await(self.cv, check, self.timeout, self._peer_failure, what,
                      f" (the schedule's timeout=); its collective (lane {self.name}) waits for a rank")

    def drain(self, what):
        for mb in sorted(self.started):
            self.wait(mb, what)

    def reset(self):
        with self.cv:
            self.results, self.started, self.failed = {}, set(), None
            self.epoch += 1

    def close(self):
        self.jobs.put(None)
        self._thread.join(timeout=2.0)  # one in a collective ends with its aborted transport


class _Box:
    """Values the runner's thread hands to a lane's job of the same step (fed mode: the tokens
    stage 0's forward read, which the IF lane sends): put(mb, value); get(mb) waits for it,
    bounded by the timeout and watching the pipeline's failure key; reset() (each step) wakes a
    job still waiting from a step that failed, which then gives up."""

    def __init__(self, timeout, peer_failure):
        self.timeout, self._peer_failure = timeout, peer_failure
        self.cv, self.items, self.epoch = threading.Condition(), {}, 0

    def put(self, mb, value):
        with self.cv:
            self.items[mb] = value
            self.cv.notify_all()

    def get(self, mb, what):
        with self.cv:
            epoch = self.epoch

        def check():
            if self.epoch != epoch:
                raise RuntimeError(f"zbpp vocab_parallel: {what}: the step ended before it came")
            return self.items.pop(mb) if mb in self.items else _NOT_YET

        return _await(self.cv, check, self.timeout, self._peer_failure, what, "")

    def reset(self):
        with self.cv:
            self.items = {}
            self.epoch += 1
            self.cv.notify_all()
