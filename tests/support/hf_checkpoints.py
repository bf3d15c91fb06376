"""Checkpoints as the ecosystem writes them (tests only): tiny random models saved by the
installed transformers' own ``save_pretrained``, per-expert (``save_original_format=True``,
the default) and fused 3-D (``save_original_format=False``), and the llm-compressor
outputs committed under tests/data/llmcompressor (made by the script there).

FP8: transformers' FineGrainedFP8 quantizer needs a GPU, so the model is built with its
own FP8 modules (``FP8Experts``, ``FP8Linear``) filled here with block-quantized random
weights, and saved by ``save_pretrained`` like a quantized model: names, shapes, dtypes,
the per-expert split and the quantization_config are transformers' own.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import torch

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


def config(family: str, hidden: int = H):
    import transformers

    if hidden != H:
        return _with_hidden(config(family), hidden)

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


def _with_hidden(cfg, hidden: int):
    for c in {id(cfg): cfg, id(cfg.get_text_config()): cfg.get_text_config()}.values():
        c.hidden_size = hidden
    if hasattr(cfg, "vision_config"):
        cfg.vision_config.out_hidden_size = hidden
    return cfg


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


def fp8(root: Path, family: str, fused: bool, hidden: int = 2 * H) -> Path:
    """A tiny random model of `family` as FineGrainedFP8Config(weight_block_size=[128, 128])
    holds it (experts in transformers' own FP8Experts, shared-expert projections in its
    FP8Linear, filled with block-quantized random weights), saved by save_pretrained
    per-expert or fused. hidden 128 (one scale block across H) shows the per-expert save's
    squeezed scales."""
    import transformers
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    torch.manual_seed(zlib.crc32(f"{family} fp8".encode()))
    cfg = config(family, hidden)
    cfg.architectures = [ARCHS[family]]
    model = getattr(transformers, ARCHS[family])(cfg).to(torch.bfloat16)
    text = cfg.get_text_config()
    for name, module in list(model.named_modules()):
        if name.endswith("mlp.experts") and hasattr(module, "gate_up_proj"):
            held = FP8Experts(text, block_size=BLOCK)
            for proj in ("gate_up_proj", "down_proj"):
                q, scale = _quantize_blocks(getattr(module, proj).data, BLOCK)
                getattr(held, proj).data, getattr(held, f"{proj}_scale_inv").data = q, scale
            model.set_submodule(name, held)
        elif re.search(r"\.shared_experts?\.(gate|up|down)_proj$", name) and isinstance(module, torch.nn.Linear):
            held = FP8Linear(module.in_features, module.out_features, block_size=BLOCK)
            held.weight.data, held.weight_scale_inv.data = _quantize_blocks(module.weight.data, BLOCK)
            model.set_submodule(name, held)
    model.config.quantization_config = FineGrainedFP8Config(weight_block_size=list(BLOCK))
    model.save_pretrained(root, save_original_format=not fused)
    return root


def llmcompressor_outputs() -> list[Path]:
    return sorted(p for p in DATA.iterdir() if (p / "config.json").is_file())
