"""checkpoints.arrow_columns: the columns pyarrow itself would make and read, through
buffers (no pandas, no pyarrow.compute under 50k rows), sliced arrays included."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from moetrace.checkpoints import arrow_columns as ac


def test_built_columns_equal_pyarrows():
    items = [b"", b"ab", b"\x00" * 16, b"xyz"]
    assert ac.binaries(items).equals(pa.array(items, pa.binary()))
    assert ac.binaries([b"0123456789abcdef"] * 2, pa.binary(16)).equals(pa.array([b"0123456789abcdef"] * 2,
                                                                                   pa.binary(16)))
    assert ac.strings(["target", "", "draft"]).equals(pa.array(["target", "", "draft"], pa.string()))
    lists = [[512, 256], [], [4]]
    assert ac.int_lists(lists, pa.list_(pa.int64())).equals(pa.array(lists, pa.list_(pa.int64())))
    assert ac.numbers([3, -1, 7], pa.int16()).equals(pa.array([3, -1, 7], pa.int16()))
    with pytest.raises(ValueError):
        ac.binaries([b"short"], pa.binary(16))


@pytest.mark.parametrize("python", [True, False])
def test_read_columns_of_sliced_arrays(monkeypatch, python):
    monkeypatch.setattr(ac, "_PYTHON_ROWS", 10**9 if python else -1)
    names = pa.array(["w2", "w13", "w2", "s", "w13", "w2"]).slice(1, 4)
    codes, values = ac.codes(names)
    assert [values[c] for c in codes] == names.to_pylist() and len(set(values)) == len(values)
    ints = pa.array([5, 6, 7, 8], pa.int32()).slice(1, 2)
    assert ac.values(ints).tolist() == [6, 7] and ac.codes(ints)[0].tolist() == [6, 7]
    shape = pa.array([[1, 2], [3], [], [4, 5, 6]], pa.list_(pa.int64())).slice(1, 3)
    flat, ends = ac.list_values(shape)
    assert flat.tolist() == pc.list_flatten(shape).to_pylist() and ends.tolist() == [0, 1, 1, 4]
    with_null = pa.array([b"a", None, b"bc"])
    assert ac.valid(with_null).tolist() == [True, False, True]
    with pytest.raises(ValueError):
        ac.values(pa.array([1, None]))


def test_take_keeps_the_rows_in_runs():
    table = pa.table({"a": list(range(10)), "b": [str(i) for i in range(10)]})
    rows = np.array([0, 1, 2, 5, 7, 8])
    assert ac.take(table, rows).equals(table.take(pa.array(rows)))
    assert ac.take(table, np.array([], dtype=np.int64)).num_rows == 0
