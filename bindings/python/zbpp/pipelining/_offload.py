"""PipeOffload in the torch layer: the activations a stage's forward saves for its backward, moved
to host memory and back at the schedule's OFFLOAD and RELOAD ops (DESIGN.md 3, 4).

What this is: `Offloader`, one per PipelineSchedule with offload on. Around every forward of the
rank's stages it installs torch.autograd.graph.saved_tensors_hooks: each saved tensor becomes a
handle on its storage (one entry per storage, however many views of it autograd saves), except
parameters and buffers (not per microbatch, and autograd must get the objects themselves back),
tensors under `min_bytes`, and the stage's own inputs, which the runner keeps anyway. The runner's
copy callback (`copy`) moves a (stage, mb)'s storages: OFFLOAD copies each to host memory (pinned
on CUDA) and drops the device reference, so the storage is freed once its copy is done; RELOAD
copies them back into fresh device memory, and each handle rebuilds its view when autograd unpacks
it in B or W. On CUDA the copies go on a stream of their own: OFFLOAD waits for the forward with an
event, the freed block is marked used by the copy stream (record_stream) so torch's allocator does
not hand it out before the copy has read it, and an unpack makes the compute stream wait for its
RELOAD's event. On the host backend the runner calls `copy` on its own thread (copy_inline), in
list order: a RELOAD just before the op before it unless an OFFLOAD comes first, an OFFLOAD just
after its F. A CPU has no copy engine to
overlap with, and Python's callbacks would only contend for the interpreter lock.

Memory is counted as the schedule model counts it (zbpp.h, zb_schedule_rank_memory): an OFFLOAD
puts its bytes on the host when it starts and takes them off the device when it ends; a RELOAD
puts them back on the device when it starts and off the host when it ends; a storage leaves the
device when autograd lets go of its last handle and of every tensor unpacked from it (after the B
or W that read it: a split layer's x goes from B's unpack to the W store, which holds it until W). `peaks()` gives
the step's largest device-resident and host-held bytes, to set beside the plan's.

Host memory comes from a pool (`_HostPool`, pinned on CUDA) reserved once per stage, at the
stage's first OFFLOAD: as many slots as the rank's plan ever holds of that stage's microbatches on
the host at once (`plan`; copies run one at a time in list order, so the list says it), each the
size of that first microbatch's saved bytes. An offloaded group takes a slot and gives it back when
its RELOAD has read it (on CUDA at once: the next copy into it is queued behind the RELOAD on the
same copy stream), so a step allocates no host memory after its first, and a CPU copy writes into
memory that is already mapped instead of asking the kernel for fresh pages. A group larger than its
stage's slot, or one more than the plan holds, gets memory of its own (`pool_misses` counts them),
and the next step's pool has slots of that larger size (longer sequences from then on).

What this is not: a planner (the schedule says what moves and when: Schedule.plan_offload), or a
general CPU-offload context (torch.autograd.graph.save_on_cpu moves everything at once).
"""

import contextlib
import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_OFFLOAD, _RELOAD = "OFFLOAD", "RELOAD"


class _Entry:
    """One saved storage of one (stage, mb): its bytes on the device or on the host."""

    __slots__ = ("nbytes", "dev", "host", "live", "ready", "key", "slot")

    def __init__(self, nbytes, dev, key):
        self.nbytes, self.dev, self.host, self.live, self.ready, self.key = nbytes, dev, None, 0, None, key
        self.slot = None  # the pool slot its host copy lies in (None: memory of its own)


class _Slot:
    """One microbatch's room in a stage's reserved host memory, and how many entries lie in it."""

    __slots__ = ("stage", "buf", "users")

    def __init__(self, stage, buf):
        self.stage, self.buf, self.users = stage, buf, 0


_ALIGN = 512  # each storage's copy starts at this alignment within its slot (DMA-friendly on CUDA)


def _aligned(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _HostPool:
    """Host memory for offloaded activations, reserved once per stage (see the module docstring)."""

    def __init__(self, pinned):
        self.pinned = pinned
        self.count = {}  # stage -> slots the plan needs at once
        self.size = {}  # stage -> bytes of one slot (known at the stage's first OFFLOAD)
        self.free = {}  # stage -> [free _Slot]
        self.reserved = 0  # bytes reserved
        self.misses = 0  # groups that got memory of their own
        self.want = {}  # stage -> the largest group that did not fit its slot

    def plan(self, counts):
        """The plan's slots per stage; a stage already reserved grows to a larger count."""
        for s, n in counts.items():
            more = n - self.count.get(s, 0)
            if more > 0:
                self.count[s] = n
                if s in self.size:
                    self._reserve(s, more)

    def _reserve(self, s, n):
        size = self.size[s]
        slab = torch.empty(n * size, dtype=torch.uint8, pin_memory=self.pinned)
        self.free.setdefault(s, []).extend(_Slot(s, slab[j * size:(j + 1) * size]) for j in range(n))
        self.reserved += n * size

    def take(self, s, nbytes):
        """A slot of stage s for a group of `nbytes` (aligned), or None when none fits."""
        if s not in self.size and self.count.get(s, 0) > 0:
            self.size[s] = nbytes
            self._reserve(s, self.count[s])
        free = self.free.get(s)
        if not free or nbytes > self.size[s]:
            self.misses += 1
            if s in self.size and nbytes > self.size[s]:
                self.want[s] = max(self.want.get(s, 0), nbytes)
            return None
        return free.pop()

    def regrow(self):
        """Between steps: stages whose groups outgrew their slots get slots of the larger size
        (the old slab goes once no slot of it is in use)."""
        for s, nbytes in self.want.items():
            if self.free.get(s) is not None and len(self.free[s]) == self.count.get(s, 0):
                self.reserved -= self.count[s] * self.size[s]
                self.free[s], self.size[s] = [], nbytes
                self._reserve(s, self.count[s])
        self.want = {}

    def give(self, slot):
        self.free[slot.stage].append(slot)


class _Handle:
    """What autograd keeps instead of a saved tensor: its entry and the view's geometry."""

    __slots__ = ("entry", "dtype", "offset", "size", "stride", "owner", "__weakref__")

    def __init__(self, owner, entry, t):
        self.owner, self.entry = owner, entry
        self.dtype, self.offset, self.size, self.stride = t.dtype, t.storage_offset(), t.size(), t.stride()
        entry.live += 1

    def get(self):
        entry = self.entry
        if entry.dev is None:
            raise RuntimeError("zbpp offload: a saved activation was read while it is in host memory (its RELOAD "
                               "has not run before the backward that needs it)")
        if entry.ready is not None:  # CUDA: the RELOAD's copy must be done before this stream reads it
            torch.cuda.current_stream(entry.dev.device).wait_event(entry.ready)
        view = torch.empty(0, dtype=self.dtype, device=entry.dev.device)
        return view.set_(entry.dev.untyped_storage(), self.offset, self.size, self.stride)

    def __del__(self):
        owner = self.owner
        if owner is not None:
            owner._release(self.entry)


class Offloader:
    """See the module docstring. stages: {stage index: module} of this rank; device: their device."""

    def __init__(self, stages, device, min_bytes=1024):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # saved tensors say cuda:N; compare like with like
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.min_bytes = int(min_bytes)
        self._skip = {}  # stage -> storage pointers of its parameters and buffers
        for s, module in stages.items():
            nn = torch.nn.Module
            self._skip[s] = {t.untyped_storage().data_ptr() for t in
                             list(nn.parameters(module)) + list(nn.buffers(module))}
        self._lock = threading.RLock()
        self._groups = {}  # (stage, mb) -> {storage pointer: _Entry}
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pinned = {}  # nbytes -> [free pinned host buffers] (CUDA; groups the pool had no slot for)
        self.pool = _HostPool(pinned=self.cuda)
        self._pending_host = []  # (event, host buffer) of RELOADs still reading their host buffer
        self.begin_step()

    # ---- accounting -------------------------------------------------------------------------------

    def begin_step(self):
        """Forgets the last step's groups (a failed step's included) and resets the peaks."""
        with self._lock:
            for group in self._groups.values():
                for entry in group.values():
                    if entry.slot is not None:  # a failed step's copy: its slot is free again
                        self._give_host(entry)
                    entry.dev = entry.host = None
            self._groups = {}
            self._lingering = []  # (StorageWeakRef, bytes): released by autograd, still held elsewhere
            self.device_bytes = self.host_bytes = 0
            self.device_peak = self.host_peak = 0
            self.group_bytes = {}  # (stage, mb) -> bytes captured
            self.pool.regrow()
            self.pool.misses = 0

    def _add(self, device=0, host=0):
        with self._lock:
            if device and self.device_bytes + device > self.device_peak:
                self._sweep()  # only lowers the count: needed only where a new peak may be set
            self.device_bytes += device
            self.host_bytes += host
            self.device_peak = max(self.device_peak, self.device_bytes)
            self.host_peak = max(self.host_peak, self.host_bytes)

    def _release(self, entry):
        """A handle died: when its entry has no other, the storage is autograd's no more."""
        with self._lock:
            entry.live -= 1
            if entry.live > 0:
                return
            if entry.dev is not None:
                # Autograd is done with it, but what B unpacked may live on: a split layer's x goes
                # to the W store (a C++ op's entry on the torch kernel), which holds it until its W.
                # The bytes count until the storage itself is gone (swept before each addition,
                # where a peak can only rise).
                ref = StorageWeakRef(entry.dev.untyped_storage())
                entry.dev = None
                if ref.expired():
                    self.device_bytes -= entry.nbytes
                else:
                    self._lingering.append((ref, entry.nbytes))
            if entry.host is not None:  # offloaded and never reloaded (a forward-only or failed step)
                self._give_host(entry)
                entry.host = None
                self.host_bytes -= entry.nbytes

    def plan(self, schedule, rank):
        """Sizes the host pool for `rank`'s op list: per stage, the most of its microbatches that
        are on the host at once (offloaded, not yet reloaded), counted in list order."""
        held, most = {}, {}
        for op in schedule.rank_ops(rank):
            if op.type == _OFFLOAD:
                held[op.stage] = held.get(op.stage, 0) + 1
                most[op.stage] = max(most.get(op.stage, 0), held[op.stage])
            elif op.type == _RELOAD:
                held[op.stage] = held.get(op.stage, 0) - 1
        self.pool.plan(most)

    def _sweep(self):
        """Storages autograd let go of that are gone now: off the device count (under the lock)."""
        # Swapped out first: a release from a garbage collection during the loop appends to the
        # new list, not to one about to be dropped.
        pending, self._lingering = self._lingering, []
        for ref, n in pending:
            if ref.expired():
                self.device_bytes -= n
            else:
                self._lingering.append((ref, n))

    def peaks(self):
        """(device-resident, host-held) peak bytes of saved activations since begin_step."""
        with self._lock:
            return self.device_peak, self.host_peak

    # ---- capture ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self, s, i, inputs):
        """Around F(s, i): autograd's saved tensors become handles of the (s, i) group."""
        skip = set(self._skip.get(s, ()))
        for t in inputs:
            if isinstance(t, torch.Tensor):
                skip.add(t.untyped_storage().data_ptr())
        group = self._groups.setdefault((s, i), {})

        def pack(t):
            if isinstance(t, torch.nn.Parameter) or t.device != self.device:
                return t
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr in skip or nbytes < self.min_bytes:
                return t
            entry = group.get(ptr)
            if entry is None:
                whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (nbytes,), (1,))
                entry = group[ptr] = _Entry(nbytes, whole, (s, i))
                self.group_bytes[(s, i)] = self.group_bytes.get((s, i), 0) + nbytes
                self._add(device=nbytes)
            return _Handle(self, entry, t)

        def unpack(h):
            return h if isinstance(h, torch.Tensor) else h.get()

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    # ---- the runner's copy callback ----------------------------------------------------------------

    def copy(self, kind, s, i):
        """OFFLOAD or RELOAD of (s, i)'s group (the runner's copy_cb)."""
        entries = [e for e in self._groups.get((s, i), {}).values() if e.live > 0]
        if kind == _OFFLOAD:
            self._offload(entries)
        else:
            self._reload(entries)

    def _offload(self, entries):
        todo = [e for e in entries if e.dev is not None and e.host is None]
        self._add(host=sum(e.nbytes for e in todo))  # on the host from the copy's start
        if todo:
            with self._lock:
                slot = self.pool.take(todo[0].key[0], sum(_aligned(e.nbytes) for e in todo))
            if slot is not None:
                at = 0
                for e in todo:
                    e.host, e.slot = slot.buf[at:at + e.nbytes], slot
                    slot.users += 1
                    at += _aligned(e.nbytes)
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(compute)  # the forward that made them was enqueued before
            with torch.cuda.stream(self._stream):
                for e in todo:
                    if e.host is None:
                        e.host = self._take_host(e.nbytes)
                    e.host.copy_(e.dev, non_blocking=True)
                    e.dev.record_stream(self._stream)  # freed now, reused only after this copy
        else:
            for e in todo:
                if e.host is None:
                    e.host = e.dev.clone()
                else:
                    e.host.copy_(e.dev)
        with self._lock:
            for e in todo:
                if e.live > 0 and e.dev is not None:
                    e.dev = None  # off the device at the copy's end
                    self.device_bytes -= e.nbytes

    def _reload(self, entries):
        todo = [e for e in entries if e.host is not None]
        self._add(device=sum(e.nbytes for e in todo))  # on the device from the copy's start
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._stream):
                for e in todo:
                    dev = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
                    dev.copy_(e.host, non_blocking=True)
                    dev.record_stream(compute)  # read (and freed) on the compute stream later
                    e.dev = dev
                    e.ready = torch.cuda.Event()
                    e.ready.record(self._stream)
                    if e.slot is None:  # a pool slot is reused behind this copy on the same stream
                        self._pending_host.append((e.ready, e.host))
        else:
            for e in todo:
                e.dev = e.host.clone()
        with self._lock:
            for e in todo:
                if not self.cuda or e.slot is not None:
                    self._give_host(e)
                e.host = None
                self.host_bytes -= e.nbytes

    # ---- pinned host memory (CUDA) ------------------------------------------------------------------

    def _take_host(self, nbytes):
        with self._lock:
            done = [(ev, buf) for ev, buf in self._pending_host if ev.query()]
            self._pending_host = [(ev, buf) for ev, buf in self._pending_host if not ev.query()]
            for _, buf in done:
                self._pinned.setdefault(buf.numel(), []).append(buf)
            free = self._pinned.get(nbytes)
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _give_host(self, entry):
        """entry's host copy is no longer needed: back to its pool slot (when its last user goes)
        or, on CUDA, to the free pinned buffers."""
        slot = entry.slot
        if slot is not None:
            entry.slot = None
            slot.users -= 1
            if slot.users == 0:
                self.pool.give(slot)
        elif self.cuda:
            self._pinned.setdefault(entry.host.numel(), []).append(entry.host)


# The step may grow by this fraction at most for the copies PipelineSchedule(offload=...) places
# (Schedule.plan_offload's slowdown): transfers that do not hide are left out.
OFFLOAD_SLOWDOWN = 0.02


def _offload_choice(name, offload, num_stages):
    """offload= of a schedule class: None (also "none" or False: off), "auto" (every stage's
    activations may move) or the stage indices whose activations may move."""
    if offload is None or offload is False or offload == "none":
        return None
    if offload == "auto" or offload is True:
        return "auto"
    if isinstance(offload, (list, tuple, set, frozenset)):
        chosen = sorted(offload)
        bad = [x for x in chosen if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < num_stages]
        if bad or not chosen:
            raise ValueError(f"zbpp.{name}: offload= takes stage indices in 0..{num_stages - 1}, got {offload!r}")
        return tuple(chosen)
    raise ValueError(f"zbpp.{name}: offload must be None or 'none', 'auto' (every stage's activations may move to "
                     f"host memory where the copies hide), or a list of stage indices; got {offload!r}")


def _has_copies(schedule):
    """Whether the schedule has OFFLOAD/RELOAD ops on any rank."""
    return any(op.type in ("OFFLOAD", "RELOAD") for r in range(schedule.ranks) for op in schedule.rank_ops(r))


def _copy_times_in(schedule):
    """Whether the schedule's times include PipeOffload's copies (times['offload'], ['reload'])."""
    return any(schedule.op_time("OFFLOAD", st) > 0 or schedule.op_time("RELOAD", st) > 0
               for st in range(schedule.stages))
