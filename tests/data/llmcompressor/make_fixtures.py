"""Writes the llm-compressor fixtures beside this file (not run by the test suite).

llm-compressor pins an older transformers than SGLang's, so it runs in a side venv:

    python3.11 -m venv /tmp/lc && /tmp/lc/bin/pip install torch==2.13.0   # CPU torch first
    /tmp/lc/bin/pip install llmcompressor==0.14.0.1
    /tmp/lc/bin/python tests/data/llmcompressor/make_fixtures.py

Each fixture: a tiny random MoE model saved by that transformers, reloaded with
llm-compressor's linearized experts (linearize_moe), quantized data-free
(oneshot with a QuantizationModifier, FP8_BLOCK or FP8_DYNAMIC) and saved compressed.
The sizes let `moetrace index --tp 2` cut FP8 blocks of 128 (I = 256).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import compressed_tensors
import llmcompressor
import torch
import transformers
from llmcompressor import oneshot
from llmcompressor.modeling.moe.linearize import linearize_moe
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM

HERE = Path(__file__).resolve().parent
COMMON = dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
              vocab_size=32, intermediate_size=128, moe_intermediate_size=256, num_experts_per_tok=2,
              max_position_embeddings=64, tie_word_embeddings=True)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, num_experts=2),
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(**COMMON, num_experts=2,
                                                                   shared_expert_intermediate_size=256,
                                                                   layer_types=["full_attention"]),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{k: v for k, v in COMMON.items() if k != "head_dim"}, n_routed_experts=2, n_shared_experts=1,
        first_k_dense_replace=0, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, n_group=1, topk_group=1, num_nextn_predict_layers=0),
}
SCHEMES = ("FP8_BLOCK", "FP8_DYNAMIC")


def make(family: str, scheme: str, out: Path) -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(FAMILIES[family]()).to(torch.bfloat16).save_pretrained(tmp)
        # Experts as per-expert Linear modules (llm-compressor's post-load route; its
        # load_quantizable_moe patches every transformers module, torchvision included).
        model = linearize_moe(AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16))
        recipe = QuantizationModifier(targets="Linear", scheme=scheme,
                                      ignore=["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"])
        oneshot(model=model, recipe=recipe)
        if out.exists():
            shutil.rmtree(out)
        model.save_pretrained(out, save_compressed=True)
    for extra in out.glob("*"):
        if extra.name not in ("config.json", "model.safetensors", "model.safetensors.index.json", "recipe.yaml"):
            extra.unlink()


def main() -> None:
    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
                "llmcompressor": llmcompressor.__version__, "compressed-tensors": compressed_tensors.__version__}
    for family in (sys.argv[1:] or FAMILIES):
        for scheme in SCHEMES:
            make(family, scheme, HERE / f"{family}-{scheme.lower()}")
    (HERE / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")
    print(json.dumps(versions))


if __name__ == "__main__":
    main()
