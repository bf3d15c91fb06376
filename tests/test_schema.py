"""schema: the one id-range syntax (bounded, never expanded before it is checked) and
the names every module shares."""

from __future__ import annotations

import pytest

from moetrace.errors import MoetraceError
from moetrace.schema import COPY_ORDERS, MAX_ID, TENSOR_NAMES, copy_position, format_ids, parse_ids


def test_parse_ids_forms():
    assert parse_ids("0,2,5-7", "--layers") == {0, 2, 5, 6, 7}
    assert parse_ids([1, "3-4"], "experts") == {1, 3, 4}
    assert parse_ids(3, "layers") == {3}
    assert parse_ids(" 4 - 5 ", "layers") == {4, 5}
    for everything in (None, "all", "ALL", "", " "):
        assert parse_ids(everything, "x") is None


@pytest.mark.parametrize("bad, words", [
    ("a", "'a' is not an id"), ("5-3", "range end is below its start (write 3-5)"), ([-1], "ids must be >= 0"),
    ("-1", "not an id"), ([True], "not an id"), ({"a": 1}, "not a list of ids"), (1.5, "not a list of ids"),
])
def test_parse_ids_refuses(bad, words):
    with pytest.raises(MoetraceError) as ei:
        parse_ids(bad, "--layers")
    assert str(ei.value).startswith("--layers: ") and words in str(ei.value)


def test_bounds_are_checked_before_a_range_is_expanded():
    # a range this large would take minutes and tens of GB if it were expanded first
    with pytest.raises(MoetraceError, match="ids must be below 48 \\(the model's size\\)"):
        parse_ids("0-1000000000000", "--layers", bound=48)
    with pytest.raises(MoetraceError, match=f"ids must be below {MAX_ID}"):
        parse_ids("0-99999999999", "experts")
    assert parse_ids("40-47", "--layers", bound=48) == set(range(40, 48))
    with pytest.raises(MoetraceError, match="below 48"):
        parse_ids([48], "--layers", bound=48)


def test_format_ids_round_trips():
    for ids in ([0, 1, 2, 5], [7], list(range(256)), [0, 2, 4], [3, 1, 2, 2]):
        text = format_ids(ids)
        assert parse_ids(text, "x") == set(ids)
    assert format_ids([0, 1, 2, 5, 9, 10]) == "0-2,5,9-10" and format_ids([]) == "none"


def test_copy_orders_and_tensor_names():
    assert TENSOR_NAMES == tuple(dict.fromkeys(n for o in COPY_ORDERS.values() for n in o))
    for fmt in ("fp8_block", "fp8_channel"):
        assert [copy_position(t) for t in COPY_ORDERS[fmt]] == [0, 1, 2, 3]
    assert [copy_position(t) for t in COPY_ORDERS["bf16"]] == [0, 2]  # same numbers as FP8, so they compare
    with pytest.raises(KeyError):
        copy_position("w1_weight")
