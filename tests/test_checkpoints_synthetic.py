"""checkpoints.synthetic: value guarantees, stored bytes equal synthetic_values
(read with safetensors directly, not via the reader), and the make-checkpoint CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from moetrace.checkpoints.synthetic import synthetic_values as sv
from moetrace.checkpoints.synthetic import write_synthetic_checkpoint
from moetrace.cli import main
from moetrace.errors import MoetraceError

R, C = torch.arange(64)[:, None], torch.arange(48)[None, :]


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def test_fp8_bytes_finite_nonzero():
    b = _bytes(sv(3, 5, 1, torch.arange(1024)[:, None], torch.arange(256)[None, :]))
    assert not torch.isin(b, torch.tensor([0x00, 0x7F, 0x80, 0xFF], dtype=torch.uint8)).any()
    assert torch.isfinite(b.view(torch.float8_e4m3fn).float()).all()
    assert len(torch.unique(b)) == 252


@pytest.mark.parametrize(
    "kind,dtype",
    [("weight", torch.float8_e4m3fn), ("weight", torch.bfloat16), ("scale", torch.float32), ("scale", torch.bfloat16),
     ("scale", torch.float16)],
)  # fmt: skip
def test_neighbouring_experts_differ_everywhere(kind, dtype):
    """Within a cycle (252 ids for fp8 weights, 512 otherwise) every element
    differs; across cycles (expert 251 vs 253 for fp8) nearly all do."""
    cycle = 252 if dtype == torch.float8_e4m3fn else 512
    vals = {e: sv(1, e, 2, R, C, kind, dtype) for e in range(0, 270)}
    vals = {e: v.view(torch.uint8) if dtype == torch.float8_e4m3fn else v for e, v in vals.items()}
    for e in range(0, 266):
        for d in (1, 2, 3, 17):
            if e + d in vals:
                differ = vals[e] != vals[e + d]
                if e // cycle == (e + d) // cycle:
                    assert differ.all(), (e, e + d)
                else:
                    assert differ.float().mean() > 0.9, (e, e + d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scales_exact_positive_and_proj_distinct(dtype):
    ref = [sv(0, 7, p, R, C, "scale", torch.float32) for p in range(3)]
    for p in range(3):
        got = sv(0, 7, p, R, C, "scale", dtype)
        assert torch.equal(got.float(), ref[p])  # same value in every stored dtype: cast to fp32 is exact
        assert (ref[p] > 0).all()
    assert (ref[0] != ref[1]).all() and (ref[1] != ref[2]).all() and (ref[0] != ref[2]).all()


def test_layers_and_seeds_differ():
    a = _bytes(sv(0, 0, 0, R, C))
    assert (a != _bytes(sv(1, 0, 0, R, C))).float().mean() > 0.95
    assert (a != _bytes(sv(0, 0, 0, R, C, seed=1))).float().mean() > 0.95
    assert (a != _bytes(sv(0, 0, 0, R, C, kind="weight", dtype=torch.float8_e4m3fn))).sum() == 0


@pytest.mark.parametrize("fmt,fused", [("fp8_block", False), ("fp8_channel", False), ("fp8_tensor", False),
                                       ("bf16", False), ("bf16", True)])
def test_stored_values_are_synthetic_values(make_ckpt, fmt, fused):
    H, I = 320, 256
    root = make_ckpt(family="qwen3_5_moe", fmt=fmt, fused=fused, num_layers=2, num_experts=4, hidden=H, intermediate=I,
                     scale_dtype="float16", seed=3)  # fmt: skip
    wm = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    wdt = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
    stem = "model.language_model.layers.1.mlp.experts"

    def get(name):
        with safe_open(str(root / wm[name]), framework="pt") as f:
            return f.get_tensor(name)

    grid = lambda n, m: (torch.arange(n)[:, None], torch.arange(m)[None, :])  # noqa: E731
    if fused:
        gu, down = get(f"{stem}.gate_up_proj"), get(f"{stem}.down_proj")
        assert gu.shape == (4, 2 * I, H) and down.shape == (4, H, I)
        assert torch.equal(_bytes(gu[2, I:]), _bytes(sv(1, 2, 1, *grid(I, H), "weight", wdt, seed=3)))
        assert torch.equal(_bytes(down[3]), _bytes(sv(1, 3, 2, *grid(H, I), "weight", wdt, seed=3)))
        return
    assert torch.equal(_bytes(get(f"{stem}.2.up_proj.weight")), _bytes(sv(1, 2, 1, *grid(I, H), "weight", wdt, seed=3)))
    assert torch.equal(_bytes(get(f"{stem}.3.down_proj.weight")), _bytes(sv(1, 3, 2, *grid(H, I), "weight", wdt, seed=3)))
    if fmt == "fp8_block":
        s = get(f"{stem}.3.down_proj.weight_scale_inv")
        assert s.dtype == torch.float16 and s.shape == (math.ceil(H / 128), I // 128)
        assert torch.equal(s, sv(1, 3, 2, *grid(3, 2), "scale", torch.float16, seed=3))
    cfg = json.loads((root / "config.json").read_text())
    if fmt == "fp8_channel":  # per-channel FP8 ships as compressed-tensors
        s = get(f"{stem}.0.gate_proj.weight_scale")
        assert s.shape == (I, 1) and torch.equal(s, sv(1, 0, 0, *grid(I, 1), "scale", torch.float16, seed=3))
        weights = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
        assert cfg["quantization_config"]["quant_method"] == "compressed-tensors" and weights["strategy"] == "channel"
    if fmt == "fp8_tensor":  # the fp8 method without weight_block_size: one scalar scale per tensor
        s = get(f"{stem}.1.up_proj.weight_scale")
        zero = torch.zeros((), dtype=torch.int64)
        assert s.shape == () and torch.equal(s, sv(1, 1, 1, zero, zero, "scale", torch.float16, seed=3))
        assert cfg["quantization_config"] == {**cfg["quantization_config"], "quant_method": "fp8"}
        assert "weight_block_size" not in cfg["quantization_config"]
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and cfg["text_config"]["num_experts"] == 4


def test_writer_refuses_bad_arguments(tmp_path):
    with pytest.raises(MoetraceError, match="--fused .* needs --format bf16"):
        write_synthetic_checkpoint(tmp_path / "a", fmt="fp8_block", fused=True)
    # what SGLang does not load, moetrace does not write either (docs/checkpoints.md)
    with pytest.raises(MoetraceError, match="--fused for qwen3_moe: SGLang's models/qwen3_moe.py maps per-expert"):
        write_synthetic_checkpoint(tmp_path / "c", family="qwen3_moe", fmt="bf16", fused=True)
    with pytest.raises(MoetraceError, match="--family must be one of"):
        write_synthetic_checkpoint(tmp_path / "a", family="llama")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    with pytest.raises(MoetraceError, match="exists and is not an empty directory"):
        write_synthetic_checkpoint(tmp_path / "b")


def test_cli_make_checkpoint(tmp_path):
    out = tmp_path / "ck"
    res = CliRunner().invoke(
        main, ["make-checkpoint", "--family", "deepseek_v3", "--format", "fp8_block", "--scale-dtype", "float32",
               "--layers", "2", "--dense-layers", "1", "--experts", "4", "--files", "1", "-o", str(out), "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["path"] == str(out) and len(info["identity"]) == 16
    assert (out / "model.safetensors").exists() and json.loads((out / "config.json").read_text())["first_k_dense_replace"] == 1

    res = CliRunner().invoke(main, ["make-checkpoint", "--layers", "2", "--dense-layers", "2", "-o", str(tmp_path / "x")])
    assert res.exit_code == 2
    assert res.output.strip().count("\n") == 0 and "Traceback" not in res.output
    assert res.output.startswith("moetrace: error: --dense-layers 2 must be in [0, --layers 2)")
    assert isinstance(res.exception, SystemExit)

    res = CliRunner().invoke(main, ["make-checkpoint", "--help"])
    assert res.exit_code == 0 and "Example:" in res.output


def test_make_checkpoint_formats_from_the_cli(tmp_path):
    from moetrace.checkpoints.reader import open_checkpoint

    run = CliRunner().invoke
    args = ["make-checkpoint", "--layers", "1", "--experts", "2", "--hidden", "64", "--intermediate", "128", "--files", "1"]
    assert run(main, args + ["--quant-method", "compressed-tensors", "--block", "64,32", "-o", str(tmp_path / "ct")]).exit_code == 0
    s = open_checkpoint(tmp_path / "ct").spec
    assert (s.fmt, s.block, s.quant_method, s.scale_suffix) == ("fp8_block", (64, 32), "compressed-tensors", "weight_scale")
    assert run(main, args + ["--format", "fp8_tensor", "-o", str(tmp_path / "pt")]).exit_code == 0
    assert open_checkpoint(tmp_path / "pt").spec.fmt == "fp8_tensor"
    bad = run(main, args + ["--format", "fp8_channel", "--quant-method", "fp8", "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "fp8 without weight_block_size means per-tensor scales" in bad.output
    assert run(main, args + ["--block", "a,b", "-o", str(tmp_path / "y")]).exit_code == 2
