"""checkpoints.reader / spec: MoE layer selection from config, ignored tensors,
identity, and every bad input failing with one line naming the file/tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.safetensors_file import read_header
from moetrace.checkpoints.shards import Parallel, expected_layer
from moetrace.checkpoints.spec import spec_from_config
from moetrace.errors import MoetraceError

SMALL = dict(num_layers=2, dense_layers=1, num_experts=4, hidden=256, intermediate=256)
Q35 = "model.language_model.layers.1.mlp.experts"


def _edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _rewrite_tensor(ckpt: Path, name: str, fn) -> str:
    """Replace tensor `name` in its file by fn(tensor); returns the file name."""
    fname = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(ckpt / fname), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(ckpt / fname))
    return fname


def _one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# ---- layer selection from config --------------------------------------------------


def _qwen3(**kw):
    return {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 8, "num_experts": 4, "hidden_size": 256,
            "moe_intermediate_size": 256, **kw}  # fmt: skip


@pytest.mark.parametrize(
    "config,layers",
    [
        (_qwen3(), tuple(range(8))),
        (_qwen3(mlp_only_layers=[0, 5]), (1, 2, 3, 4, 6, 7)),
        (_qwen3(decoder_sparse_step=2), (1, 3, 5, 7)),
        (_qwen3(decoder_sparse_step=2, mlp_only_layers=[3]), (1, 5, 7)),
        ({**_qwen3(), "architectures": ["Qwen3NextForCausalLM"], "mlp_only_layers": [7]}, tuple(range(7))),
        ({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "n_routed_experts": 256,
          "hidden_size": 7168, "moe_intermediate_size": 2048, "first_k_dense_replace": 3}, tuple(range(3, 61))),
        ({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "n_routed_experts": 4,
          "hidden_size": 256, "moe_intermediate_size": 256, "first_k_dense_replace": 1, "moe_layer_freq": 2}, (2, 4, 6)),
        ({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
          "text_config": {"num_hidden_layers": 48, "num_experts": 256, "hidden_size": 3072, "moe_intermediate_size": 1024},
          "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, tuple(range(48))),
    ],
)  # fmt: skip
def test_moe_layers_from_config(config, layers):
    spec = spec_from_config(config, "config.json")
    assert spec.moe_layers == layers


def test_spec_of_qwen35_nested_config_and_formats():
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
           "text_config": {"num_hidden_layers": 48, "num_experts": 256, "hidden_size": 3072, "moe_intermediate_size": 1024},
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}  # fmt: skip
    s = spec_from_config(cfg, "config.json")
    assert (s.family, s.prefix, s.num_experts, s.hidden_size, s.intermediate_size, s.fmt, s.block) == (
        "qwen3_5_moe", "model.language_model", 256, 3072, 1024, "fp8_block", (128, 128))  # fmt: skip
    cfg["quantization_config"]["weight_block_size"] = None  # SGLang's fp8 method: per-tensor scales
    assert (spec_from_config(cfg, "config.json").fmt, spec_from_config(cfg, "config.json").quant_method) == ("fp8_tensor", "fp8")
    del cfg["quantization_config"]
    assert spec_from_config(cfg, "config.json").fmt == "bf16"


@pytest.mark.parametrize("weights,want", [
    ({"strategy": "channel"}, ("fp8_channel", None, "weight_scale")),
    ({"strategy": "block", "block_structure": [128, 64]}, ("fp8_block", (128, 64), "weight_scale")),
    ({"strategy": "tensor"}, ("fp8_tensor", None, "weight_scale")),
])  # fmt: skip
def test_compressed_tensors_fp8_schemes(weights, want):
    w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, **weights}
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "num_experts": 8, "hidden_size": 64,
           "moe_intermediate_size": 64, "quantization_config": {"quant_method": "compressed-tensors",
                                                               "config_groups": {"g": {"weights": w}}}}
    s = spec_from_config(cfg, "config.json")
    assert (s.fmt, s.block, s.scale_suffix, s.quant_method) == (*want, "compressed-tensors")


def test_compressed_tensors_non_fp8_refused():
    """W8A16 (8-bit int) is neither FP8 nor INT4: refused by name (INT4: tests/test_checkpoints_int4.py)."""
    w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "num_experts": 8, "hidden_size": 64,
           "moe_intermediate_size": 64, "quantization_config": {"quant_method": "compressed-tensors",
                                                               "config_groups": {"group_0": {"weights": w}}}}
    with pytest.raises(MoetraceError, match=r"config_groups.group_0 quantizes weights as 'int' 8-bit, strategy 'group'"):
        spec_from_config(cfg, "config.json")


def test_dense_layers_mtp_and_visual_ignored(ckpt_copy):
    """Qwen3.5: mtp.* and model.visual.* (expert-looking, wrong shapes) are not
    experts, even when the index points them at a file that does not exist."""
    root = ckpt_copy(family="qwen3_5_moe", **{**SMALL, "num_layers": 3})
    _edit_json(root / "model.safetensors.index.json",
               lambda d: d["weight_map"].update({"mtp.layers.0.mlp.experts.0.gate_proj.weight": "gone.safetensors"}))  # fmt: skip
    ckpt = open_checkpoint(root)
    assert ckpt.spec.moe_layers == (1, 2)
    assert not [n for n in ckpt.tensors if n.startswith(("mtp.", "model.visual."))]
    assert expected_layer(ckpt, 2, 0, Parallel(1))["w13_weight"].shape == (4, 512, 256)


def test_deepseek_mtp_layer_not_moe(make_ckpt):
    ckpt = open_checkpoint(make_ckpt(family="deepseek_v3", **SMALL))
    assert ckpt.spec.moe_layers == (1,) and ckpt.spec.num_layers == 2
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" in ckpt.tensors  # the MTP layer, stored as layer 2
    with pytest.raises(MoetraceError, match="layer 2 is not a MoE layer"):
        expected_layer(ckpt, 2, 0, Parallel(1))


def test_config_calling_an_expert_layer_dense(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **{**SMALL, "num_layers": 3})  # MoE layers 1, 2
    _edit_json(root / "config.json", lambda d: d.update(mlp_only_layers=[0, 1]))
    with pytest.raises(MoetraceError, match=r"model.layers.1.mlp.experts.* config.json makes layer 1 dense"):
        open_checkpoint(root)


def test_weights_and_scales_split_across_files(make_ckpt):
    ckpt = open_checkpoint(make_ckpt(family="qwen3_moe", **SMALL))
    pairs = [(n, n + "_scale_inv") for n in ckpt.tensors if ".experts." in n and n.endswith(".weight")]
    split = {ckpt.file_of(w) != ckpt.file_of(s) for w, s in pairs}
    assert split == {True, False}
    assert ckpt.spec.scale_dtype == "bfloat16"


def test_identity_stable_and_header_sensitive(ckpt_copy, make_ckpt):
    kw = dict(family="deepseek_v3", **SMALL)
    a = open_checkpoint(make_ckpt(**kw)).identity
    assert a == open_checkpoint(make_ckpt(**kw)).identity and len(a) == 16
    assert a != open_checkpoint(make_ckpt(**{**kw, "num_files": 1})).identity
    assert a != open_checkpoint(make_ckpt(**{**kw, "seed": 1})).identity  # seed is recorded in config.json
    root = ckpt_copy(**kw)
    _edit_json(root / "config.json", lambda d: d.update(torch_dtype="float16"))
    assert open_checkpoint(root).identity != a


def test_read_slices_and_bounds(make_ckpt):
    ckpt = open_checkpoint(make_ckpt(family="qwen3_moe", **SMALL))
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    full = ckpt.read(name)
    assert torch.equal(ckpt.read(name, rows=(3, 9)).view(torch.uint8), full[3:9].view(torch.uint8))
    assert torch.equal(ckpt.read(name, cols=slice(128, 256)).view(torch.uint8), full[:, 128:].view(torch.uint8))
    with pytest.raises(MoetraceError, match=rf"{name} in .*range \[250, 300\)"):
        ckpt.read(name, rows=(250, 300))


# ---- bad input ---------------------------------------------------------------------


def test_missing_config(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    (root / "config.json").unlink()
    with pytest.raises(MoetraceError, match=r"config.json: config.json not found") as e:
        open_checkpoint(root)
    _one_line_error(e)


def test_garbled_config(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    (root / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM",\n')
    with pytest.raises(MoetraceError, match=r"config.json: garbled config.json, not valid JSON") as e:
        open_checkpoint(root)
    _one_line_error(e)


def test_unknown_architecture(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    _edit_json(root / "config.json", lambda d: d.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(MoetraceError, match=r"config.json: architecture 'LlamaForCausalLM' is not supported; "
                       r"supported: DeepseekV3ForCausalLM, Qwen3MoeForCausalLM"):  # fmt: skip
        open_checkpoint(root)


def test_missing_config_key(ckpt_copy):
    """A size the file leaves out is the config class's default, as SGLang sees it
    (DeepseekV3Config: 256 routed experts), and the weights refuse it by name."""
    root = ckpt_copy(family="deepseek_v3", **SMALL)
    _edit_json(root / "config.json", lambda d: d.pop("n_routed_experts"))
    with pytest.raises(MoetraceError, match=r"config.json: 'n_routed_experts' is 256 \(transformers' default: the file "
                       r"does not set it\) but the safetensors files hold experts 0-3 only"):  # fmt: skip
        open_checkpoint(root)


def test_weight_map_names_missing_file(ckpt_copy):
    root = ckpt_copy(family="qwen3_5_moe", **SMALL)
    name = f"{Q35}.3.up_proj.weight"
    _edit_json(root / "model.safetensors.index.json", lambda d: d["weight_map"].update({name: "model-00009-of-00009.safetensors"}))
    with pytest.raises(MoetraceError, match=rf"model.safetensors.index.json: weight_map maps {name} to "
                       r"model-00009-of-00009.safetensors, which does not exist") as e:  # fmt: skip
        open_checkpoint(root)
    _one_line_error(e)


def test_no_weights_at_all(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    for f in root.glob("model*"):
        f.unlink()
    with pytest.raises(MoetraceError, match=r"neither model.safetensors.index.json nor model.safetensors"):
        open_checkpoint(root)


@pytest.mark.parametrize("keep", [5, 200])
def test_truncated_safetensors(ckpt_copy, keep):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    shard = root / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:keep])
    with pytest.raises(MoetraceError, match=r"model-00002-of-00002.safetensors: truncated") as e:
        open_checkpoint(root)
    _one_line_error(e)


def test_truncated_data_section(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL, num_files=1)
    shard = root / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(MoetraceError, match=r"model.safetensors: garbled or truncated safetensors header entry"):
        open_checkpoint(root)


def test_garbled_header_json(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    shard = root / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:20] = b"#garbage#!!\xff"
    shard.write_bytes(bytes(data))
    with pytest.raises(MoetraceError, match=r"model-00001-of-00002.safetensors: garbled safetensors header JSON") as e:
        open_checkpoint(root)
    _one_line_error(e)
    with pytest.raises(MoetraceError, match="garbled"):
        read_header(shard)


def test_listed_tensor_absent_from_file(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    wm = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.experts.1.gate_proj.weight"
    other = next(f for f in set(wm.values()) if f != wm[name])
    _edit_json(root / "model.safetensors.index.json", lambda d: d["weight_map"].update({name: other}))
    with pytest.raises(MoetraceError, match=rf"{name}: listed in model.safetensors.index.json under {other} but absent"):
        open_checkpoint(root)


def test_expert_tensor_missing_from_weight_map(ckpt_copy):
    root = ckpt_copy(family="deepseek_v3", **SMALL)
    _edit_json(root / "model.safetensors.index.json",
               lambda d: d["weight_map"].pop("model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"))  # fmt: skip
    with pytest.raises(MoetraceError, match=r"1 expert tensor\(s\) .* first: model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"):
        open_checkpoint(root)


def test_wrong_shape_for_config(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    _edit_json(root / "config.json", lambda d: d.update(moe_intermediate_size=128))
    ckpt = open_checkpoint(root)
    with pytest.raises(MoetraceError, match=r"model.layers.1.mlp.experts.0.gate_proj.weight in model-0000\d-of-00002."
                       r"safetensors: expected F8_E4M3 \[128, 256\] .*found F8_E4M3 \[256, 256\]") as e:  # fmt: skip
        expected_layer(ckpt, 1, 0, Parallel(1))
    _one_line_error(e)


def test_wrong_dtype(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    fname = _rewrite_tensor(root, name, lambda t: t.to(torch.bfloat16))
    ckpt = open_checkpoint(root)
    with pytest.raises(MoetraceError, match=rf"{name} in {fname}: expected F8_E4M3 \[256, 256\] .*found BF16 \[256, 256\]"):
        expected_layer(ckpt, 1, 0, Parallel(1))


def test_wrong_scale_dtype(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    name = "model.layers.1.mlp.experts.1.up_proj.weight_scale_inv"
    _rewrite_tensor(root, name, lambda t: t.to(torch.float64))
    with pytest.raises(MoetraceError, match=rf"{name} in .*expected F32\|BF16\|F16 .*found F64"):
        expected_layer(open_checkpoint(root), 1, 1, Parallel(2))


def test_scale_shape_not_matching_block(ckpt_copy):
    root = ckpt_copy(family="qwen3_5_moe", **SMALL)
    _edit_json(root / "config.json", lambda d: d["quantization_config"].update(weight_block_size=[64, 64]))
    with pytest.raises(MoetraceError, match=rf"{Q35}.0.gate_proj.weight_scale_inv in .*expected F32\|BF16\|F16 \[4, 4\] "
                       r".*scale shape \[2, 2\] does not match weight_block_size \[64, 64\]"):  # fmt: skip
        expected_layer(open_checkpoint(root), 1, 0, Parallel(1))


def test_one_scale_with_wrong_shape(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", **SMALL)
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    _rewrite_tensor(root, name, lambda t: t[:1].contiguous())
    with pytest.raises(MoetraceError, match=rf"{name} in .*scale shape \[1, 2\] does not match weight_block_size \[128, 128\]"):
        expected_layer(open_checkpoint(root), 1, 0, Parallel(1))


def test_config_format_disagrees_with_tensors(ckpt_copy):
    root = ckpt_copy(family="qwen3_moe", fmt="fp8_channel", **SMALL)
    _edit_json(root / "config.json", lambda d: d.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}))
    with pytest.raises(MoetraceError, match=r"config.json: quantization_config \(fp8, block scales\) needs "
                       r"model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv but it is missing; it has "
                       r"model.layers.1.mlp.experts.0.gate_proj.weight_scale"):  # fmt: skip
        open_checkpoint(root)


def test_fp8_without_blocks_over_per_channel_scales(ckpt_copy):
    """fp8 without weight_block_size is per-tensor in SGLang: per-channel scales under it
    (what older moetrace wrote as fp8_channel) are refused with the way out."""
    root = ckpt_copy(family="qwen3_moe", fmt="fp8_channel", **SMALL)
    _edit_json(root / "config.json", lambda d: d.update(quantization_config={"quant_method": "fp8"}))
    with pytest.raises(MoetraceError, match=r"weight_scale in .*expected F32\|BF16\|F16 \[\] or \[1\] .*per-channel FP8 "
                       r"checkpoints are compressed-tensors with strategy channel.*found"):  # fmt: skip
        expected_layer(open_checkpoint(root), 1, 0, Parallel(1))


def test_bf16_config_over_fp8_tensors(ckpt_copy):
    root = ckpt_copy(family="deepseek_v3", **SMALL)
    _edit_json(root / "config.json", lambda d: d.pop("quantization_config"))
    with pytest.raises(MoetraceError, match=r"config.json: no quantization_config but the checkpoint has FP8 scales"):
        open_checkpoint(root)


def test_unsupported_quant_method(ckpt_copy):
    root = ckpt_copy(family="deepseek_v3", **SMALL)
    _edit_json(root / "config.json", lambda d: d["quantization_config"].update(quant_method="gptq"))
    with pytest.raises(MoetraceError, match=r"config.json: quantization_config.quant_method 'gptq' is not supported"):
        open_checkpoint(root)


def test_per_channel_scale_stored_1d(ckpt_copy, make_ckpt):
    """A per-channel scale may be stored [out] instead of [out, 1]: same shards."""
    kw = dict(family="qwen3_next", fmt="fp8_channel", scale_dtype="float32", **SMALL)
    want = expected_layer(open_checkpoint(make_ckpt(**kw)), 1, 1, Parallel(2))
    root = ckpt_copy(**kw)
    for p in ("gate", "down"):
        _rewrite_tensor(root, f"model.layers.1.mlp.experts.1.{p}_proj.weight_scale", lambda t: t.reshape(-1))
    got = expected_layer(open_checkpoint(root), 1, 1, Parallel(2))
    for name, t in want.items():
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
