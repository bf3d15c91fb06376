"""Best-of-N wall time, the one timer the selftest and the benchmarks share."""

from __future__ import annotations

import time
from typing import Callable


def best_of(fn: Callable[[], object], repeats: int, sync: Callable[[], None] | None = None) -> float:
    """Fastest of `repeats` runs in seconds; `sync` (e.g. torch.cuda.synchronize)
    runs before and after each so asynchronous device work is counted."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best


def interleaved(fns: dict[str, Callable[[], object]], repeats: int,
                sync: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds of each fn over `repeats` rounds, every round running each fn once
    in turn, so a ratio between two of them is taken under the same load."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            times[name].append(best_of(fn, 1, sync))
    return times


def median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def median_ratio(times: dict[str, list[float]], name: str, baseline: str) -> float:
    """Median over rounds of baseline time / name time (> 1: name is faster)."""
    return median([b / t for b, t in zip(times[baseline], times[name])])


ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "sve", "sve2", "asimd")


def cpu_description() -> str:
    """The CPU model, its core count and the SIMD flags that change hashing speed (Linux
    /proc/cpuinfo), so a benchmark figure says where it was measured."""
    import os
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                unnamed = model in ("", platform.machine(), platform.processor())
                if key in ("model name", "Model", "CPU part") and unnamed:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    isa = [f for f in ISA_FLAGS if f in flags]
    return f"{model}, {cores} cores, {platform.machine()} {' '.join(isa) or '(no SIMD flags listed)'}"
