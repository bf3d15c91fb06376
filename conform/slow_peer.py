"""The slow-peer schedule: a deterministic late reader on the ranks after 0.

A held copy (by default every copy a rank > 0 issues from a host slot) does not
start until either
- rank 0 has completed a later write into that slot (the copy then reads the
  refill: E+2 in the fork's double-buffered loop), or
- the issuing rank itself waits for it (an event or stream it is behind is
  synchronized, or torch.cuda.synchronize(): conform/sim_cuda.py's demand) and
  rank 0 waits in a collective this rank has not reached (rank 0 can then
  refill nothing more before this rank moves: the latest the copy can run).
A collective alone completes no copy (a rank reaches a barrier with its copies
in flight), and an event sync alone does not stop rank 0 (it refills while the
peer is still on its way to the sync): a fence needs both, on every rank.
Everything else is made on time: rank 0 completes a submitted native write
before it enters a collective; after each completed write or collective entry
it waits until every peer's streams ran what became runnable; and before it
refills a slot it waits until every peer finished its on-time (not held) copies
of what the slot holds. The outcome is the same on every run.

State crosses processes in a small int64 block of POSIX shared memory
(``Control``): rank 0 writes state, then bumps ``version``; each peer publishes
the version its streams were last quiet at (``ack``) and how far its on-time
copies got (``ontime``).
"""

from __future__ import annotations

import threading
import time
from multiprocessing import shared_memory

import numpy as np

from moetrace.conform.sim_cuda import QUIET, Hold, SimRuntime, SimTimeout

MAX_SLOTS = 8
_VERSION, _IN_COLLECTIVE, _SLOT0 = 0, 1, 2
_ACK0 = _SLOT0 + MAX_SLOTS  # then world ack words, then world ontime words


def _key(load: int, position: int) -> int:
    """A write or copy position, ordered across the loads of one schedule."""
    return (load << 24) + position


def _words(world: int) -> int:
    return _ACK0 + 2 * world


class Control:
    def __init__(self, name: str | None, world: int, create: bool = False):
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=_words(world) * 8 if create else 0)
        self.words = np.ndarray((_words(world),), dtype=np.int64, buffer=self.shm.buf)
        self.world = world
        if create:
            self.reset()

    def reset(self) -> None:
        self.words[:] = 0
        self.words[_SLOT0:_ACK0] = -1  # no slot written yet

    @property
    def name(self) -> str:
        return self.shm.name

    def version(self) -> int:
        return int(self.words[_VERSION])

    def bump(self) -> int:
        self.words[_VERSION] += 1
        return int(self.words[_VERSION])

    def close(self, unlink: bool = False) -> None:
        del self.words
        self.shm.close()
        if unlink:
            self.shm.unlink()


class PeerHold(Hold):
    def __init__(self, ctl: Control, slot: int, key: int, peer: "SlowPeer", label: str):
        self.ctl, self.slot, self.key, self.peer, self.label = ctl, slot, key, peer, label

    def releasable(self, demanded: bool) -> bool:
        w = self.ctl.words
        return int(w[_SLOT0 + self.slot]) > self.key or (demanded and int(w[_IN_COLLECTIVE]) > self.peer.collectives)

    def describe(self) -> str:
        last = int(self.ctl.words[_SLOT0 + self.slot])
        return (f"held until rank 0 refills slot {self.slot} (last write there: {last & 0xFFFFFF} of load "
                f"{last >> 24}; this copy reads {self.key & 0xFFFFFF} of load {self.key >> 24}) or this rank "
                f"waits for it while rank 0 waits in a collective past this rank's {self.peer.collectives}th")


class OnTime(Hold):
    """A copy that is not held: counted when done, so rank 0 can wait for it."""

    def __init__(self, done, label: str):
        self.done, self.label = done, label

    def releasable(self, demanded: bool) -> bool:
        return True


class SlotMap:
    """This rank's host slots (the fork's cpu_buffers: name -> [S, *per_expert])."""

    def __init__(self, cpu_buffers: dict):
        self.ranges = [(t.data_ptr(), t[0].numel() * t.element_size(), t.shape[0], name)
                       for name, t in cpu_buffers.items()]

    def slot_of(self, ptr: int) -> tuple[str, int] | None:
        for base, per, n, name in self.ranges:
            if base <= ptr < base + per * n:
                return name, (ptr - base) // per
        return None


class SlowPeer:
    """One rank's side of the schedule (the same object on every rank)."""

    POLL_S = 0.0005

    def __init__(self, ctl: Control, rank: int, world: int, runtime: SimRuntime, timeout_s: float,
                 slow_ranks: set | None = None, tensors: set | None = None):
        """slow_ranks: whose copies are held (default: every rank but 0); tensors:
        which host-slot tensors' copies are held (default: all)."""
        self.ctl, self.rank, self.world, self.rt, self.timeout_s = ctl, rank, world, runtime, timeout_s
        self.slow = rank != 0 and (slow_ranks is None or rank in slow_ranks)
        self.tensors = tensors
        self.slots: SlotMap | None = None
        self._positions: dict[int, int] = {}
        self._ontime: dict[int, int] = {}  # position -> on-time copies done (this load)
        self._ontime_per_expert = 0
        self._pending: list[tuple[int, int]] = []  # rank 0: (slot, key) submitted, not yet synced
        self._writes = self._load = 0
        self.collectives = 0  # entered so far (they match in order on every rank)
        self._writer = None
        runtime.control_version = ctl.version
        if rank == 0:
            ctl.reset()  # a fresh schedule: no slot written, no collective entered
        if rank != 0:
            runtime.copy_hook = self._hold_for
            self._stop = threading.Event()
            threading.Thread(target=self._ack_loop, name="sim-ack", daemon=True).start()

    # -- every rank
    def attach_slots(self, cpu_buffers: dict) -> None:
        self.slots = SlotMap(cpu_buffers)
        held = [n for n in cpu_buffers if self.slow and (self.tensors is None or n in self.tensors)]
        self._ontime_per_expert = len(cpu_buffers) - len(held)
        if self.rank != 0 and self._ontime_per_expert == 0:
            self.ctl.words[_ACK0 + self.world + self.rank] = QUIET  # nothing of this rank is on time

    def begin_load(self) -> None:
        """Positions restart per load; keys carry the load number, so a refill by a
        later load counts as a refill too."""
        self._positions.clear()
        self._ontime.clear()
        self._load += 1
        self._writes = 0

    def before_collective(self, what: str) -> None:
        self.collectives += 1
        if self.rank != 0:
            return
        if self._pending and self._writer is not None:
            self._writer.sync_write_weight_scale_to_buffer()  # completes, publishes and drains
        self.ctl.words[_IN_COLLECTIVE] = self.collectives
        v = self.ctl.bump()
        self._wait(lambda r: int(self.ctl.words[_ACK0 + r]) >= v, f"entering {what}")

    def after_collective(self) -> None:
        if self.rank == 0:
            self.ctl.words[_IN_COLLECTIVE] = 0
            self.ctl.bump()

    def close(self) -> None:
        self.rt.copy_hook = None
        self.rt.control_version = lambda: 0
        if self.rank != 0:
            self._stop.set()

    # -- peers
    def _hold_for(self, dst, src):
        hit = self.slots.slot_of(src.data_ptr()) if self.slots is not None else None
        if hit is None:
            return None
        name, slot = hit
        expert = dst.storage_offset() // max(dst.numel(), 1)
        pos = self._positions.setdefault(expert, len(self._positions))
        label = f"rank {self.rank} expert {expert} {name} from slot {slot}"
        if self.slow and (self.tensors is None or name in self.tensors):
            return PeerHold(self.ctl, slot, _key(self._load, pos), self, label)
        return OnTime(lambda: self._copied(pos), label)

    def _copied(self, pos: int) -> None:
        """Engine thread: one on-time copy of `pos` done; the last one publishes it."""
        self._ontime[pos] = self._ontime.get(pos, 0) + 1
        if self._ontime[pos] == self._ontime_per_expert:
            self.ctl.words[_ACK0 + self.world + self.rank] = _key(self._load, pos)

    def _ack_loop(self) -> None:
        """Publish this rank's quiet version whenever a stream's changes (streams re-read
        the control themselves while a copy is held, so nothing else can move it)."""
        def publish(version: int) -> None:
            self.ctl.words[_ACK0 + self.rank] = min(version, QUIET)

        self.rt.watch_settled(publish, self._stop)

    # -- rank 0
    def observe_writer(self, wrapper):
        return _ObservedWriter(wrapper, self)

    def _before_write(self, ptr: int) -> None:
        hit = self.slots.slot_of(ptr)
        if hit is None:
            raise SimTimeout(f"rank 0: native write to {ptr:#x}, which is no host slot of rank 0")
        slot, last = hit[1], int(self.ctl.words[_SLOT0 + hit[1]])
        if last >= 0:  # a refill: every peer's on-time reads of the current content come first
            self._wait(lambda r: int(self.ctl.words[_ACK0 + self.world + r]) >= last,
                       f"refilling slot {slot} (its on-time copies of write {last & 0xFFFFFF} first)")
        self._pending.append((slot, _key(self._load, self._writes)))
        self._writes += 1

    def _synced(self) -> None:
        for slot, key in self._pending:
            self.ctl.words[_SLOT0 + slot] = max(int(self.ctl.words[_SLOT0 + slot]), key)
        self._pending.clear()
        v = self.ctl.bump()
        self._wait(lambda r: int(self.ctl.words[_ACK0 + r]) >= v, "a completed native write")

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        peers = range(1, self.world)
        while not all(ready(r) for r in peers):
            if time.monotonic() > deadline:
                late = [r for r in peers if not ready(r)]
                raise SimTimeout(f"rank 0: {what}: rank(s) {late} did not get there within {self.timeout_s:g} s")
            time.sleep(self.POLL_S)


class NoSchedule:
    """--schedule none: nothing held, nothing observed."""

    def __init__(self, runtime: SimRuntime):
        runtime.copy_hook = None
        runtime.control_version = lambda: 0

    def attach_slots(self, cpu_buffers):
        pass

    def begin_load(self):
        pass

    def before_collective(self, what):
        pass

    def after_collective(self):
        pass

    def observe_writer(self, wrapper):
        return wrapper

    def close(self):
        pass


class _ObservedWriter:
    """Rank 0's writer with the same API: the real writer does the work; this
    records which slot each write fills and when it completed."""

    def __init__(self, wrapper, schedule: SlowPeer):
        self._wrapper, self._schedule = wrapper, schedule

    def submit_write_weight_scale_to_buffer(self, tp, expert_id, w13_ptrs, w13_scale_ptrs, w2_ptrs, w2_scale_ptrs):
        self._schedule._writer = self  # one writer per layer: the one with writes in flight
        self._schedule._before_write(int(w13_ptrs[0]))
        return self._wrapper.submit_write_weight_scale_to_buffer(tp, expert_id, w13_ptrs, w13_scale_ptrs,
                                                                 w2_ptrs, w2_scale_ptrs)

    def sync_write_weight_scale_to_buffer(self):
        out = self._wrapper.sync_write_weight_scale_to_buffer()
        self._schedule._synced()
        return out

    def __getattr__(self, name):
        return getattr(self._wrapper, name)
