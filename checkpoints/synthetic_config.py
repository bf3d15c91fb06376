"""config.json of a synthetic checkpoint (checkpoints.synthetic): the family's own keys and
architecture, the sizes of the non-expert modules (checkpoints.synthetic_model), and a
quantization_config as the fp8 method or compressed-tensors writes it."""

from __future__ import annotations

from moetrace.checkpoints import synthetic_model as model
from moetrace.checkpoints.synthetic_model import ignore_patterns
from moetrace.checkpoints.tokenizer import MAX_LENGTH, vision_token_ids


def _int4_quant_config(group_size: int, not_converted: list[str]) -> dict:
    """W4A16 as llm-compressor writes it (compressed-tensors pack-quantized, e.g. Kimi-K2-Thinking's)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "strategy": "group",
               "group_size": group_size, "actorder": None, "block_structure": None, "observer": "minmax",
               "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": not_converted, "kv_cache_scheme": None, "global_compression_ratio": None}


def _quant_config(fmt: str, quant_method: str, block: tuple[int, int], not_converted: list[str]) -> dict:
    """quantization_config as the fp8 method or compressed-tensors writes it (checkpoints.quant_config)."""
    if quant_method == "fp8":
        quant = {"quant_method": "fp8", "fmt": "e4m3"}
        if fmt == "fp8_block":
            quant["weight_block_size"] = list(block)
        return {**quant, "activation_scheme": "dynamic", "modules_to_not_convert": not_converted}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": {"fp8_block": "block", "fp8_channel": "channel", "fp8_tensor": "tensor"}[fmt]}
    # per-tensor weights go with per-tensor (dynamic) activations: SGLang's compressed-tensors MoE
    # takes tensor/tensor, channel/token or block
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
              "strategy": "tensor" if fmt == "fp8_tensor" else "token"}
    if fmt == "fp8_block":
        weights["block_structure"] = list(block)
        inputs.update(strategy="group", group_size=block[1])
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
            "ignore": ignore_patterns(not_converted)}


def synthetic_config(
    family: str, fmt: str, num_layers: int, num_experts: int, hidden: int, inter: int, dense: int,
    quant: tuple[str, tuple[int, int]] | None, seed: int, shared_expert: bool = False, group_size: int | None = None
) -> dict:
    """config.json of a synthetic checkpoint of `family`, as that family's own writes it."""
    text = {
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "moe_intermediate_size": inter,
        "intermediate_size": inter,  # the dense layers' MLP
        **model.ATTENTION,
        "vocab_size": model.VOCAB,
        "max_position_embeddings": MAX_LENGTH,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eos_token_id": 0,  # checkpoints.tokenizer.EOS
        "torch_dtype": "bfloat16",
    }
    if family == "deepseek_v3":
        arch = "DeepseekV3ForCausalLM"
        text.update(
            n_routed_experts=num_experts,
            num_experts_per_tok=min(8, num_experts),
            first_k_dense_replace=dense,
            moe_layer_freq=1,
            n_shared_experts=model.shared_intermediate(family, fmt, inter, shared_expert) // inter,
            num_nextn_predict_layers=1,
            **model.MLA,
            n_group=1,
            topk_group=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            routed_scaling_factor=2.5,
            # YaRN as DeepSeek-V3 ships it (SGLang's CPU rotary embedding takes only this one), unscaled
            rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": MAX_LENGTH,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        )
        del text["head_dim"]
    else:
        arch = {
            "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen3_next": "Qwen3NextForCausalLM",
            "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
        }[family]
        text.update(
            num_experts=num_experts,
            num_experts_per_tok=min(8, num_experts),
            decoder_sparse_step=1,
            mlp_only_layers=list(range(dense)),
            norm_topk_prob=True,
        )
        if family != "qwen3_moe":
            text["shared_expert_intermediate_size"] = model.shared_intermediate(family, fmt, inter, shared_expert)
        if family in model.HYBRID:
            # transformers derives layer_types from the interval as SGLang does (no layer_types key:
            # transformers would refuse a num_hidden_layers edit before moetrace can name it)
            text.update(model.LINEAR_ATTENTION, full_attention_interval=model.FULL_ATTENTION_INTERVAL,
                        partial_rotary_factor=0.25,
                        # as transformers writes it (SGLang's Qwen3.5 reads its rope_type)
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if quant is not None:
        not_converted = model.unquantized_modules(shared_expert)
        quant = (_int4_quant_config(group_size, not_converted) if fmt == "int4"
                 else _quant_config(fmt, quant[0], quant[1], not_converted))
    if family == "qwen3_5_moe":
        cfg = {
            "architectures": [arch],
            "model_type": "qwen3_5_moe",
            "text_config": {**text, "model_type": "qwen3_5_moe_text"},
            "vision_config": {**model.VISION, "out_hidden_size": hidden},
            "tie_word_embeddings": False,
            **vision_token_ids(),
        }
    else:
        cfg = {"architectures": [arch], "model_type": family, **text}
    if quant:
        cfg["quantization_config"] = quant  # top level, as Qwen3.5 does too
    # Marks the checkpoint as synthetic, and puts the seed into config.json so
    # that Checkpoint.identity (config bytes + headers) differs between seeds.
    cfg["moetrace_synthetic"] = {"seed": seed, "values": "moetrace.checkpoints.synthetic.synthetic_values"}
    return cfg
