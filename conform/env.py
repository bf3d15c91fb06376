"""What the fork's module-level names resolve to inside a conform rank process.

- ``torch``: real torch, except ``torch.cuda`` (the simulated runtime) and
  ``torch.distributed`` (real gloo, with the schedule told about collectives);
- the TP getters and ``get_tp_group()``: this rank in the gloo world;
- ``os.sched_setaffinity``: recorded, not applied (it would pin the rank's
  threads to one core of a small box and fails for ranks past the core count);
- ``ctypes.CDLL("libnuma.so.1")``: a stand-in (NUMA placement changes no bytes);
- any ``import sglang...`` at run time: refused (conform never loads sglang).
"""

from __future__ import annotations

import ctypes as _ctypes
import importlib.abc
import os as _os
import sys
import types

import torch
import torch.distributed as _dist

COLLECTIVES = ("barrier", "all_reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
               "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object",
               "scatter", "scatter_object_list", "reduce", "all_to_all", "all_to_all_single", "monitored_barrier",
               "send", "recv")


class _Delegate(types.ModuleType):
    def __init__(self, name: str, real, **overrides):
        super().__init__(name)
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._real, name)


def dist_module(schedule) -> types.ModuleType:
    """torch.distributed whose collectives tell the schedule when they start and end."""
    def wrap(name):
        fn = getattr(_dist, name)

        def collective(*args, **kwargs):
            schedule.before_collective(f"dist.{name}")
            try:
                return fn(*args, **kwargs)
            finally:
                schedule.after_collective()

        collective.__name__ = name
        return collective

    return _Delegate("torch.distributed", _dist, **{n: wrap(n) for n in COLLECTIVES if hasattr(_dist, n)})


class TPGroup:
    """The slice of SGLang's GroupCoordinator the fork reads: every rank of this
    gloo world is one TP group; device_group is gloo too (no NCCL on CPU)."""

    def __init__(self, dist_mod):
        self._dist = dist_mod
        self.world_size = _dist.get_world_size()
        self.rank_in_group = _dist.get_rank()
        self.rank = self.rank_in_group
        self.ranks = list(range(self.world_size))
        self.first_rank = 0
        self.last_rank = self.world_size - 1
        self.is_first_rank = self.rank == 0
        self.local_rank = self.rank
        self.cpu_group = _dist.group.WORLD
        self.device_group = _dist.group.WORLD
        self.device = torch.device("cpu")

    def barrier(self):
        self._dist.barrier(group=self.cpu_group)

    def all_reduce(self, t, op=None):
        self._dist.all_reduce(t, group=self.device_group, **({"op": op} if op is not None else {}))
        return t

    def broadcast_object_list(self, objs, src=0):
        self._dist.broadcast_object_list(objs, src=src, group=self.cpu_group)
        return objs


class _Numa:
    def numa_available(self):
        return 0

    def numa_set_localalloc(self):
        return None

    def __getattr__(self, name):
        return lambda *a, **k: 0


class _BlockSglang(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "sglang" or fullname.startswith("sglang."):
            raise ImportError(f"conform: the fork's code imported {fullname} while running; conform runs the "
                              f"fork's SharedFullContext alone and loads no sglang package")
        return None


def block_sglang_imports() -> None:
    if not any(isinstance(f, _BlockSglang) for f in sys.meta_path):
        sys.meta_path.insert(0, _BlockSglang())


def fork_namespace(runtime, schedule) -> tuple[dict, dict, dict]:
    """(provided names, replacement modules, facts recorded) for compile_fork."""
    facts = {"sched_setaffinity": []}
    dist_mod = dist_module(schedule)
    group = TPGroup(dist_mod)
    torch_mod = _Delegate("torch", torch, cuda=runtime.cuda_module(), distributed=dist_mod)
    os_mod = _Delegate("os", _os, sched_setaffinity=lambda pid, cpus: facts["sched_setaffinity"].append(sorted(cpus)))

    def cdll(name, *a, **k):
        return _Numa() if "libnuma" in str(name) else _ctypes.CDLL(name, *a, **k)

    ctypes_mod = _Delegate("ctypes", _ctypes, CDLL=cdll)
    provided = {
        "sglang.srt.distributed.get_tensor_model_parallel_rank": lambda: group.rank,
        "sglang.srt.distributed.get_tensor_model_parallel_world_size": lambda: group.world_size,
        "sglang.srt.distributed.get_tp_group": lambda: group,
    }
    modules = {"torch": torch_mod, "torch.distributed": dist_mod, "os": os_mod, "ctypes": ctypes_mod}
    return provided, modules, facts
