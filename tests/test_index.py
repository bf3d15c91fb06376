"""moetrace index: rows, fingerprints against independent shards, cache, CLI, errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from moetrace.checkpoints import index as ix
from moetrace.checkpoints import index_build as ixb
from moetrace.checkpoints.synthetic import synthetic_values
from moetrace.cli import main
from moetrace.errors import MoetraceError
from moetrace.fingerprint import fingerprint
from moetrace.schema import INDEX_SCHEMA

H, I, E = 256, 256, 8


def _w13_reference(layer, expert, tp_rank, tp, ep, dtype_weight=torch.float8_e4m3fn):
    """Rank's w13 from synthetic_values at the global rows SGLang's loader puts there."""
    moe_tp = tp // ep
    r = tp_rank % moe_tp
    i_tp = I // moe_tp
    rows = torch.arange(r * i_tp, (r + 1) * i_tp).unsqueeze(1)
    cols = torch.arange(H).unsqueeze(0)
    gate = synthetic_values(layer, expert, 0, rows, cols, "weight", dtype_weight)
    up = synthetic_values(layer, expert, 1, rows, cols, "weight", dtype_weight)
    return torch.cat([gate, up], dim=0)


def _w2_scale_reference(layer, expert, tp_rank, tp, ep, scale_dtype=torch.bfloat16):
    moe_tp = tp // ep
    r = tp_rank % moe_tp
    nb = (I // moe_tp) // 128
    rows = torch.arange(H // 128).unsqueeze(1)
    cols = torch.arange(r * nb, (r + 1) * nb).unsqueeze(0)
    return synthetic_values(layer, expert, 2, rows, cols, "scale", scale_dtype).to(torch.float32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint

    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ix") / "c", num_layers=3, num_experts=E, hidden=H,
                                      intermediate=I, dense_layers=1)


@pytest.mark.parametrize("tp,ep,moe_dp", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 1, 2)])
def test_index_rows_equal_independent_shards(ckpt, tp, ep, moe_dp):
    """One row per (moe_tp_rank, layer, expert, tensor) for EVERY expert: with EPLB any
    rank may hold any expert; the shard depends on moe_tp_rank = tp_rank % (tp/ep/moe_dp)."""
    table = ixb.build_index(ckpt, tp, ep, moe_dp_size=moe_dp)
    assert table.schema.equals(INDEX_SCHEMA, check_metadata=False)
    rows = table.to_pylist()
    moe_layers = [1, 2]  # dense_layers=1 makes layer 0 dense
    moe_tp = tp // ep // moe_dp
    assert sorted({r["layer"] for r in rows}) == moe_layers and {r["model"] for r in rows} == {"target"}
    assert len(rows) == len(moe_layers) * moe_tp * E * 4
    by_key = {(r["moe_tp_rank"], r["layer"], r["expert"], r["tensor"]): r for r in rows}
    for tp_rank in range(tp):
        r = tp_rank % moe_tp
        for expert in range(E):
            w13 = by_key[(r, 2, expert, "w13_weight")]
            want = _w13_reference(2, expert, r, moe_tp, 1)
            assert w13["digest"] == fingerprint(want).digest
            assert w13["shape"] == list(want.shape) and w13["dtype"] == "float8_e4m3fn"
            s = by_key[(r, 1, expert, "w2_weight_scale_inv")]
            want_s = _w2_scale_reference(1, expert, r, moe_tp, 1)
            assert s["digest"] == fingerprint(want_s).digest and s["dtype"] == "float32"
            assert s["chunk_digests"] == fingerprint(want_s).chunk_digests
    # a stale expert's bytes are another row's digest: the analysis relies on it
    assert by_key[(0, 1, 0, "w2_weight_scale_inv")]["digest"] != by_key[(0, 1, 2, "w2_weight_scale_inv")]["digest"]
    assert json.loads(table.schema.metadata[ix.INDEX_META_KEY])["moe_tp_size"] == moe_tp


@pytest.mark.parametrize("tp,block_bytes", [(2, 1), (2, 600_000)])
def test_blocks_of_experts_give_every_rank_its_own_cut(ckpt, monkeypatch, tp, block_bytes):
    """Work units are blocks of experts over every moe_tp_rank, and a column cut (w2 and its
    scale) reads its rows once for all ranks: each rank still gets its own columns, in
    blocks of one expert and of several with a shorter last one (buffers refilled)."""
    from moetrace.checkpoints import index_tensors
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.shards import Parallel

    monkeypatch.setattr(index_tensors, "_BLOCK_BYTES", block_bytes)
    blocks = index_tensors._blocks_of(open_checkpoint(ckpt), Parallel(tp_size=tp), 1)
    assert len(blocks) > 1 and (block_bytes == 1 or len(blocks[-1]) < len(blocks[0]))
    rows = {(r["moe_tp_rank"], r["layer"], r["expert"], r["tensor"]): r
            for r in ixb.build_index(ckpt, tp, cutter="torch").to_pylist()}
    i_tp = I // tp
    for r in range(tp):
        cols = torch.arange(r * i_tp, (r + 1) * i_tp).unsqueeze(0)
        for expert in range(E):
            down = synthetic_values(1, expert, 2, torch.arange(H).unsqueeze(1), cols, "weight", torch.float8_e4m3fn)
            assert rows[(r, 1, expert, "w2_weight")]["digest"] == fingerprint(down).digest
            assert rows[(r, 1, expert, "w2_weight_scale_inv")]["digest"] == fingerprint(
                _w2_scale_reference(1, expert, r, tp, 1)).digest
            assert rows[(r, 2, expert, "w13_weight")]["digest"] == fingerprint(_w13_reference(2, expert, r, tp, 1)).digest


def test_layers_option_and_metadata(ckpt, tmp_path):
    table = ixb.build_index(ckpt, 2, layers=[2])
    assert set(table.column("layer").to_pylist()) == {2}
    path = ix.write_index(table, tmp_path / "i.parquet")
    meta = ix.index_metadata(path)
    assert meta["tp_size"] == 2 and meta["layers"] == [2] and meta["schema_version"] == 3
    assert ix.read_index(path).num_rows == table.num_rows
    with pytest.raises(MoetraceError, match="--layers 0: not MoE layers"):
        ixb.build_index(ckpt, 2, layers=[0])


def test_cache_reuses_and_notices_changes(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    p1, reused1 = ixb.cached_index(ckpt, 2)
    p2, reused2 = ixb.cached_index(ckpt, 2)
    assert (reused1, reused2) == (False, True) and p1 == p2
    p3, reused3 = ixb.cached_index(ckpt, 2, layers=[1])
    assert not reused3 and p3 != p1
    # touching a shard file invalidates the entry
    f = sorted(Path(ckpt).glob("*.safetensors"))[0]
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    _, reused4 = ixb.cached_index(ckpt, 2)
    assert not reused4


def test_cli_index_json_and_cache(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "index.parquet"
    r = CliRunner().invoke(main, ["index", str(ckpt), "--tp", "2", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["rows"] == 2 * 2 * E * 4 and not summary["reused_cache"]
    assert pq.read_table(out).num_rows == summary["rows"]
    r2 = CliRunner().invoke(main, ["index", str(ckpt), "--tp", "2", "-o", str(out), "--json"])
    assert json.loads(r2.output)["reused_cache"] is True
    r3 = CliRunner().invoke(main, ["index", str(ckpt), "--tp", "2", "-o", str(out)])
    assert r3.exit_code == 0 and "reused cached index" in r3.output
    # readable by others under the usual umask: the server may run as another user
    mask = os.umask(0o022)
    try:
        r4 = CliRunner().invoke(main, ["index", str(ckpt), "--tp", "2", "-o", str(tmp_path / "i2.parquet"), "--no-cache"])
        assert r4.exit_code == 0
        assert (tmp_path / "i2.parquet").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(mask)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--tp", "3"], "tp"),
        (["--tp", "2", "--ep", "3"], "ep"),
        (["--tp", "8"], "128"),
        (["--tp", "2", "--layers", "0"], "--layers 0"),
        (["--tp", "2", "--layers", "x"], "--layers"),
        (["--tp", "2", "--layers", "3-1"], "range end is below its start"),  # was a silent 0-row index
        (["--tp", "2", "--layers", "0-1000000000"], "ids must be below"),  # checked, never expanded
    ],
)
def test_cli_index_bad_options_are_one_line(ckpt, tmp_path, args, needle):
    out = tmp_path / "index.parquet"
    r = CliRunner().invoke(main, ["index", str(ckpt), *args, "-o", str(out), "--no-cache"])
    assert r.exit_code == 2
    err = r.output.strip()
    assert err.startswith("moetrace: error:") and "\n" not in err and needle in err, err
    assert "Traceback" not in r.output and not out.exists()
    assert not list(tmp_path.glob(".index.parquet.*"))


def test_bad_checkpoint_leaves_no_partial_index(tmp_path, ckpt_copy):
    bad = ckpt_copy()
    victim = sorted(Path(bad).glob("*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # truncated data section
    out = tmp_path / "index.parquet"
    r = CliRunner().invoke(main, ["index", str(bad), "--tp", "2", "-o", str(out), "--no-cache"])
    assert r.exit_code == 2 and victim.name in r.output and "Traceback" not in r.output
    assert not out.exists() and not list(tmp_path.glob(".index.parquet.*"))


def test_not_an_index(tmp_path):
    p = tmp_path / "x.parquet"
    p.write_bytes(b"garbage")
    with pytest.raises(MoetraceError, match="x.parquet"):
        ix.read_index(p)


def test_index_of_another_version_says_what_it_found_and_how_to_rebuild(ckpt, tmp_path):
    import json

    table = ixb.build_index(ckpt, 2, layers=[2])
    for changes, words in (({"schema_version": 1}, "index schema version 1, this moetrace reads version 3"),
                           ({"fp_version": 0}, "fingerprint version 0"),
                           # an index of fp_version 2, as it was written: refused by its digests' version
                           ({"fp_version": 2, "schema_version": 2}, "fingerprint version 2, this moetrace computes version 3")):
        key = "-".join(f"{k}{v}" for k, v in changes.items())
        meta = json.loads(table.schema.metadata[ix.INDEX_META_KEY])
        meta.update(changes)
        old = ix.write_index(table.replace_schema_metadata({ix.INDEX_META_KEY: json.dumps(meta).encode()}),
                             tmp_path / f"{key}.parquet")
        for read in (ix.read_index, ix.index_metadata):
            with pytest.raises(MoetraceError) as ei:
                read(old)
            assert words in str(ei.value) and "rebuild it with `moetrace index`" in str(ei.value)


def test_deepseek_shared_expert_rows_equal_independent_shards(make_ckpt):
    """DeepSeek's mlp.shared_experts is indexed as expert num_experts, the id SGLang's loader
    fuses it as (Qwen's mlp.shared_expert and the MTP draft: test_slots.py)."""
    family = "deepseek_v3"
    ckpt = make_ckpt(family=family, num_layers=1, num_experts=E, hidden=H, intermediate=I, shared_expert=True)
    table = ixb.build_index(ckpt, 2)
    rows = {(r["model"], r["moe_tp_rank"], r["layer"], r["expert"], r["tensor"]): r for r in table.to_pylist()}
    for r in (0, 1):
        shared = rows[("target", r, 0, E, "w13_weight")]
        assert shared["digest"] == fingerprint(_w13_reference(0, E, r, 2, 1)).digest
        assert rows[("target", r, 0, E, "w2_weight_scale_inv")]["digest"] == fingerprint(
            _w2_scale_reference(0, E, r, 2, 1)).digest
    meta = json.loads(table.schema.metadata[ix.INDEX_META_KEY])
    assert meta["shared_experts"] == 1 and meta["num_experts"] == E
    assert not {k for k in rows if k[0] == "draft"} and "no draft model" in meta["draft"]["excluded"]


def test_stand_in_shared_expert_and_mtp_are_left_out_with_the_reason(ckpt):
    """The default synthetic checkpoint's shared expert and mtp.* are small stand-ins: no rows, said why."""
    meta = json.loads(ixb.build_index(ckpt, 1).schema.metadata[ix.INDEX_META_KEY])
    assert meta["shared_experts"] == 0
    assert meta["draft"]["excluded"].startswith("draft model (mtp.*)")


def test_device_paths_give_the_cpu_index(ckpt, monkeypatch):
    """--device auto is the CPU here; the path a GPU without Triton takes (plain torch) gives
    the same rows as xxhash, and --device cuda without CUDA is refused in one line."""
    assert ixb.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    want = ixb.build_index(ckpt, 2, layers=[1])
    monkeypatch.setenv("MOETRACE_FP_METHOD", "torch")
    assert ixb.build_index(ckpt, 2, layers=[1], cutter="torch").equals(want)
    if not torch.cuda.is_available():
        with pytest.raises(MoetraceError, match="--device cuda: CUDA is not available"):
            ixb.build_index(ckpt, 2, layers=[1], device="cuda")


def test_cache_hit_is_proved_on_data_not_on_names_sizes_and_mtimes(ckpt, tmp_path, monkeypatch):
    """A checkpoint with ckpt's shapes, file names, sizes and mtimes but
    other values shares its cache key; its index must be its own, never ckpt's."""
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint

    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    other = write_synthetic_checkpoint(tmp_path / "b", num_layers=3, num_experts=E, hidden=H, intermediate=I,
                                       dense_layers=1, seed=7)
    shutil.copyfile(Path(ckpt) / "config.json", Path(other) / "config.json")  # the synthetic config names its seed
    for fa in sorted(Path(ckpt).iterdir()):
        st = fa.stat()
        assert (Path(other) / fa.name).stat().st_size == st.st_size
        os.utime(Path(other) / fa.name, ns=(st.st_atime_ns, st.st_mtime_ns))
    opts = ixb.IndexOptions(2, layers=(1, 2))
    assert ixb.cache_key(ckpt, opts) == ixb.cache_key(other, opts)  # the collision the data check answers
    pa_path, _ = ixb.cached_index(ckpt, 2)
    pb_path, reused = ixb.cached_index(other, 2)
    assert not reused and pb_path == pa_path
    fresh = ixb.build_index(other, 2).column("digest").to_pylist()
    assert pq.read_table(pb_path).column("digest").to_pylist() == fresh
    assert fresh != ixb.build_index(ckpt, 2).column("digest").to_pylist()  # negative control: the data differ
    assert ixb.cached_index(other, 2)[1]  # its own entry is then a hit


def test_cache_hit_sample_catches_one_changed_chunk(ckpt, tmp_path, monkeypatch):
    """verify_hit compares sampled chunk digests: a cached index with one chunk digest of
    every row changed (digests rehashed to stay consistent) is not the checkpoint's."""
    import random

    import pyarrow as pa

    from moetrace import fingerprint as fpdef
    from moetrace.checkpoints import index_cache
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.shards import Parallel

    path = tmp_path / "i.parquet"
    t = ixb.build_index(ckpt, 2)
    ix.write_index(t, path)
    par = Parallel(2)
    assert index_cache.verify_hit(path, open_checkpoint(ckpt), par) is None
    chunks = [bytes([c[0] ^ 1]) + c[1:] for c in t.column("chunk_digests").to_pylist()]
    digests = [fpdef.tensor_digest(c, n) for c, n in zip(chunks, t.column("nbytes").to_pylist())]
    bad = t.set_column(t.column_names.index("chunk_digests"), "chunk_digests", pa.array(chunks, pa.binary()))
    bad = bad.set_column(bad.column_names.index("digest"), "digest", pa.array(digests, pa.binary(16)))
    ix.write_index(bad.replace_schema_metadata(t.schema.metadata), path)
    why = index_cache.verify_hit(path, open_checkpoint(ckpt), par, random.Random(1))
    assert why is not None and "are not the cached index's" in why
