"""The pipeline's ranks agree before they run, and fail together.

What this is: the PipelineSchedule mixin that keeps a pipeline's ranks in one step, outside the C
runner (whose transports do the same inside it, DESIGN.md section 4):

- A handshake (_agree) at the first step and whenever the plan in force changes: every rank
  publishes what must be the same on all of them (zbpp's version, the schedule kind, num_stages,
  n_microbatches, the digest of the op lists, post-validation on or off, which stages it holds, the
  boundaries' shapes and dtypes it knows) and compares everyone's. A difference raises ValueError
  on every rank, naming the field and each rank's value, before any activation moves: ranks built
  with n_microbatches 4 and 8 would otherwise pair one rank's two steps with the other's one.
- A failure path (_failing) for everything step() does: argument checks, the microbatch split,
  shape inference, the handshake, the runner, the loss, replanning. The first failure is published
  under the pipeline's key in the job's c10d store (first one wins, the same key the gloo and NCCL
  transports publish under), so every rank sees it within _POLL_MAX_S wherever it waits, and the
  schedule then refuses further steps on every rank (closed): never two ranks in different steps.
  The failing rank raises its own exception; the others raise ZbError naming it.
- _exchange: every rank's object through the store, bounded by the schedule's timeout and
  watching the failure key (no plain blocking collective).

With one rank none of this runs; a failed step leaves a one-rank schedule usable.
What this is not: the runner's own failure handling (csrc/runtime/, distributed.py).
"""

import contextlib
import datetime
import hashlib
import pickle
import time

import torch
import torch.distributed as dist

from .. import _lib, distributed, runtime
from ._boundary import _META_TAG

_PING_TAG = _META_TAG + 1  # the set-up messages' tag is _META_TAG; the runner's channels are small

# How often a wait in the store looks again: soon at first, then every _POLL_MAX_S.
_POLL_MIN_S = 0.002
_POLL_MAX_S = 0.05
_PIPELINES_MADE = {}  # the ranks of a pipeline's group -> how many pipelines over them this process made


def pipeline_key(group, ranks_fn):
    """The name of a new pipeline over `group` in the job's store: its ranks and how many pipelines
    over the same ranks this process made before, the same on every rank that builds its pipelines
    in the same order (as torch's new_group asks). Names nothing (None) without a process group."""
    try:
        ranks = ranks_fn(group)
    except (AttributeError, RuntimeError, ValueError):
        return None
    sig = "-".join(map(str, ranks))
    seq = _PIPELINES_MADE[sig] = _PIPELINES_MADE.get(sig, 0) + 1
    return f"{sig}/{seq}"


def _describe(exc):
    return f"{type(exc).__name__}: {distributed.first_line(exc)}"


class _Agreement:
    """PipelineSchedule's handshake and failure path (a mixin; see the module docstring)."""

    # ---- the job's store -------------------------------------------------------------------------

    def _job_store(self):
        if self._key is None:
            return None
        if self._store_c10d is None:
            self._store_c10d = distributed._default_store() or False
        return self._store_c10d or None

    def _failure_key(self):
        return distributed.abort_key(self._key)

    def _peer_failure(self):
        """The first failure some rank of this pipeline published, or None."""
        store = self._job_store()
        return distributed.published_failure(store, self._failure_key()) if store is not None else None

    # ---- failures --------------------------------------------------------------------------------

    def _check_open(self):
        if self._failed is None and self.ranks > 1 and self._key is not None and self._looked_at != self.steps:
            # A failure published after this rank's part of a step was done (the loss rank's merge,
            # a post-validated optimizer's step, a replan): this rank learns it at its next step.
            # Once per step: step() and the calls inside it all check.
            self._looked_at = self.steps
            failed = self._peer_failure()
            if failed is not None:
                self._failed, self._failed_step = failed, f"after step {self.steps}"
        if self._failed is not None:
            raise RuntimeError(f"zbpp.{type(self).__name__}: the pipeline failed {self._failed_step} "
                               f"({self._failed}); it runs no more steps on any rank: make a new schedule (over a "
                               "new process group if the failure was in a transfer: gloo cannot withdraw a posted "
                               "receive)")

    @contextlib.contextmanager
    def _failing(self):
        """Publishes what escapes the block as this pipeline's failure (see the module docstring)."""
        try:
            yield
        except BaseException as exc:
            self._note_failure(exc)
            if self._vp is not None:  # the vocabulary lanes' peers learn it at once too
                self._vp.abort(f"rank {self.rank}: {type(exc).__name__}: {exc}")
            raise

    def _note_failure(self, exc, where=None):
        """Marks the pipeline failed on this rank and, unless a peer failed first, publishes exc as
        the pipeline's first failure: `where` (the op, for a stage's own exception) and the step."""
        if self.ranks == 1 or self._failed is not None or self._key is None:
            return
        step = self.steps + 1
        first = self._peer_failure()
        if first is None:
            place = f"{where} at step {step}" if where else f"step {step}"
            text = f"rank {self.rank} failed first: {place}: {_describe(exc)}"
            store = self._job_store()
            first = distributed.publish_failure(store, self._failure_key(), text) if store is not None else text
        self._failed, self._failed_step = first, f"at step {step}"

    def _stage_callback(self, callback, op):
        """The runner's F or B callback: what it raises is marked as the stage's own (_run_iteration
        raises it as itself) and published at once as the pipeline's first failure, naming the op,
        before the runner's abort, whose text would only say that a callback failed."""
        def call(s, i, *rest):
            try:
                return callback(s, i, *rest)
            except Exception as exc:
                exc._zbpp_in_stage = True
                self._note_failure(exc, f"{op}(stage {s}, mb {i})")
                raise

        return call

    def _remote_error(self, what, failed):
        return _lib.ZbError(runtime.ZB_ERR_REMOTE, f"rank {self.rank}, {what}: {failed}")

    # ---- exchanging small objects ----------------------------------------------------------------

    def _exchange(self, obj, what="an exchange between the ranks"):
        """obj of every rank of the pipeline, in rank order. Every rank calls it at the same point;
        through the job's store with this pipeline's key, bounded by the schedule's timeout, and
        failing at once when a rank publishes a failure (a rank that never comes is named). Without
        a store: torch's all_gather_object over the set-up group (blocking)."""
        if self.ranks == 1:
            return [obj]
        store = self._job_store()
        if store is None:
            import torch.distributed as dist

            out = [None] * self.ranks
            dist.all_gather_object(out, obj, group=self._messages()[0])
            return out
        self._exchanges += 1
        base = f"zbpp/exchange/{self._key}/{self._exchanges}/"
        store.set(base + str(self.rank), pickle.dumps(obj))
        pings = self._ping(what)
        got = {self.rank: obj}
        deadline = time.monotonic() + self.timeout
        pause = _POLL_MIN_S
        while True:
            for r in range(self.ranks):
                if r not in got and store.check([base + str(r)]):
                    got[r] = pickle.loads(store.get(base + str(r)))
            if len(got) == self.ranks:
                self._pings_done(pings, what, deadline)
                return [got[r] for r in range(self.ranks)]
            self._pings_failed(pings, what)
            failed = self._peer_failure()
            if failed is not None:
                raise self._remote_error(what, failed)
            if time.monotonic() > deadline:
                missing = ", ".join(str(r) for r in range(self.ranks) if r not in got)
                raise _lib.ZbError(runtime.ZB_ERR_TIMEOUT,
                                   f"rank {self.rank}, {what}: nothing from rank(s) {missing} within "
                                   f"{self.timeout:g} s (the schedule's timeout=): they did not reach this point "
                                   "of the step (stopped, hung, or running another step or schedule)")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _ping(self, what):
        """A one-byte message to and from every other rank over the set-up group, beside an
        exchange: the store cannot tell a peer that died (its key just never comes), but gloo fails
        a receive from it at once ("Connection closed by peer"). Returns {peer: (receive future,
        send future)}, or None where set-up messages are not gloo's."""
        group, device = self._messages()
        if device.type != "cpu":
            return None
        if self._ping_waiters is None:
            self._ping_waiters = {}
        pings = {}
        for r in range(self.ranks):
            if r == self.rank:
                continue
            waiter = self._ping_waiters.get(r) or self._ping_waiters.setdefault(r, distributed._Waiter())
            peer = distributed.global_rank(self.group, r)
            out, back = torch.zeros(1, dtype=torch.uint8, device="cpu"), torch.zeros(1, dtype=torch.uint8, device="cpu")
            try:
                sent = dist.isend(out, dst=peer, group=group, tag=_PING_TAG)
                got = dist.irecv(back, src=peer, group=group, tag=_PING_TAG)
            except RuntimeError as exc:  # gloo knew already: the connection is closed
                raise self._gone(r, what, exc) from None
            wait = datetime.timedelta(seconds=self.timeout)
            pings[r] = (waiter.submit(lambda w=got, b=back: w.wait(timeout=wait), group, r),
                        waiter.submit(lambda w=sent, o=out: w.wait(timeout=wait), group, r))
        return pings

    def _pings_failed(self, pings, what):
        """Raises, naming the peer, if a ping to or from it failed (the peer is gone)."""
        for r, futures in (pings or {}).items():
            for future in futures:
                if future.done() and future.exception() is not None:
                    raise self._gone(r, what, future.exception())

    def _gone(self, r, what, exc):
        """The error for a ping to or from rank r that failed: the failure a peer published first
        (it closed its pairs), or rank r is gone."""
        failed = self._peer_failure()
        if failed is not None:
            return self._remote_error(what, failed)
        return _lib.ZbError(runtime.ZB_ERR_REMOTE, f"rank {self.rank}, {what}: rank {r} is gone: "
                            f"{distributed.first_line(exc)}")

    def _pings_done(self, pings, what, deadline):
        for futures in (pings or {}).values():
            for future in futures:
                try:
                    future.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
                except Exception:  # noqa: BLE001 - said by _pings_failed
                    pass
        self._pings_failed(pings, what)

    # ---- the handshake ---------------------------------------------------------------------------

    def _agree(self):
        """The handshake (module docstring), once per plan in force; sets _loss_anywhere."""
        if self._agreed and self._agreed_on is self.schedule:
            return
        if self.ranks == 1:
            self._loss_anywhere = self._loss_fn is not None or self._vp is not None
            self._agreed, self._agreed_on = True, self.schedule
            return
        what = "the handshake of the first step" if not self._agreed else "the handshake of a new plan"
        everyone = self._exchange(self._agreement_fields(), what)
        problems = _disagreements(everyone)
        if problems:
            raise ValueError(f"zbpp.{type(self).__name__}: the pipeline's ranks disagree, so no step runs: "
                             + "; ".join(problems) + ". Every rank must build the same schedule (kind, "
                             "num_stages, n_microbatches), hold its own stages, use the same zbpp and "
                             "wrap its optimizer the same way")
        self._loss_anywhere = any(f["loss_fn"] for f in everyone)
        self._agreed, self._agreed_on = True, self.schedule

    def _agreement_fields(self):
        from .. import __version__

        plan = None
        if self.schedule is not None:
            # (Vocabulary Parallelism's passes have no CSV cells; its JSON holds them)
            text = self.schedule.to_json() if self._vp is not None else self.schedule.to_csv()
            plan = hashlib.sha256(text.encode()).hexdigest()[:16]
        known = self._meta if (self._meta_given or self._shapes_known) else {}
        return {
            "zbpp": __version__,
            "kind": self._kind_label,
            "num_stages": self._num_stages,
            "n_microbatches": self.n_microbatches,
            "post_validation": self._post_validation or "not wrapped",
            "plan": plan,
            "stages": [s.stage_index for s in self.stages],
            "loss_fn": self._loss_fn is not None or self._vp is not None,
            "vocab_parallel": self._vp.agreement() if self._vp is not None else "off",
            "boundaries": {b: [(str(d), tuple(sh)) for d, sh in meta] for b, meta in known.items()},
        }


# The fields every rank must have equal, in the order a message names them, with their names.
_EQUAL = (("zbpp", "the zbpp version"), ("kind", "the schedule"), ("num_stages", "num_stages"),
          ("n_microbatches", "n_microbatches"), ("post_validation", "post-validation (PostValidatedOptimizer)"),
          ("vocab_parallel", "vocab_parallel"))


def _by_value(values):
    """'4 on rank 0, 8 on ranks 1, 2' for the values of each rank."""
    groups = {}
    for r, v in enumerate(values):
        groups.setdefault(repr(v) if not isinstance(v, str) else v, []).append(r)
    return ", ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for v, rs in groups.items())


def _disagreements(everyone):
    """What differs between the ranks' handshake fields, as sentences (empty: they agree)."""
    out = []
    for key, name in _EQUAL:
        values = [f[key] for f in everyone]
        if len(set(map(repr, values))) > 1:
            out.append(f"{name} is {_by_value(values)}")
    if not out:
        plans = [f["plan"] for f in everyone]
        if len(set(plans)) > 1:
            out.append(f"the op lists differ (digest {_by_value(plans)})")
    holders = {}
    for r, f in enumerate(everyone):
        for s in f["stages"]:
            holders.setdefault(s, []).append(r)
    S = everyone[0]["num_stages"]
    twice = [f"stage {s} on ranks {', '.join(map(str, rs))}" for s, rs in sorted(holders.items()) if len(rs) > 1]
    if twice:
        out.append("more than one rank holds " + "; ".join(twice))
    if not out:
        missing = [s for s in range(S) if s not in holders]
        if missing:
            out.append(f"no rank holds stage(s) {', '.join(map(str, missing))}")
    seen = {}
    for r, f in enumerate(everyone):
        for b, meta in f["boundaries"].items():
            seen.setdefault(b, []).append((r, meta))
    for b, got in sorted(seen.items()):
        if len({repr(m) for _, m in got}) > 1:
            out.append(f"the activation from stage {b} to {b + 1} is "
                       + ", ".join(f"{m} on rank {r}" for r, m in got))
    return out
