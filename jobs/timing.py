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
