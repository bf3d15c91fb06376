"""The CPU index path (checkpoints.shard_plan, shard_hash, index_cpu): the same rows as the
tensors checkpoints.shards cuts (the path every index was built by before, itself held to
SGLang's loader in test_loader_oracle.py), for every family, format, scale dtype, TP/EP
split and layout; in worker processes and with pread instead of a mapping too."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from moetrace import fingerprint as fpdef
from moetrace.checkpoints import index_build as ixb
from moetrace.checkpoints import index_cpu, shard_hash, shard_plan
from moetrace.checkpoints.layout import ServerLayout
from moetrace.checkpoints.reader import draft_checkpoint, open_checkpoint
from moetrace.checkpoints.safetensors_file import SCHEMA_DTYPES, torch_dtypes
from moetrace.checkpoints.shards import Parallel, expected_experts
from moetrace.errors import MoetraceError
from moetrace.schema import dtype_name

H, E = 256, 4

# (id, writer kwargs): every format and scale dtype the plans cover, each family's names
CHECKPOINTS = [
    ("qwen3_5_fp8_block_bf16_draft", dict(family="qwen3_5_moe", fmt="fp8_block", scale_dtype="bfloat16", draft=True,
                                          shared_expert=True)),
    ("qwen3_moe_fp8_block_f32_h320", dict(family="qwen3_moe", fmt="fp8_block", scale_dtype="float32", hidden=320)),
    ("qwen3_next_fp8_block_f16_512", dict(family="qwen3_next", fmt="fp8_block", scale_dtype="float16",
                                          intermediate=512, num_files=3)),
    ("deepseek_fp8_block_shared", dict(family="deepseek_v3", fmt="fp8_block", scale_dtype="float32",
                                       shared_expert=True, block=(128, 64))),
    ("qwen3_moe_fp8_channel_f32", dict(family="qwen3_moe", fmt="fp8_channel", scale_dtype="float32")),
    ("qwen3_next_fp8_channel_bf16", dict(family="qwen3_next", fmt="fp8_channel", scale_dtype="bfloat16",
                                         num_files=1)),
    ("qwen3_moe_fp8_tensor", dict(family="qwen3_moe", fmt="fp8_tensor", scale_dtype="float32")),
    ("deepseek_bf16", dict(family="deepseek_v3", fmt="bf16", scale_dtype="bfloat16")),
    ("qwen3_5_bf16_fused", dict(family="qwen3_5_moe", fmt="bf16", scale_dtype="bfloat16", fused=True,
                                shared_expert=True)),
]
SPLITS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1), (4, 1, 2)]


def _write(make_ckpt, kw: dict) -> Path:
    kw = {"num_layers": 2, "num_experts": E, "hidden": H, "intermediate": 512, "dense_layers": 1, **kw}
    return make_ckpt(**kw)


def _fused_fp8(src: Path, dst: Path, family: str) -> Path:
    """A per-expert FP8 block checkpoint rewritten with fused 3-D experts, as transformers
    writes them (save_original_format=False): gate_up_proj [E, 2I, H], down_proj [E, H, I]
    and their block scales under the name the family's SGLang loader maps."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    suffix = {"qwen3_5_moe": "_scale_inv", "deepseek_v3": "_scale"}[family]
    spec = open_checkpoint(src).spec
    out, done = {}, set()
    for name in tensors:
        found = re.fullmatch(rf"({re.escape(spec.prefix)}\.layers\.(\d+)\.mlp\.experts)\.0\.gate_proj\.weight", name)
        if found is None or int(found.group(2)) not in spec.moe_layers:  # routed experts only, not stand-ins
            continue
        stem = found.group(1)
        n = sum(1 for k in tensors if k.startswith(stem + ".") and k.endswith(".gate_proj.weight"))
        get = lambda e, p, k: tensors[f"{stem}.{e}.{p}_proj.{k}"]  # noqa: E731
        for kind, key in (("", "weight"), (suffix, "weight_scale_inv")):
            out[f"{stem}.gate_up_proj{kind}"] = torch.stack([torch.cat([get(e, "gate", key), get(e, "up", key)])
                                                             for e in range(n)])
            out[f"{stem}.down_proj{kind}"] = torch.stack([get(e, "down", key) for e in range(n)])
        done |= {k for k in tensors if k.startswith(stem + ".") and k.split(stem + ".")[1].split(".")[0].isdigit()}
    out.update({k: v for k, v in tensors.items() if k not in done})
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.fixture(scope="module")
def fused_fp8(make_ckpt, tmp_path_factory):
    made = {}
    for family in ("qwen3_5_moe", "deepseek_v3"):
        src = _write(make_ckpt, dict(family=family, fmt="fp8_block", scale_dtype="bfloat16" if family != "deepseek_v3"
                                     else "float32", num_files=1))
        made[family] = _fused_fp8(src, tmp_path_factory.mktemp("fused") / family, family)
        assert open_checkpoint(made[family]).spec.fused_experts
    return made


def _both(ckpt: Path, tp: int, ep: int = 1, moe_dp: int = 1, layout: ServerLayout = ServerLayout()):
    stats = ixb.IndexStats()
    planned = ixb.build_index(ckpt, tp, ep, moe_dp_size=moe_dp, layout=layout, stats=stats)
    assert "workers" in stats.extra, "the CPU path did not build this index"
    return planned, ixb.build_index(ckpt, tp, ep, moe_dp_size=moe_dp, layout=layout, cutter="torch")


@pytest.mark.parametrize("case", [c[0] for c in CHECKPOINTS])
@pytest.mark.parametrize("tp,ep,moe_dp", SPLITS)
def test_rows_equal_the_tensor_path(make_ckpt, case, tp, ep, moe_dp):
    """Every row (digests, chunk digests, dtype, shape, nbytes) and the metadata: equal."""
    ckpt = _write(make_ckpt, dict(CHECKPOINTS)[case])
    planned, cut = _both(ckpt, tp, ep, moe_dp)
    assert planned.num_rows == cut.num_rows > 0
    assert planned.equals(cut, check_metadata=True)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "deepseek_v3"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_fp8_rows_equal_the_tensor_path(fused_fp8, family, tp):
    planned, cut = _both(fused_fp8[family], tp)
    assert planned.equals(cut, check_metadata=True)


@pytest.mark.parametrize("up_first,padded", [(True, None), (False, 384), (True, 640)])
@pytest.mark.parametrize("case", ["qwen3_5_fp8_block_bf16_draft", "qwen3_next_fp8_channel_bf16", "qwen3_5_bf16_fused"])
def test_layouts_equal_the_tensor_path(make_ckpt, case, up_first, padded):
    """Up rows first, and the runner's padding of I per rank (zeros after each half, after
    each w2 row, whole blocks of zero scales)."""
    ckpt = _write(make_ckpt, dict(CHECKPOINTS)[case])
    tp = 2
    planned, cut = _both(ckpt, tp, layout=ServerLayout(up_first, padded))
    assert planned.equals(cut, check_metadata=True)


def test_plans_are_the_shards_bytes(make_ckpt):
    """Byte for byte, not only digest for digest: each plan's bytes are the tensor
    checkpoints.shards cuts, over every piece boundary (also read from the middle)."""
    for case in ("qwen3_moe_fp8_block_f32_h320", "qwen3_5_fp8_block_bf16_draft", "qwen3_next_fp8_channel_bf16",
                 "qwen3_moe_fp8_tensor", "qwen3_5_bf16_fused"):
        ckpt = open_checkpoint(_write(make_ckpt, dict(CHECKPOINTS)[case]))
        files = shard_hash.FileBytes()
        for layout in (ServerLayout(), ServerLayout(True, 384)):
            par = Parallel(2, layout=layout)
            for r in range(2):
                experts = range(ckpt.spec.num_experts + ckpt.spec.shared_experts)
                shards = expected_experts(ckpt, 1, r, par, experts)
                for e in experts:
                    plans = shard_plan.plan_expert(ckpt, 1, e, r, par)
                    assert list(plans) == list(shards)
                    for name, plan in plans.items():
                        want = shards[name][e]
                        data = fpdef.raw_bytes(want).numpy().tobytes()
                        assert shard_hash.shard_bytes(plan, files) == data, (case, name, e, r)
                        assert plan.dtype == dtype_name(want.dtype) and plan.shape == tuple(want.shape)
                        assert shard_hash.shard_bytes(plan, files, 7, len(data) - 5) == data[7:len(data) - 5]
        files.close()


def test_worker_processes_small_gathers_and_pread_give_the_same_rows(make_ckpt, monkeypatch):
    """Units in forked workers; a gather buffer smaller than a run (grown) and than a chunk;
    files that cannot be mapped (pread into a reused buffer)."""
    ckpt = _write(make_ckpt, dict(CHECKPOINTS)["qwen3_moe_fp8_block_f32_h320"])
    want = ixb.build_index(ckpt, 2, cutter="torch")
    monkeypatch.setattr(index_cpu, "PROCESS_BYTES", 0)
    monkeypatch.setattr(index_cpu, "UNIT_BYTES", 1)  # one expert per unit: many units
    stats = ixb.IndexStats()
    assert ixb.build_index(ckpt, 2, stats=stats).equals(want)
    assert stats.extra["workers"] == min(2, len(os.sched_getaffinity(0)))
    monkeypatch.setattr(index_cpu, "PROCESS_BYTES", 1 << 40)
    monkeypatch.setattr(index_cpu, "_HASHER", shard_hash.ChunkHasher(gather_bytes=100))
    assert ixb.build_index(ckpt, 2).equals(want)

    def no_mapping(*a, **k):
        raise OSError(19, "No such device")

    monkeypatch.setattr(index_cpu, "_HASHER", None)
    monkeypatch.setattr(shard_hash.mmap, "mmap", no_mapping)
    assert ixb.build_index(ckpt, 2).equals(want)


@pytest.mark.parametrize("case", ["qwen3_moe_fp8_block_f32_h320", "qwen3_5_fp8_block_bf16_draft"])
@pytest.mark.parametrize("tp", [1, 2])
def test_pieces_read_a_block_at_a_time_give_the_same_rows(make_ckpt, monkeypatch, tp, case):
    """Where a mapping does not pay (FileBytes.mapping_pays), contiguous pieces are read
    into a reused block (pread, FileBytes.read_into) and hashed there: blocks smaller than
    a chunk, not a multiple of one, or larger than a piece give the tensor path's rows.
    Only pieces cast to float32 (the BF16 scales) are mapped then: F32 scales and every
    weight are read. Where it pays, the pieces are hashed from the mapping: the same rows."""
    ckpt = _write(make_ckpt, dict(CHECKPOINTS)[case])
    want = ixb.build_index(ckpt, tp, cutter="torch")
    monkeypatch.setattr(shard_hash.FileBytes, "mapping_pays", lambda self, path: True)
    monkeypatch.setattr(index_cpu, "_HASHER", None)
    assert ixb.build_index(ckpt, tp).equals(want)
    monkeypatch.setattr(shard_hash.FileBytes, "mapping_pays", lambda self, path: False)
    mapped = []
    real = shard_hash.FileBytes.region

    def region(self, path, offset, length):
        mapped.append(length)
        return real(self, path, offset, length)

    monkeypatch.setattr(shard_hash.FileBytes, "region", region)
    for read_bytes in (1000, fpdef.CHUNK_BYTES + 7, 3 * fpdef.CHUNK_BYTES, shard_hash.READ_BYTES):
        monkeypatch.setattr(index_cpu, "_HASHER", shard_hash.ChunkHasher(read_bytes=read_bytes))
        assert ixb.build_index(ckpt, tp).equals(want), read_bytes
    if "f32" in case:
        assert mapped == []
    else:
        assert mapped and max(mapped) < 64  # a few scale rows at a time
    monkeypatch.setattr(index_cpu, "_HASHER", None)


def test_a_mapping_pays_where_the_probed_points_map_in_2_mib_entries(tmp_path, monkeypatch):
    """FileBytes.mapping_pays: asked once per file and process; yes where the process's
    FilePmdMapped grew by 2 MiB for at least half the probed points, no where it grew
    less, where the kernel does not say (no /proc) and for a file under 2 MiB."""
    big, small = tmp_path / "big.safetensors", tmp_path / "small.safetensors"
    big.write_bytes(bytes(9 << 20))
    small.write_bytes(bytes(1 << 20))
    monkeypatch.setattr(shard_hash, "_PAYS", {})
    real = shard_hash._pmd_mapped_kib
    for grew, pays in ((2 * 2048, True), (4 * 2048, True), (2048, False), (0, False), (None, False)):
        shard_hash._PAYS.clear()
        answers = iter([0, grew])
        asked = []

        def pmd(answers=answers, asked=asked):
            asked.append(1)
            return None if grew is None else next(answers)

        monkeypatch.setattr(shard_hash, "_pmd_mapped_kib", pmd)
        files = shard_hash.FileBytes()
        assert files.mapping_pays(big) is pays, grew
        assert files.mapping_pays(big) is pays and len(asked) == (1 if grew is None else 2)  # asked once
        assert files.mapping_pays(small) is False
        files.close()
    monkeypatch.setattr(shard_hash, "_pmd_mapped_kib", real)

    def no_mapping(*a, **k):
        raise OSError(19, "No such device")

    with monkeypatch.context() as m:  # a file that cannot be mapped: no, and not read whole to find out
        m.setattr(shard_hash.mmap, "mmap", no_mapping)
        shard_hash._PAYS.clear()
        files = shard_hash.FileBytes()
        assert files.mapping_pays(big) is False and len(files._buffer) == 0
        files.close()
    monkeypatch.setattr(shard_hash, "SMAPS", str(tmp_path / "no such file"))
    shard_hash._PAYS.clear()
    files = shard_hash.FileBytes()
    assert files.mapping_pays(big) is False
    files.close()


def test_a_file_cut_short_while_read_is_one_line(tmp_path):
    """A file that ends before the bytes asked for (cut short after its header was read)."""
    f = tmp_path / "model.safetensors"
    f.write_bytes(bytes(100))
    files = shard_hash.FileBytes()
    assert bytes(files.read_into(f, 40, np.ones(60, dtype=np.uint8))) == bytes(60)
    with pytest.raises(MoetraceError, match=r"model.safetensors: file ends before the tensor's data"):
        files.read_into(f, 50, np.empty(60, dtype=np.uint8))
    with pytest.raises(MoetraceError, match=r"nothing.safetensors: cannot read"):
        files.read_into(tmp_path / "nothing.safetensors", 0, np.empty(1, dtype=np.uint8))
    files.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_column_cuts_read_once_for_every_rank_give_the_same_rows(make_ckpt, monkeypatch, tp):
    """Every rank's column cut of a w2 (and of its block scale) is gathered from one staged
    read of its rows (ChunkHasher.digests_of): the rows equal the tensor path's, with a
    stage of many row groups and one narrower than a row (grown)."""
    ckpt = _write(make_ckpt, dict(CHECKPOINTS)["qwen3_moe_fp8_block_f32_h320"])
    want = ixb.build_index(ckpt, tp, cutter="torch")
    staged = []
    real = shard_hash.ChunkHasher._gather_staged

    def counted(self, pairs, files):
        staged.append(sorted({p.offset for _, p in pairs}))
        return real(self, pairs, files)

    monkeypatch.setattr(shard_hash.ChunkHasher, "_gather_staged", counted)
    for stage_bytes in (shard_hash.STAGE_BYTES, 1000, 16):
        monkeypatch.setattr(index_cpu, "_HASHER", shard_hash.ChunkHasher(gather_bytes=3000, stage_bytes=stage_bytes))
        staged.clear()
        assert ixb.build_index(ckpt, tp).equals(want), stage_bytes
        assert staged and all(len(offsets) == tp for offsets in staged)  # one read served every rank
    monkeypatch.setattr(index_cpu, "_HASHER", None)


def test_a_staged_cut_at_the_wrong_column_is_seen(make_ckpt, monkeypatch):
    """Negative control: staged cuts that all took the first rank's columns differ."""
    ckpt = _write(make_ckpt, dict(CHECKPOINTS)["qwen3_moe_fp8_block_f32_h320"])
    want = ixb.build_index(ckpt, 2, cutter="torch")
    real = shard_hash.ChunkHasher._gather_staged

    def first_ranks_columns(self, pairs, files):
        return real(self, [(s, pairs[0][1]) for s, _ in pairs], files)

    monkeypatch.setattr(shard_hash.ChunkHasher, "_gather_staged", first_ranks_columns)
    monkeypatch.setattr(index_cpu, "_HASHER", None)
    wrong = ixb.build_index(ckpt, 2)
    differs = {(r["moe_tp_rank"], r["tensor"]) for r, w in zip(want.to_pylist(), wrong.to_pylist())
               if r["digest"] != w["digest"]}
    assert differs == {(1, "w2_weight"), (1, "w2_weight_scale_inv")}


def test_a_wrong_cut_is_seen(make_ckpt, monkeypatch):
    """Negative controls: the comparison above tells a shifted column cut and swapped
    halves from the right ones."""
    ckpt = _write(make_ckpt, dict(CHECKPOINTS)["qwen3_moe_fp8_block_f32_h320"])
    planned, cut = _both(ckpt, 2)
    assert planned.equals(cut)
    assert not ixb.build_index(ckpt, 2, layout=ServerLayout(up_first=True)).equals(cut)
    real = shard_plan._Region.cut

    def shifted(self, rows=None, cols=None, **kw):
        if cols is not None and cols[0] > 0:
            cols = (cols[0] - 1, cols[1] - 1)
        return real(self, rows, cols, **kw)

    monkeypatch.setattr(shard_plan._Region, "cut", shifted)
    wrong = ixb.build_index(ckpt, 2)
    assert not wrong.equals(cut)
    differs = {r["tensor"] for r, w in zip(cut.to_pylist(), wrong.to_pylist()) if r["digest"] != w["digest"]}
    assert differs == {"w2_weight", "w2_weight_scale_inv"}


def test_transforms_take_the_tensor_path(make_ckpt):
    """A post-load transform computes: no plan, the tensors' path (same rows as before)."""
    ckpt = open_checkpoint(_write(make_ckpt, dict(CHECKPOINTS)["qwen3_moe_fp8_tensor"]))
    layout = ServerLayout(transforms=("fp8_tensor_w13_requant",))
    assert shard_plan.plan_expert(ckpt, 1, 0, 0, Parallel(2, layout=layout)) is None
    stats = ixb.IndexStats()
    table = ixb.build_index(ckpt.path, 2, layout=layout, stats=stats)
    assert "workers" not in stats.extra and table.equals(ixb.build_index(ckpt.path, 2, layout=layout, cutter="torch"))


def test_draft_rows_are_planned_too(make_ckpt):
    ckpt = open_checkpoint(_write(make_ckpt, dict(CHECKPOINTS)["qwen3_5_fp8_block_bf16_draft"]))
    draft, _ = draft_checkpoint(ckpt)
    assert draft is not None and index_cpu.plannable(draft, Parallel(2), draft.spec.moe_layers)
    planned, _ = _both(ckpt.path, 2)
    assert "draft" in planned.column("model").to_pylist()


def test_the_table_is_built_as_pyarrow_builds_it(make_ckpt):
    """Columns made from buffers (no pandas): the table pyarrow makes of the same rows,
    sorted by pyarrow, schema and all."""
    import pyarrow as pa

    from moetrace.schema import INDEX_SCHEMA

    table = ixb.build_index(_write(make_ckpt, dict(CHECKPOINTS)["qwen3_5_fp8_block_bf16_draft"]), 2)
    rows = table.to_pylist()
    rows.reverse()
    want = pa.Table.from_pylist(rows, schema=INDEX_SCHEMA).sort_by([
        ("model", "descending"), ("moe_tp_rank", "ascending"), ("layer", "ascending"), ("expert", "ascending"),
        ("copy_position", "ascending")])
    assert table.equals(want.replace_schema_metadata(table.schema.metadata), check_metadata=True)
    assert table.column("model").to_pylist()[0] == "target" and "draft" in table.column("model").to_pylist()


def test_schema_dtype_names_are_the_torch_dtypes_names():
    assert SCHEMA_DTYPES == {code: dtype_name(dt) for code, dt in torch_dtypes().items()}
