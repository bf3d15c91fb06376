"""Checkpoints as the ecosystem writes them (tests only): tiny random models saved by the
installed transformers' own ``save_pretrained``, per-expert (``save_original_format=True``,
the default) and fused 3-D (``save_original_format=False``), and the llm-compressor
outputs committed under tests/data/llmcompressor (made by the script there).

FP8 fused experts: transformers' FineGrainedFP8 quantizer needs a GPU, so the BF16 fused
save is quantized here, block by block, into exactly the parameters transformers'
``FP8Experts`` allocates (names, shapes and dtypes are checked against an instance),
with the quantization_config FineGrainedFP8Config writes.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DATA = Path(__file__).resolve().parent.parent / "data" / "llmcompressor"
H, I, E = 128, 256, 4  # I/2 = 128: FP8 blocks of 128 cut whole at TP2
BLOCK = (128, 128)
_COMMON = dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=32,
               intermediate_size=128, moe_intermediate_size=I, num_experts_per_tok=2, max_position_embeddings=64)
_LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1, linear_num_value_heads=1,
               linear_key_head_dim=32, linear_value_head_dim=32)
# writer family -> architecture
ARCHS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def config(family: str):
    import transformers

    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**_COMMON, num_hidden_layers=2, num_experts=E)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**_COMMON, **_LINEAR, num_hidden_layers=2, num_experts=E,
                                            shared_expert_intermediate_size=I)
    text = dict(_COMMON, **_LINEAR, num_hidden_layers=2, num_experts=E, shared_expert_intermediate_size=I)
    if family == "qwen3_5_moe_text":
        return transformers.Qwen3_5MoeTextConfig(**text)
    if family == "qwen3_5_moe":
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=H,
                      num_position_embeddings=16, patch_size=4, spatial_merge_size=1, temporal_patch_size=1)
        return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **{k: v for k, v in _COMMON.items() if k != "head_dim"}, num_hidden_layers=2, n_routed_experts=E,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, num_nextn_predict_layers=0)
    raise ValueError(family)


def save_pretrained(root: Path, family: str, fused: bool) -> Path:
    """A tiny random BF16 model of `family`, saved by transformers."""
    import transformers

    torch.manual_seed(zlib.crc32(f"{family} {fused}".encode()))  # reproducible across processes
    cfg = config(family)
    cfg.architectures = [ARCHS[family]]
    cls = getattr(transformers, ARCHS[family])
    model = cls(cfg).to(torch.bfloat16)
    model.save_pretrained(root, save_original_format=not fused)
    return root


def _quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[.., out, in] -> FP8 weight and fp32 inverse scales [.., ceil(out/bn), ceil(in/bk)]."""
    bn, bk = block
    *lead, out, inp = w.shape
    x = w.float().reshape(*lead, out // bn, bn, inp // bk, bk)
    scale = x.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0
    q = (x / scale[..., :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), scale


def fp8_fused(root: Path, family: str) -> Path:
    """The fused BF16 save of `family`, its experts (routed 3-D and shared) quantized to
    FP8 with block scales as FineGrainedFP8Config(weight_block_size=[128, 128]) stores them."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    save_pretrained(root, family, fused=True)
    path = root / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    out = {}
    for name, t in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out[name], out[name + "_scale_inv"] = _quantize_blocks(t, BLOCK)
        elif ".shared_expert" in name and name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = _quantize_blocks(t, BLOCK)
        else:
            out[name] = t
    cfg = json.loads((root / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    held = {n: (tuple(p.shape), p.dtype) for n, p in FP8Experts(config(family).get_text_config(), BLOCK).named_parameters()}
    stem = next(n for n in out if n.endswith("mlp.experts.gate_up_proj")).removesuffix("gate_up_proj")
    written = {n.removeprefix(stem): (tuple(out[n].shape), out[n].dtype) for n in out if n.startswith(stem)}
    assert written == held, f"FP8Experts holds {held}, written {written}"
    save_file(out, str(path), metadata=metadata)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
                                  "modules_to_not_convert": None}
    del text  # the config class keeps quantization_config at the top level
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return root


def llmcompressor_outputs() -> list[Path]:
    return sorted(p for p in DATA.iterdir() if (p / "config.json").is_file())
