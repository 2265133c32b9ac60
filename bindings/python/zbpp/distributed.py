"""zbpp's host transport for a torch.distributed group, and the process-group helpers.

What this is: `TorchTransport(group, timeout, name)`, the transport the C runner and the optimizer's
post-validation use to move host memory between the ranks of a pipeline. By default it is the
library's socket transport (zb_transport_create_socket, csrc/runtime/transport_socket.c): every
transfer stays in C (a progress thread per rank, no Python and no thread hand-over on the path),
and this module only connects the sockets (connect_sockets): AF_UNIX when every rank of the group
runs on one host, else TCP; each rank publishes its address in the job's c10d store under the
pipeline's key, connects to the ranks below it and accepts the ranks above it, bounded by the
timeout, with an error naming the rank that never came. A failure reaches every rank at once:
the failed rank's abort goes over its sockets and is published in the store (first failure wins),
and a closed connection fails the waits on that peer naming it.

ZBPP_HOST_TRANSPORT picks the transport: "socket" (the default: AF_UNIX on one host, else TCP),
"unix", "tcp", or "gloo" for the earlier path below. The gloo path is also used, on every rank
alike, when there is no c10d store or no pipeline key, or when some rank cannot listen on a socket.

The gloo path: the Python half of zb_transport_create_callback. The C runner and optimizer call
isend/irecv with raw addresses; this wraps each address range in a uint8 tensor (no copy) and
starts torch.distributed.isend/irecv on the pipeline's process group, with the C channel number as
the tag. wait() turns torch's exceptions into zb statuses and keeps the reason, so an error says
which peer failed and why:

  - gloo reports a peer process that died at once ("Connection closed by peer"): ZB_ERR_REMOTE;
  - a peer that is alive but silent runs into the timeout: ZB_ERR_TIMEOUT.

Also here: the few process-group helpers the CUDA pipeline needs: whether a group takes CPU
tensors (`takes_cpu`), a gloo group for host-memory messages (`cpu_group`), and sending a few
bytes from one rank to all (`broadcast_bytes`, for the NCCL unique id).

On the gloo path a failure reaches every rank within a second (given `name`, the same on every
rank of the pipeline): gloo has no way to withdraw a receive, and a peer that is alive but failed
closes nothing, so without help its peers would wait out the whole timeout. abort() writes the
failure (the runner's message: rank, op, microbatch, why) under a key of the job's c10d store, first
failure wins; a blocking wait runs on a helper thread while the caller checks that key every
0.2 s, and fails with ZB_ERR_REMOTE and that message when it appears. Without a c10d store (a
torch whose private accessor is gone) or a name, waits block as before and the timeout applies.

What this is not: NCCL. Device buffers between GPUs go over the library's own NCCL transport
(runtime.Transport.nccl); this transport carries host memory only (the optimizer's post-validation
state, and everything on CPU pipelines). After a failure on the gloo path the gloo pairs involved
are closed; the process group cannot be used for further point-to-point traffic.

Shutdown (gloo path): gloo's worker threads drop their last reference to a finished request's
tensors a moment after the request completes, and dropping a tensor that has a Python object needs
the GIL. A script that ends right after its last step (or right after destroy_process_group, with
zbpp still holding its groups) can start interpreter finalization in that moment; a thread that
then asks for the GIL is ended by Python inside C++ code that must not unwind, and the process
dies with "terminate called without an active exception" (SIGABRT). So the transport keeps its
finished requests (tensor views, no copies) for one more step (end_step; memory stays flat), and
the first transport made registers an exit hook (_at_exit) that gives gloo's threads a short while,
with the GIL free, to finish releasing what the last collectives used before finalization begins.
The same hook ends the waits a failure left stuck on zbpp's helper threads (see _Waiter): that was
the SIGABRT of a rank that caught a peer's failure and returned normally. The socket transport's
progress thread never calls into Python, so none of this applies to it.
"""

import atexit
import concurrent.futures
import ctypes
import datetime
import hashlib
import itertools
import os
import queue
import secrets
import socket
import struct
import threading
import time
import weakref

import torch
import torch.distributed as dist

from . import _lib, runtime

__all__ = ["TorchTransport", "broadcast_bytes", "connect_sockets", "cpu_group", "global_rank", "group_rank",
           "group_size", "host_transport_kind", "takes_cpu"]


def group_rank(group=None):
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def group_size(group=None):
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def global_rank(group, rank):
    """The global rank of `rank` in `group` (torch 2.x has dist.get_global_rank; 1.13 a private one)."""
    if group is None or group is dist.group.WORLD:
        return rank
    fn = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return fn(group, rank)


def takes_cpu(group=None):
    """True when point-to-point on `group` takes CPU tensors (gloo, or a "cpu:gloo,cuda:nccl" mix)."""
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):
        return False
    return "gloo" in str(backend).lower()


_cpu_groups = {}


def cpu_group(group=None):
    """A group over the same ranks as `group` that takes CPU tensors: the group itself when it does,
    else a gloo group made with torch.distributed.new_group(backend="gloo"). new_group is a
    collective of the whole world, so it is made only when every process of the world is in the
    pipeline (then every one of them asks for it at the same point); for a subgroup, pass a gloo
    group you made over its ranks (the schedule's cpu_group=)."""
    if takes_cpu(group):
        return group
    if dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(f"zbpp: the pipeline's process group (backend {dist.get_backend(group)}) does not take "
                         "CPU tensors and is a subgroup of the world, so zbpp cannot make a gloo group over it "
                         "alone (torch.distributed.new_group is a collective of every process); make one with "
                         "torch.distributed.new_group(ranks, backend='gloo') on every process and pass it as "
                         "cpu_group=... to the schedule")
    made = _cpu_groups.get("world")
    if made is None:
        # new_group sorts its ranks, like the pipeline group's, so group ranks mean the same ranks.
        made = _cpu_groups["world"] = dist.new_group(backend="gloo")
    return made


def broadcast_bytes(data, src, group=None, device="cpu"):
    """The process of global rank `src` sends `data` to every rank of `group`; every rank passes
    bytes of the same length and gets src's back. device: where the message tensor lives ("cpu" for
    gloo, a CUDA device for an NCCL group)."""
    t = torch.tensor(list(data), dtype=torch.uint8, device=device)
    dist.broadcast(t, src=src, group=group)
    return bytes(t.cpu().tolist())


def _view(addr, nbytes):
    """A uint8 CPU tensor over C memory (no copy); it keeps the ctypes buffer object alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)


# Finished requests a transport keeps at most in one generation, when no step ends (end_step).
_KEEP_DONE = 16384
# How long the exit hook leaves gloo's threads to finish: they need microseconds, more on a loaded
# machine; this is paid once, at exit, by processes that used a transport.
_EXIT_GRACE_S = 0.2
_exit_grace_registered = False


def _register_exit_grace():
    global _exit_grace_registered
    if not _exit_grace_registered:
        _exit_grace_registered = True
        atexit.register(_at_exit)


# How often a blocked wait looks for a peer's failure in the c10d store.
_ABORT_POLL_S = 0.2
_ABORT_PREFIX = "zbpp/abort/"


def abort_key(name):
    """The key in the job's store under which a failure of the transport (or pipeline) `name` is
    published and watched for (TorchTransport, connect_sockets, the schedule's handshake)."""
    return _ABORT_PREFIX + name


def first_line(exc):
    """The first line of an exception's text (torch's gloo errors run to several), or its type."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def published_failure(store, key):
    """The failure published under `key` in a c10d store, or None (nothing yet, or no answer)."""
    try:
        if store.check([key]):
            return store.get(key).decode("utf-8", errors="replace")
    except (RuntimeError, ValueError):
        pass
    return None


def publish_failure(store, key, text):
    """Publishes `text` under `key` unless a failure is there already (the first one wins);
    returns the one that stands (`text` when the store does not answer)."""
    try:
        got = store.compare_set(key, "", text)
    except (RuntimeError, ValueError):
        return text
    return got.decode("utf-8", errors="replace") if isinstance(got, bytes) else str(got)


def _default_store():
    """The job's c10d store (torch's private accessor), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


class _Waiter:
    """One daemon thread that runs blocking gloo waits, so the caller can watch for a peer's
    failure meanwhile. A wait stuck on a failed peer keeps the thread until gloo gives up (the
    pairs close or its timeout passes); by then its owner has failed and takes no more work.
    (Not a ThreadPoolExecutor: its threads are joined at interpreter exit, and a stuck wait would
    hold the exit for the whole timeout.)

    Exit: a thread that comes back from a gloo wait while the interpreter finalizes is ended by
    Python (pthread_exit) inside pybind11's C++ frames, which must not unwind: the process dies
    with "terminate called without an active exception" (SIGABRT). That is what killed a surviving
    rank at exit after a peer failed: its helper was still inside the wait for that peer, and the
    wait ended (its timeout, or the peer's connections closing) during finalization. So the exit
    hook (_at_exit) ends such waits first, while the interpreter still runs: it fails every
    operation pending on their groups (_unstick) and waits for the helpers to come back."""

    def __init__(self):
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = {}  # job id -> (group, peer) of the waits submitted and not finished
        self._ids = itertools.count(1)
        _waiters.add(self)
        _register_exit_grace()
        threading.Thread(target=self._run, name="zbpp-gloo-wait", daemon=True).start()

    def _run(self):
        while True:
            jid, fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._pending.pop(jid, None)

    def submit(self, fn, group, peer):
        future = concurrent.futures.Future()
        jid = next(self._ids)
        with self._lock:
            self._pending[jid] = (group, peer)
        self._jobs.put((jid, fn, future))
        return future

    def stuck(self):
        """(group, peer) of the waits still running or queued."""
        with self._lock:
            return list(self._pending.values())


_waiters = weakref.WeakSet()  # every _Waiter made (their threads keep them alive)
# A tag no channel of the runner or the optimizer uses (they count up from 0; shape inference
# uses 1 << 20): the receive _unstick posts to fail a group's pending operations.
_UNSTICK_TAG = (1 << 30) + 7
# How long the exit hook waits for the helpers to come back from the waits it ended.
_UNSTICK_WAIT_S = 2.0


def _unstick(group, peer):
    """Fails every gloo operation pending on `group`'s connections: a receive whose wait times out
    makes gloo signal the timeout to every pair of the group's context, which fails all their
    pending operations at once (gloo's UnboundBuffer::waitRecv). Used at exit only, on a group a
    failure already broke for point-to-point traffic; collectives on it fail afterwards too."""
    buf = torch.empty(1, dtype=torch.uint8, device="cpu")
    try:
        work = dist.irecv(buf, src=global_rank(group, peer), group=group, tag=_UNSTICK_TAG)
        work.wait(timeout=datetime.timedelta(milliseconds=1))
    except Exception:  # noqa: BLE001 - the timeout is the point; a destroyed group has nothing pending
        pass


def wait_watched(waiter, work, group, peer, timeout_s, failure):
    """work.wait(timeout_s) on `waiter`'s thread; returns None once it finished, or the text
    failure() returns (a peer's published failure) as soon as it is not None, checked every
    _ABORT_POLL_S. Raises what the wait raised."""
    future = waiter.submit(lambda: work.wait(timeout=datetime.timedelta(seconds=timeout_s)), group, peer)
    while True:
        try:
            future.result(timeout=_ABORT_POLL_S)  # raises what the wait raised
            return None
        except concurrent.futures.TimeoutError:
            if future.done():
                raise  # the wait itself raised a TimeoutError
            failed = failure()
            if failed is not None:
                return failed


def _at_exit():
    """Before finalization: ends the gloo waits a failure left stuck (see _Waiter), then gives
    gloo's own threads a moment (see the module docstring's Shutdown)."""
    stuck = {}
    for waiter in list(_waiters):
        for group, peer in waiter.stuck():
            stuck.setdefault(id(group), (group, peer))
    for group, peer in stuck.values():
        _unstick(group, peer)
    deadline = time.monotonic() + _UNSTICK_WAIT_S
    while any(w.stuck() for w in list(_waiters)) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(_EXIT_GRACE_S)  # sleeping releases the GIL for gloo's threads


# ---- the socket transport's connections ------------------------------------------------------------

_HOST_TRANSPORTS = ("socket", "unix", "tcp", "gloo")
_SOCK_PREFIX = "zbpp/sock/"
_HELLO = struct.Struct("<8sii16s")  # magic, rank, ranks, the setup's token
_HELLO_MAGIC = b"zbpphost"
_STORE_POLL_S = 0.01
_generations = {}  # pipeline key -> transports made for it so far (every rank makes them in one order)


def host_transport_kind():
    """The host transport ZBPP_HOST_TRANSPORT asks for: "socket" (default), "unix", "tcp" or "gloo"."""
    kind = os.environ.get("ZBPP_HOST_TRANSPORT", "").strip().lower() or "socket"
    if kind not in _HOST_TRANSPORTS:
        raise ValueError(f"zbpp: ZBPP_HOST_TRANSPORT={kind!r} is not a host transport; use one of "
                         f"{', '.join(_HOST_TRANSPORTS)} (socket: AF_UNIX on one host, else TCP; gloo: the "
                         "torch.distributed callback path)")
    return kind


class _NoSockets(Exception):
    """Sockets cannot be used by every rank alike: the caller takes the gloo path (the text says why)."""


def _wait_keys(store, keys, deadline, what, failure_key):
    """Waits until every key of {rank: key} is in the store; returns {rank: value}. Fails at the
    deadline naming the ranks whose key never came, or at once when a rank published a failure."""
    got = {}
    while True:
        for r, key in keys.items():
            if r not in got and store.check([key]):
                got[r] = store.get(key).decode("utf-8", errors="replace")
        if len(got) == len(keys):
            return got
        if failure_key is not None:
            failed = published_failure(store, failure_key)
            if failed is not None:
                raise RuntimeError(f"zbpp: setting up the socket transport stopped: {failed}")
        if time.monotonic() > deadline:
            missing = sorted(set(keys) - set(got))
            raise TimeoutError(f"zbpp: setting up the host transport: rank(s) {', '.join(map(str, missing))} of the "
                               f"pipeline did not {what} within the timeout; is every rank of the pipeline running "
                               "(and taking the same step)?")
        time.sleep(_STORE_POLL_S)


def _local_address(store):
    """This host's address as the other hosts reach it: ZBPP_HOST_ADDR, else the interface that
    routes to the c10d store's host (a TCPStore), else the host name's address."""
    given = os.environ.get("ZBPP_HOST_ADDR")
    if given:
        return given
    while not hasattr(store, "host") and hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    host = getattr(store, "host", None)
    if host:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))  # no packet is sent: this only picks the route
                return probe.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def _listen(kind, store):
    """A listening socket and the address to publish for it, "unix:<name>" or "tcp:<host>:<port>"."""
    if kind == "unix":
        name = f"zbpp-{os.getpid()}-{secrets.token_hex(8)}"
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lst.bind("\0" + name)  # Linux's abstract namespace: no file to clean up
        lst.listen(256)
        return lst, f"unix:{name}"
    host = _local_address(store)
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.bind((host, 0))
    lst.listen(256)
    return lst, f"tcp:{host}:{lst.getsockname()[1]}"


def _tune(sock):
    if sock.family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small messages leave at once
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:  # larger buffers let more sends finish on the caller's thread (capped by the kernel)
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass


def _connect(addr, deadline):
    kind, _, rest = addr.partition(":")
    while True:
        if kind == "unix":
            sock, target = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), "\0" + rest
        else:
            host, _, port = rest.rpartition(":")
            sock, target = socket.socket(socket.AF_INET, socket.SOCK_STREAM), (host, int(port))
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            sock.connect(target)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(_STORE_POLL_S)


def _recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed during the handshake")
        data += chunk
    return data


def _is_unix(fds):
    for fd in fds:
        if fd >= 0:
            with socket.socket(fileno=fd) as sock:
                try:
                    return sock.family == socket.AF_UNIX
                finally:
                    sock.detach()
    return False


def connect_sockets(group, name, timeout, kind="socket"):
    """One connected stream socket per peer of this rank in `group` (a list of file descriptors,
    -1 for this rank), for runtime.Transport.socket, which takes them over. A collective: every
    rank of the group calls it with the same `name` (the pipeline's key, published under in the
    job's c10d store), in the same order. kind: "socket" (AF_UNIX when every rank is on this host,
    else TCP), "unix" or "tcp". Rank r connects to the ranks below it and accepts the ranks above,
    all bounded by `timeout` seconds; a rank that never comes is named in the TimeoutError. Raises
    _NoSockets (every rank alike) when there is no store or some rank cannot listen."""
    store = _default_store()
    if store is None or name is None:
        raise _NoSockets("no c10d store or pipeline key to publish the addresses under")
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    gen = _generations[name] = _generations.get(name, 0) + 1
    prefix = f"{_SOCK_PREFIX}{name}/{gen}/"
    failure_key = abort_key(name)
    deadline = time.monotonic() + timeout
    others = [r for r in range(ranks) if r != rank]
    # Round 1: hosts, so that every rank picks the same family.
    store.set(f"{prefix}host/{rank}", socket.gethostname())
    hosts = _wait_keys(store, {r: f"{prefix}host/{r}" for r in range(ranks)}, deadline,
                       "start setting up its host transport", failure_key)
    family = kind if kind != "socket" else ("unix" if len(set(hosts.values())) == 1 else "tcp")
    # Round 2: addresses ("-" from a rank that cannot listen: every rank then takes the gloo path).
    lst = None
    try:
        lst, addr = _listen(family, store)
    except OSError as exc:
        addr = "-" + first_line(exc)
    try:
        store.set(f"{prefix}addr/{rank}", addr)
        addrs = _wait_keys(store, {r: f"{prefix}addr/{r}" for r in range(ranks)}, deadline,
                           "publish its socket address", failure_key)
        bad = {r: a[1:] for r, a in addrs.items() if a.startswith("-")}
        if bad:
            raise _NoSockets("; ".join(f"rank {r} cannot listen on a {family} socket: {why}" for r, why in bad.items()))
        token = hashlib.sha256(prefix.encode()).digest()[:16]  # this setup's, not an older one's
        fds, socks = [-1] * ranks, {}
        try:
            for peer in others:
                if peer > rank:
                    continue
                sock = _connect(addrs[peer], deadline)
                sock.sendall(_HELLO.pack(_HELLO_MAGIC, rank, ranks, token))
                socks[peer] = sock
            while len(socks) < len(others):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in others if r not in socks]
                    raise TimeoutError(f"zbpp: setting up the host transport: rank(s) {', '.join(map(str, missing))} "
                                       f"did not connect to rank {rank} within {timeout:.3g} s")
                lst.settimeout(left)
                try:
                    sock, _ = lst.accept()
                except socket.timeout:
                    continue
                sock.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    magic, peer, n, tok = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
                except (OSError, ConnectionError, struct.error):
                    sock.close()
                    continue
                if magic != _HELLO_MAGIC or n != ranks or tok != token or not rank < peer < ranks or peer in socks:
                    sock.close()  # not one of this pipeline's ranks
                    continue
                socks[peer] = sock
            for peer, sock in socks.items():
                sock.settimeout(None)
                _tune(sock)
                fds[peer] = sock.detach()
            socks.clear()
            return fds
        finally:
            for sock in socks.values():
                sock.close()
    finally:
        if lst is not None:
            lst.close()


class TorchTransport:
    """Point-to-point over a torch.distributed group, for the C runner and optimizer. name: a key
    every rank of the pipeline gives the same (and no other pipeline of the job), under which the
    socket transport's addresses and a failure are published to the others (see the module
    docstring); None: no such signal, and the gloo path. `kind` says which transport runs: "unix",
    "tcp" or "gloo"; `transport` is the runtime.Transport the runner takes."""

    def __init__(self, group=None, timeout=300.0, name=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("zbpp: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first (gloo on CPU)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_world_size(group)
        self.timeout = timeout
        self._requests = {}
        # Finished requests, kept so that gloo's threads never drop the last reference to their
        # tensors (see the module docstring): those of this step and of the step before, which
        # gloo finished with long ago (end_step drops the older ones, so memory stays flat).
        self._done, self._done_before = [], []
        self._ids = itertools.count(1)
        _register_exit_grace()
        self.last_error = None
        self._store = _default_store() if name is not None else None
        self._abort_key = abort_key(name) if self._store is not None else None
        self._failed = None  # the first failure's text, once this rank has seen or published it
        self._waiter = None
        self.kind, self.fallback_reason = "gloo", None
        self._name, self._wanted, self._sock = name, host_transport_kind(), None
        if self._wanted != "gloo" and self.ranks > 1:
            if self._store is None:
                self.fallback_reason = "no c10d store or pipeline key to publish the socket addresses under"
            else:
                # Made now, connected at the pipeline's first step (every rank there at once):
                # making it is local, so a rank may make it alone (the optimizer's post-validation
                # asks for it at construction, the handshake then finds any disagreement).
                me = global_rank(group, self.rank)
                self._sock = runtime.Transport.socket(self.rank, self.ranks, None, abort_store=self._store,
                                                      abort_key=self._abort_key,
                                                      published_prefix=f"rank {me} failed first: ")
                self.kind = "socket"
                return
        self._callbacks = runtime.Transport.callbacks(self, self.rank, self.ranks)

    @property
    def transport(self):
        """The runtime.Transport for the runner: the socket transport connected to every peer (a
        collective the first time: every rank asks at the same point of its first step), or the
        gloo callback transport."""
        if self._sock is None:
            return self._callbacks
        if self.kind == "socket":
            try:
                fds = connect_sockets(self.group, self._name, self.timeout, self._wanted)
            except _NoSockets as why:
                raise RuntimeError(f"zbpp: the socket host transport cannot be set up ({why}); set "
                                   "ZBPP_HOST_TRANSPORT=gloo on every rank to use torch.distributed's gloo") from None
            self.kind = "unix" if _is_unix(fds) else "tcp"
            self._sock.attach(fds)
        return self._sock

    def connect(self):
        """Connects the socket transport now (a collective; see transport)."""
        self.transport  # noqa: B018

    @property
    def handle(self):
        """The C transport's handle, for zb_optimizer and zb_postval; it does not connect (the
        pipeline's first step does, before any of their exchanges)."""
        return (self._sock if self._sock is not None else self._callbacks).handle

    # ---- called from C (through runtime.Transport's callbacks) -----------------------------------

    def isend(self, peer, tag, addr, nbytes):
        return self._start(dist.isend, "send to", peer, tag, addr, nbytes)

    def irecv(self, peer, tag, addr, nbytes):
        return self._start(dist.irecv, "receive from", peer, tag, addr, nbytes)

    def _start(self, op, what, peer, tag, addr, nbytes):
        t = _view(addr, nbytes)
        # The tensor is the only thing keeping the view of C's buffer alive: hold it until wait.
        try:
            work = op(t, global_rank(self.group, peer), group=self.group, tag=tag)
        except RuntimeError as exc:
            failed = self._peer_failure()
            if failed is not None:  # a peer that failed closed its pairs: say what failed first
                raise RuntimeError(f"rank {peer} stopped: {failed}") from exc
            raise
        rid = next(self._ids)
        self._requests[rid] = (work, t, peer, what, tag)
        return rid

    def wait(self, rid, timeout_s):
        work, _t, peer, what, tag = self._requests[rid]
        if timeout_s == 0:
            # A poll. gloo marks a request complete only inside wait(), so this mostly says "not
            # yet"; the runner then waits properly at the end of the iteration.
            if not work.is_completed():
                return runtime.ZB_ERR_TIMEOUT
            self._keep(self._requests.pop(rid))
            return runtime.ZB_OK
        self._keep(self._requests.pop(rid))
        if self._failed is not None:
            self.last_error = self._failed
            return runtime.ZB_ERR_REMOTE
        try:
            if self._abort_key is None:
                work.wait(timeout=datetime.timedelta(seconds=timeout_s))
            else:
                failed = self._wait_watching(work, peer, timeout_s)
                if failed is not None:
                    self.last_error = f"torch.distributed {what} rank {peer} (channel {tag}) stopped: {failed}"
                    return runtime.ZB_ERR_REMOTE
        except RuntimeError as exc:
            text = first_line(exc)
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()
            failed = self._peer_failure()
            if failed is not None:  # the pair closed because of a failure a peer published: say which
                self.last_error = f"torch.distributed {what} rank {peer} (channel {tag}) stopped: {failed}"
                return runtime.ZB_ERR_REMOTE
            self.last_error = (f"torch.distributed {what} rank {peer} (channel {tag}) "
                               f"{'timed out' if timed_out else 'failed'}: {text}")
            return runtime.ZB_ERR_TIMEOUT if timed_out else runtime.ZB_ERR_REMOTE
        return runtime.ZB_OK

    def _wait_watching(self, work, peer, timeout_s):
        """work.wait on the helper thread; returns None once it finished, or the failure a peer
        published meanwhile. Raises what the wait raised."""
        if self._waiter is None:
            self._waiter = _Waiter()
        return wait_watched(self._waiter, work, self.group, peer, timeout_s, self._peer_failure)

    def _peer_failure(self):
        """The failure some rank published under this pipeline's key, or None."""
        if self._abort_key is None:
            return None
        if self._failed is None:
            self._failed = published_failure(self._store, self._abort_key)
        return self._failed

    def _keep(self, request):
        self._done.append(request)
        if len(self._done) > _KEEP_DONE:  # a caller that never ends a step: keep a bounded number
            self.end_step()

    def end_step(self):
        """A step is over: the requests finished before the previous step's end are dropped. The
        schedule calls it as each step begins, every rank after the handshake: the socket
        transport connects there at the latest."""
        if self.kind == "socket":
            self.connect()
        self._done_before, self._done = self._done, []

    def cancel(self, rid):
        # gloo cannot withdraw a posted request; dropping it is all we can do. The pairs are
        # closed after the failure that led here anyway.
        if rid in self._requests:
            self._keep(self._requests.pop(rid))

    def abort(self, reason):
        if self.kind != "gloo":
            # The C transport tells its peers over the sockets and publishes in the store; its
            # errors say everything (no last_error to add).
            self._sock.abort(reason)
            return
        # gloo has no side channel: the failure goes to the peers through the c10d store (the first
        # rank's wins), where their waits look for it.
        self.last_error = self.last_error or reason
        if self._abort_key is not None and self._failed is None:
            self._failed = publish_failure(self._store, self._abort_key,
                                           f"rank {global_rank(self.group, self.rank)} failed first: {reason}")

    def note_error(self, exc):
        self.last_error = f"{type(exc).__name__}: {exc}"

    def take_error(self):
        text, self.last_error = self.last_error, None
        return text

    def close(self):
        """Frees the C transport, or, while a post-validated optimizer still uses it (the library
        refuses with ZB_ERR_BUSY), leaves that to the optimizer's close(): the schedule and the
        optimizer may be closed in either order."""
        try:
            (self._sock if self._sock is not None else self._callbacks).close()
        except _lib.ZbError as err:
            if err.code != runtime.ZB_ERR_BUSY:
                raise
            self.close_pending = True
            return
        self.close_pending = False
        self._requests.clear()

    close_pending = False
