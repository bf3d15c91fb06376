"""One safetensors file: its header (8-byte little-endian length + JSON), parsed and
checked here rather than trusted to safetensors, so that a truncated or garbled file
fails with a one-line error naming it; and byte-level copies of what is read from it."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moetrace.errors import MoetraceError

if TYPE_CHECKING:  # torch loads when tensors are read: headers, identities and specs need none
    import torch

# safetensors itself refuses headers above 100 MB; so do we, before allocating.
MAX_HEADER_BYTES = 100_000_000

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

# Safetensors dtype code -> the dtype as the schemas spell it (schema.dtype_name of the torch
# dtype torch_dtypes() reads it as): the index's dtype column, without torch.
SCHEMA_DTYPES = {
    "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I16": "int16",
    "F16": "float16", "BF16": "bfloat16", "I32": "int32", "F32": "float32", "I64": "int64", "F64": "float64",
}  # fmt: skip


@functools.cache
def torch_dtypes() -> dict[str, "torch.dtype"]:
    """Safetensors dtype code -> the torch dtype it is read as."""
    import torch

    return {
        "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "I16": torch.int16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32,
        "I64": torch.int64, "F64": torch.float64,
    }  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its file's header describes it."""

    name: str
    file: Path
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # data_offsets, relative to the end of the header
    data_start: int = 0  # file offset where the data section begins (8 + header length)


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Parse and sanity-check a safetensors header; every failure names the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise MoetraceError(f"{path}: truncated safetensors file ({size} bytes, no 8-byte header length)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise MoetraceError(
                    f"{path}: truncated or not a safetensors file (header length {n} bytes, file has {size} bytes)"
                )
            raw = f.read(n)
    except OSError as err:
        raise MoetraceError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MoetraceError(f"{path}: garbled safetensors header JSON ({err})") from None
    if not isinstance(header, dict):
        raise MoetraceError(f"{path}: garbled safetensors header (not a JSON object)")
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = (
                dtype in DTYPE_BYTES
                and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(a, int)
                and isinstance(b, int)
                and 0 <= a <= b <= data_size
                and b - a == math.prod(shape) * DTYPE_BYTES[dtype]
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise MoetraceError(f"{path}: garbled or truncated safetensors header entry for tensor {name}: {entry!r}")
        out[name] = TensorInfo(name, path, dtype, shape, (a, b), 8 + n)
    return out


def host_copy(src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
    """Copy a CPU tensor (any strides) with numpy on its bytes: torch's CPU copy of
    strided uint8/fp8 runs at 1-3 GB/s here, numpy's at 30 (docs/benchmarks.md)."""
    import torch

    if dst is None:
        dst = torch.empty(src.shape, dtype=src.dtype)
    if src.dtype != dst.dtype:  # a cast (bf16 scales held as fp32): small tensors, torch does it
        dst.copy_(src)
    elif src.numel():
        np.copyto(_byte_view(dst), _byte_view(src))
    return dst


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """A numpy uint8 view of t's elements with one extra last axis of itemsize bytes."""
    import torch

    u8 = t.view(torch.uint8) if t.element_size() == 1 else t.unsqueeze(-1).view(torch.uint8)
    return u8.numpy()
