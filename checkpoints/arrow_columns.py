"""Arrow columns to and from numpy through their buffers.

pyarrow imports pandas (where it is installed) the first time it converts Python or numpy
values (``pa.array``, ``Array.to_numpy``, ``Table.group_by``), and pyarrow.compute on the
first compute method (``unique``, ``take``, ``dictionary_encode``): 0.1-0.3 s each of a
command that needs neither. The index's writer, its checks and the cache's proof build
and read their columns here instead (tests/test_light_imports.py holds ``moetrace index``
to that).
"""

from __future__ import annotations

import sys

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


# Up to this many rows a Python loop codes a string column in less time (~0.5 us a row) than
# importing pyarrow.compute takes (40-90 ms); a whole model's index (~100k rows) imports it.
_PYTHON_ROWS = 50_000


def codes(arr: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, list]:
    """A column without nulls as int64 codes and the values they stand for (in order of
    first appearance); an integer column is its own codes (and no values)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_integer(arr.type):
        return values(arr).astype(np.int64), []
    if len(arr) > _PYTHON_ROWS or "pyarrow.compute" in sys.modules:  # its import is paid for, or is worth it
        enc = arr.dictionary_encode()
        return values(enc.indices).astype(np.int64), enc.dictionary.to_pylist()
    found: dict = {}
    out = np.fromiter((found.setdefault(v, len(found)) for v in arr.to_pylist()), dtype=np.int64, count=len(arr))
    return out, list(found)


def list_values(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A list<int> column's flattened values and its len + 1 offsets into them (from 0)."""
    ends = offsets(arr)
    flat = values(arr.values)[ends[0]:ends[-1]] if len(arr.values) else np.empty(0, dtype=np.int64)
    return flat, ends - ends[0]


def take(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """The table's rows at these increasing positions: slices of its runs, concatenated."""
    if not len(rows):
        return table.slice(0, 0)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts, stops = rows[np.r_[0, breaks]], rows[np.r_[breaks - 1, len(rows) - 1]] + 1
    return pa.concat_tables([table.slice(int(a), int(b - a)) for a, b in zip(starts, stops)])
