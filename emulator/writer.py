"""The emulator's slow-peer injection on rank 0's writer (moetrace's writer itself,
the stand-in for kt-kernel's, is conform/writer.py): pointers back to (rank, slot),
and the gate that orders every write but the injected late read.
"""

from __future__ import annotations

import time

from moetrace.emulator.copy_engine import StagingTimeout


class SlotIndex:
    """Turns a destination pointer back into (rank, slot): the writer's bookkeeping
    for the injection's generation counters (kt-kernel only sees pointers)."""

    def __init__(self, base_ptrs: dict[str, list[int]], expert_nbytes: dict[str, int]):
        self.base = base_ptrs
        self.nbytes = expert_nbytes

    def slot_of(self, name: str, rank: int, ptr: int) -> int:
        off = ptr - self.base[name][rank]
        slot, rem = divmod(off, self.nbytes[name])
        if rem or slot not in (0, 1):
            raise ValueError(f"pointer {ptr:#x} is not a slot of {name} on rank {rank}")
        return slot


class WriteGate:
    """Injection only: before rank r's slot s is refilled, the copies that the
    injection models as on time (all but the held one) of the slot's current
    content, and the held copy of its previous content, must have completed on
    rank r. This removes every timing race except the one injected, so the
    outcome is the same on every run. The reader fence (fence="all") makes this
    wait a no-op; fence="none" is where it orders things."""

    POLL_S = 0.0002

    def __init__(self, control, slow_rank: int, timeout_s: float):
        self.control = control
        self.slow_rank = slow_rank
        self.timeout_s = timeout_s

    def wait_writable(self, rank: int, slot: int) -> None:
        c = self.control
        deadline = time.monotonic() + self.timeout_s
        while True:
            g = int(c.gen[rank, slot])
            ok = int(c.ontime[rank, slot]) >= g
            if rank == self.slow_rank:
                ok = ok and int(c.delayed[rank, slot]) >= g - 1
            if ok:
                return
            if time.monotonic() > deadline:
                raise StagingTimeout(
                    f"rank 0 writer: rank {rank} slot {slot} (generation {g}) still being read after "
                    f"{self.timeout_s:g} s (on-time reads done through {int(c.ontime[rank, slot])}, "
                    f"held read through {int(c.delayed[rank, slot])})"
                )
            time.sleep(self.POLL_S)
