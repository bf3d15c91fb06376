"""INT4 (compressed-tensors W4A16 pack-quantized) on the expected side: what
make-checkpoint writes, the config moetrace reads, the per-rank shards (checked here
against synthetic_values at global coordinates; against SGLang's own loader in
tests/test_loader_oracle.py), and the refusals, by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moetrace.checkpoints.layout import ServerLayout
from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.shards import Parallel, expected_layer, tensor_names
from moetrace.checkpoints.synthetic import synthetic_values as sv
from moetrace.checkpoints.synthetic import write_synthetic_checkpoint
from moetrace.checkpoints.transforms import apply_transforms
from moetrace.errors import MoetraceError

H, I, E = 256, 512, 3


@pytest.fixture(scope="module", params=[32, 128])
def ckpt(request, make_ckpt):
    return open_checkpoint(make_ckpt(family="qwen3_5_moe", fmt="int4", num_layers=1, num_experts=E, hidden=H,
                                     intermediate=I, num_files=2, group_size=request.param))


def test_written_as_llm_compressor_writes_it(ckpt):
    cfg = json.loads((ckpt.path / "config.json").read_text())["quantization_config"]
    w = cfg["config_groups"]["group_0"]["weights"]
    assert (cfg["quant_method"], cfg["format"], cfg["quantization_status"]) == (
        "compressed-tensors", "pack-quantized", "compressed")
    assert (w["type"], w["num_bits"], w["strategy"], w["symmetric"], w["dynamic"], w["actorder"]) == (
        "int", 4, "group", True, False, None)
    gs = w["group_size"]
    assert ckpt.spec.fmt == "int4" and ckpt.spec.group_size == gs
    stem = "model.language_model.layers.0.mlp.experts.1"
    for proj, (out, inp) in (("gate", (I, H)), ("down", (H, I))):
        info = {k: ckpt.tensors[f"{stem}.{proj}_proj.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
        assert (info["weight_packed"].dtype, info["weight_packed"].shape) == ("I32", (out, inp // 8))
        assert (info["weight_scale"].dtype, info["weight_scale"].shape) == ("BF16", (out, inp // gs))
        assert (info["weight_shape"].dtype, info["weight_shape"].shape) == ("I64", (2,))
        with safe_open(str(info["weight_shape"].file), "pt") as f:
            assert f.get_tensor(f"{stem}.{proj}_proj.weight_shape").tolist() == [out, inp]


def test_words_tell_experts_apart_and_are_never_zero():
    rows, cols = torch.arange(64).view(-1, 1), torch.arange(32).view(1, -1)
    words = [sv(0, e, 0, rows, cols, "weight", torch.int32) for e in range(4)]
    assert all(w.dtype == torch.int32 and bool((w != 0).all()) for w in words)
    for a in range(4):
        for b in range(a + 1, 4):
            assert bool((words[a] != words[b]).all())
    high = [(w.to(torch.int64) & 0xFFFFFE00) for w in words]  # the position's bits: one per element
    assert torch.equal(high[0], high[3])


def _reference(ckpt, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The rank's shards from synthetic_values at global coordinates: gate then up rows of
    its I/tp slice, down's columns in words (8 per int32) and groups, transposed, bf16 scales."""
    gs, i_tp = ckpt.spec.group_size, I // tp
    r0 = rank * i_tp
    rows = torch.arange(r0, r0 + i_tp).view(-1, 1)
    out = {k: [] for k in tensor_names(ckpt.spec)}
    for e in range(E):
        w13 = torch.cat([sv(0, e, p, rows, torch.arange(H // 8).view(1, -1), "weight", torch.int32) for p in (0, 1)])
        s13 = torch.cat([sv(0, e, p, rows, torch.arange(H // gs).view(1, -1), "scale", torch.bfloat16) for p in (0, 1)])
        hrows = torch.arange(H).view(-1, 1)
        w2 = sv(0, e, 2, hrows, torch.arange(r0 // 8, (r0 + i_tp) // 8).view(1, -1), "weight", torch.int32)
        s2 = sv(0, e, 2, hrows, torch.arange(r0 // gs, (r0 + i_tp) // gs).view(1, -1), "scale", torch.bfloat16)
        for k, v in zip(out, (w13, s13, w2, s2)):
            out[k].append(v.T.contiguous())
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_transposed_with_packs_and_groups_cut(ckpt, tp):
    if (I // tp) % ckpt.spec.group_size:
        pytest.skip("refused: see test_tp_that_splits_a_pack_or_group_is_refused")
    for rank in range(tp):
        got, want = expected_layer(ckpt, 0, rank, Parallel(tp)), _reference(ckpt, rank, tp)
        assert list(got) == ["w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"]
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (tp, rank, k)


def test_tp_that_splits_a_pack_or_group_is_refused(make_ckpt):
    c = open_checkpoint(make_ckpt(family="qwen3_moe", fmt="int4", num_layers=1, num_experts=2, hidden=128,
                                  intermediate=256, num_files=1, group_size=128))
    with pytest.raises(MoetraceError, match=r"256 / moe_tp_size 4 = 64 input columns of down per rank is not a "
                                            r"whole number of groups \(group_size 128\)"):
        expected_layer(c, 0, 0, Parallel(4))
    c = open_checkpoint(make_ckpt(family="qwen3_moe", fmt="int4", num_layers=1, num_experts=2, hidden=128,
                                  intermediate=128, num_files=1, group_size=32))
    with pytest.raises(MoetraceError, match=r"= 4 input columns of down per rank is not a whole number of int4 packs"):
        expected_layer(c, 0, 0, Parallel(32))
    with pytest.raises(MoetraceError, match="INT4 with I per rank padded"):
        expected_layer(c, 0, 0, Parallel(2, layout=ServerLayout(intermediate_padded=128)))


@pytest.mark.parametrize("change, words", [
    (lambda w: w.update(symmetric=False), "asymmetric INT4"),
    (lambda w: w.update(actorder="group"), "actorder 'group'"),
    (lambda w: w.update(strategy="channel"), "INT4 strategy 'channel'"),
    (lambda w: w.update(group_size=0), "group_size must be a positive integer"),
    (lambda w: w.update(dynamic=True), "dynamic INT4"),
    (None, "format 'int-quantized'"),
])
def test_unsupported_int4_configs_refused_by_name(tmp_path, make_ckpt, change, words):
    import shutil

    src = make_ckpt(family="qwen3_moe", fmt="int4", num_layers=1, num_experts=2, hidden=128, intermediate=256,
                    num_files=1, group_size=32)
    dst = tmp_path / "c"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if change is None:
        cfg["quantization_config"]["format"] = "int-quantized"
    else:
        change(cfg["quantization_config"]["config_groups"]["group_0"]["weights"])
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MoetraceError, match=words):
        open_checkpoint(dst)


def test_writer_refusals(tmp_path):
    for kw, words in ((dict(group_size=64), "--group-size must be one of 32, 128"),
                      (dict(group_size=128, hidden=96), "must be multiples of --group-size 128"),
                      (dict(group_size=32, quant_method="fp8"), "needs --quant-method compressed-tensors")):
        with pytest.raises(MoetraceError, match=words):
            write_synthetic_checkpoint(tmp_path / "x", fmt="int4", **kw)
    with pytest.raises(MoetraceError, match="--group-size goes with --format int4"):
        write_synthetic_checkpoint(tmp_path / "x", fmt="fp8_block", group_size=32)


def test_conform_transforms_reshape_words_and_permute_scales(ckpt):
    """The conform layout: words unchanged, in the repack's [k/16, 2n] shape; every scale
    kept, each run of 64 (32 for w2's single group) permuted within itself."""
    base = expected_layer(ckpt, 0, 1, Parallel(2))
    got = apply_transforms(base, ("marlin_repack_identity", "marlin_permute_scales"))
    for name in ("w13_weight_packed", "w2_weight_packed"):
        k8, n = base[name].shape[1:]
        assert got[name].shape[1:] == (k8 // 2, 2 * n) and torch.equal(got[name].reshape(-1), base[name].reshape(-1))
    for name in ("w13_weight_scale", "w2_weight_scale"):
        run = 32 if name == "w2_weight_scale" and base[name].shape[1] == 1 else 64
        a, b = base[name].reshape(-1, run), got[name].reshape(-1, run)
        assert got[name].shape == base[name].shape and not torch.equal(a, b)
        assert torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)
