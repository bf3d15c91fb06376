"""Arrow columns to and from numpy through their buffers.

pyarrow imports pandas (where it is installed) the first time it converts Python or numpy
values (``pa.array``, ``Array.to_numpy``, ``Table.group_by``): 0.2-0.3 s of a command that
needs none of it. The index's writer, its checks and the cache's proof build and read
their columns here instead (tests/test_light_imports.py holds ``moetrace index`` to that).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def _int_dtype(type: pa.DataType) -> np.dtype:
    if not pa.types.is_integer(type):
        raise TypeError(f"{type} is not an integer type")
    return np.dtype(str(type))  # int8 ... uint64: the same names


def values(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An integer column without nulls as numpy (a view of its buffer when in one chunk)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count:
        raise ValueError("a column with nulls has no plain numpy view")
    dtype = _int_dtype(arr.type)
    buf = arr.buffers()[1]
    return np.frombuffer(buf, dtype=dtype)[arr.offset:arr.offset + len(arr)] if buf is not None else \
        np.empty(0, dtype=dtype)


def offsets(arr: pa.Array) -> np.ndarray:
    """A list, binary or string array's len + 1 offsets (int64), from its first value."""
    width = np.int64 if pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type) or \
        pa.types.is_large_list(arr.type) else np.int32
    return np.frombuffer(arr.buffers()[1], dtype=width)[arr.offset:arr.offset + len(arr) + 1].astype(np.int64)


def valid(arr: pa.Array) -> np.ndarray:
    """bool per row: not null."""
    bitmap = arr.buffers()[0]
    if bitmap is None or not arr.null_count:
        return np.ones(len(arr), dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[arr.offset:arr.offset + len(arr)].astype(bool)


def numbers(data, type: pa.DataType) -> pa.Array:
    """A column of `type` (an integer type) from a sequence or numpy array, no nulls."""
    data = np.ascontiguousarray(data, dtype=_int_dtype(type))
    return pa.Array.from_buffers(type, len(data), [None, pa.py_buffer(data)])


def binaries(items: list[bytes], type: pa.DataType = pa.binary()) -> pa.Array:
    """binary, binary(n) or string (items as utf-8 bytes) from Python bytes, no nulls."""
    data = pa.py_buffer(b"".join(items))
    if isinstance(type, pa.FixedSizeBinaryType):
        if any(len(x) != type.byte_width for x in items):
            raise ValueError(f"every item of a {type} column holds {type.byte_width} bytes")
        return pa.Array.from_buffers(type, len(items), [None, data])
    ends = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in items], out=ends[1:])
    width = np.int64 if pa.types.is_large_binary(type) or pa.types.is_large_string(type) else np.int32
    return pa.Array.from_buffers(type, len(items), [None, pa.py_buffer(ends.astype(width)), data])


def strings(items: list[str]) -> pa.Array:
    return binaries([s.encode() for s in items], pa.string())


def int_lists(items: list, type: pa.ListType) -> pa.Array:
    """list<int> from Python sequences of ints, no nulls."""
    ends = np.zeros(len(items) + 1, dtype=np.int32)
    np.cumsum([len(x) for x in items], out=ends[1:])
    flat = numbers([v for x in items for v in x], type.value_type)
    return pa.Array.from_buffers(type, len(items), [None, pa.py_buffer(ends)], children=[flat])


def take(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """The table's rows at these positions, in this order."""
    return table.take(numbers(rows, pa.int64()))
