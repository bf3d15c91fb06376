"""POSIX shared memory of one emulated run: host slots and the control block.

Names are ``<prefix>_r<rank>_<tensor>`` (slots) and ``<prefix>_ctl``; the
prefix is unique per run (``new_prefix``), so a launcher or a test can find
and remove whatever a crashed run left (``sweep``). Rank 0 creates every
segment, the other ranks attach to their own; by default the names are
unlinked as soon as every rank has mapped them (as the fork does), so nothing
can leak after start-up whatever happens to the processes later.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

SHM_DIR = "/dev/shm"


def new_prefix() -> str:
    return f"mtemu{os.getpid()}x{secrets.token_hex(4)}"


def slot_name(prefix: str, rank: int, tensor: str) -> str:
    return f"{prefix}_r{rank}_{tensor}"


def ctl_name(prefix: str) -> str:
    return f"{prefix}_ctl"


def list_segments(prefix: str) -> list[str]:
    """Names under /dev/shm that belong to the run ``prefix``."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "_"))
    except FileNotFoundError:
        return []


def sweep(prefix: str) -> list[str]:
    """Unlink every segment of run ``prefix``; returns the names removed."""
    removed = []
    for name in list_segments(prefix):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            continue
        removed.append(name)
        try:  # rank 0 registered it with the (shared) resource tracker when it created it
            resource_tracker.unregister("/" + name, "shared_memory")
        except Exception:
            pass
    return removed


@dataclass(frozen=True)
class SlotLayout:
    """Per-expert shape and dtype of every staged tensor, in copy order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def expert_nbytes(self, name: str) -> int:
        i = self.names.index(name)
        n = torch.Size(self.shapes[i]).numel()
        return n * torch.empty((), dtype=self.dtypes[i]).element_size()

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        i = self.names.index(name)
        return self.shapes[i], self.dtypes[i]


class HostSlots:
    """Double-buffered host slots ``[2, *per_expert_shape]`` per tensor name.

    Rank 0 (create=True) maps every rank's slots (its native writer fills them
    all); another rank maps only its own."""

    def __init__(self, prefix: str, rank: int, world: int, layout: SlotLayout, create: bool):
        self.prefix, self.rank, self.world, self.layout = prefix, rank, world, layout
        self._shms: dict[tuple[int, str], shared_memory.SharedMemory] = {}
        self.views: dict[tuple[int, str], torch.Tensor] = {}
        ranks = range(world) if create else (rank,)
        try:
            for r in ranks:
                for name in layout.names:
                    nbytes = 2 * layout.expert_nbytes(name)
                    shm = shared_memory.SharedMemory(name=slot_name(prefix, r, name), create=create,
                                                     size=nbytes if create else 0)
                    self._shms[(r, name)] = shm
                    shape, dtype = layout.spec(name)
                    raw = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
                    self.views[(r, name)] = raw.view(dtype).view((2, *shape))
        except BaseException:
            self.close(unlink=create)
            raise
        self.linked = create

    def own(self) -> dict[str, torch.Tensor]:
        """This rank's slots by tensor name."""
        return {name: self.views[(self.rank, name)] for name in self.layout.names}

    def ptrs(self) -> dict[str, list[int]]:
        """name -> base address of each rank's slots (0 where not mapped), like the fork's all_rank_buffer_ptrs."""
        return {
            name: [self.views[(r, name)].data_ptr() if (r, name) in self.views else 0 for r in range(self.world)]
            for name in self.layout.names
        }

    def unlink(self) -> None:
        """Remove the names (creator only); mappings stay valid."""
        for shm in self._shms.values():
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self.linked = False

    def close(self, unlink: bool = False) -> None:
        self.views.clear()
        if unlink:
            self.unlink()
        for shm in self._shms.values():
            _close(shm)
        self._shms.clear()


class Control:
    """Shared int64 counters that make the slow-peer injection deterministic.

    gen[r, s]:      completed native writes into rank r's slot s (all four tensors)
    ontime[r, s]:   newest generation of slot s whose on-time copies rank r finished
    delayed[r, s]:  newest generation of slot s whose held copy rank r finished
    parked:         non-zero while rank 0 waits in a reader fence
    writes_done:    load sequence number of the last load whose writes rank 0 finished
    """

    _SCALARS = ("parked", "writes_done", "abort")

    def __init__(self, prefix: str, world: int, create: bool):
        self.world = world
        n = 3 * world * 2 + len(self._SCALARS)
        self._shm = shared_memory.SharedMemory(name=ctl_name(prefix), create=create, size=8 * n if create else 0)
        self.arr = np.ndarray((n,), dtype=np.int64, buffer=self._shm.buf)
        if create:
            self.arr[:] = 0
        base = 0
        self.gen = self.arr[base : base + 2 * world].reshape(world, 2)
        base += 2 * world
        self.ontime = self.arr[base : base + 2 * world].reshape(world, 2)
        base += 2 * world
        self.delayed = self.arr[base : base + 2 * world].reshape(world, 2)
        self._scalar_base = base + 2 * world
        self.created = create

    def _idx(self, key: str) -> int:
        return self._scalar_base + self._SCALARS.index(key)

    def get(self, key: str) -> int:
        return int(self.arr[self._idx(key)])

    def set(self, key: str, value: int) -> None:
        self.arr[self._idx(key)] = value

    def unlink(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass

    def close(self, unlink: bool = False) -> None:
        if unlink:
            self.unlink()
        self.gen = self.ontime = self.delayed = self.arr = None
        _close(self._shm)


def _close(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:
        # A tensor view still exports the buffer (e.g. an exception traceback
        # holds it). The mapping dies with the process; make __del__ quiet.
        shm._buf = None
        shm._mmap = None
