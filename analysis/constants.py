"""The constant fills a captured tensor is held to before asking which tensor it is:
zeros, a few values per dtype, and raw byte patterns (uninitialized memory), each with
its fingerprint at the tensor's size (analysis.verdicts asks for them)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from moetrace.fingerprint import CHUNK_BYTES, fingerprint

# Values tried for "constant fill" per dtype name (zeros are tried for every dtype).
CONSTANT_CANDIDATES = {
    "float32": (1.0, -1.0, float("nan"), float("inf")),
    "bfloat16": (1.0, -1.0, float("nan"), float("inf")),
    "float16": (1.0, -1.0, float("nan"), float("inf")),
    "float8_e4m3fn": (1.0, -1.0, float("nan"), 448.0),
    "float8_e5m2": (1.0, -1.0, float("nan"), float("inf")),
}
BYTE_FILLS = (0xFF,)  # raw byte patterns tried for every dtype (uninitialized memory)



def _dtype_of(name: str) -> torch.dtype | None:
    dt = getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) else None


def _fill_bytes(dtype_name: str, value: float) -> bytes | None:
    dt = _dtype_of(dtype_name)
    if dt is None:
        return None
    try:
        t = torch.tensor([value], dtype=torch.float32).to(dt)
    except (RuntimeError, TypeError):
        return None
    return t.view(torch.uint8).numpy().tobytes()


@lru_cache(maxsize=4096)
def constant_fingerprint(pattern: bytes, nbytes: int):
    """Fingerprint of `nbytes` bytes repeating `pattern` (cached per pattern and size)."""
    reps = -(-nbytes // len(pattern))
    arr = np.frombuffer(pattern * min(reps, CHUNK_BYTES), dtype=np.uint8)
    if reps > CHUNK_BYTES:
        arr = np.tile(arr, -(-reps // CHUNK_BYTES))
    return fingerprint(torch.from_numpy(arr[:nbytes].copy()))


def constant_candidates(dtype_name: str, nbytes: int) -> list[tuple[str, bytes]]:
    """(description, byte pattern) of the constant fills tried for a tensor."""
    out = [("zeros", b"\0")]
    for v in CONSTANT_CANDIDATES.get(dtype_name, ()):
        pat = _fill_bytes(dtype_name, v)
        if pat is not None and any(pat):
            out.append((f"the constant {v:g} ({dtype_name})", pat))
    for b in BYTE_FILLS:
        out.append((f"the byte 0x{b:02X} repeated", bytes([b])))
    return [(d, p) for d, p in out if nbytes % len(p) == 0]
