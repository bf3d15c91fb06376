"""An index is checked on every read; a corrupt one is exit 2
naming it, never "unknown" divergences (nor a guard that kills a clean server)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.cli import cli, one_line_error
from support.traces import write_scenario

from moetrace.checkpoints.index import INDEX_META_KEY, read_index, write_index
from moetrace.errors import MoetraceError


@pytest.fixture
def run(small_model, tmp_path):
    write_scenario(small_model, str(tmp_path), "r", [0], None)
    return tmp_path / "r"


def _tampered(index: str, out, rows=None, **meta) -> str:
    """The index with its table changed by rows(table) and metadata keys replaced, written
    as moetrace writes indexes (read raw: the reader under test would refuse it)."""
    t = pq.read_table(index)
    m = json.loads(t.schema.metadata[INDEX_META_KEY])
    m.update(meta)
    t = rows(t) if rows is not None else t
    write_index(t.replace_schema_metadata({INDEX_META_KEY: json.dumps(m).encode()}), out)
    return str(out)


def _set(t: pa.Table, name: str, values) -> pa.Table:
    i = t.column_names.index(name)
    return t.set_column(i, t.schema.field(i), pa.array(values, t.schema.field(i).type))


def _flip_digest_bit(t):
    d = t.column("digest").to_pylist()
    d[5] = bytes([d[5][0] ^ 1]) + d[5][1:]
    return _set(t, "digest", d)


def _xor_chunks(t):  # 400 bytes of chunk digests XOR-ed, the digests left as they were
    c = t.column("chunk_digests").to_pylist()
    c = [bytes(b ^ 0x5A for b in x[:4]) + x[4:] if i < 100 else x for i, x in enumerate(c)]
    return _set(t, "chunk_digests", c)


def test_clean_index_reads(small_index, run):
    assert read_index(small_index).num_rows > 0
    r = cli("audit", run, "--index", small_index)
    assert r.exit_code == 0, r.output  # the negative control of every refusal below


@pytest.mark.parametrize("rows,meta,words", [
    (_flip_digest_bit, {}, "digest does not follow from its chunk digests"),
    (_xor_chunks, {}, "digest does not follow from its chunk digests"),
    (lambda t: _set(t, "schema_version", [2] * (t.num_rows - 1) + [3]), {}, "schema_version"),
    (lambda t: _set(t, "checkpoint_id", ["x"] + t.column("checkpoint_id").to_pylist()[1:]), {}, "checkpoint_id"),
    (lambda t: _set(t, "nbytes", [t.column("nbytes")[0].as_py() + 1] + t.column("nbytes").to_pylist()[1:]), {},
     "has nbytes"),
    (lambda t: _set(t, "expert", [-1] + t.column("expert").to_pylist()[1:]), {}, "expert -1"),
    (lambda t: t.filter(pa.compute.not_equal(t.column("layer"), 1)), {}, "no rows of layer(s) 1"),
    (lambda t: t.filter(pa.compute.not_equal(t.column("expert"), 3)), {}, "of 3 experts"),
    (None, {"tp_size": "2"}, "metadata tp_size is '2'"),
    (None, {"layers": "0-1"}, "metadata layers"),
])
def test_corrupt_index_is_exit_2_naming_it(small_index, run, tmp_path, rows, meta, words):
    bad = _tampered(small_index, tmp_path / "bad.parquet", rows, **meta)
    with pytest.raises(MoetraceError, match="corrupt"):
        read_index(bad)
    for cmd in ("audit", "analyze"):
        line = one_line_error(cli(cmd, run, "--index", bad), str(bad), "corrupt", words)
        assert "bug" not in line


def test_metadata_not_an_object(small_index, run, tmp_path):
    t = pq.read_table(small_index)
    bad = tmp_path / "list.parquet"
    write_index(t.replace_schema_metadata({INDEX_META_KEY: json.dumps([1, 2]).encode()}), bad)
    line = one_line_error(cli("audit", run, "--index", bad), str(bad), "metadata is a JSON list")
    assert "bug" not in line
    line = one_line_error(cli("hook-spec", "--out", tmp_path / "t", "--index", bad), "metadata is a JSON list")
    assert "bug" not in line
