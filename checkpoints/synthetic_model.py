"""Everything of a synthetic checkpoint that is not a routed expert: attention, norms,
embeddings, the router, shared experts, dense MLPs and Qwen3.5's vision tower, with the
names and shapes transformers' ``save_pretrained`` writes (transformers 5.19) and SGLang's
model classes load (0.5.23), so a real server builds the whole model from the folder.

Sizes are fixed and small (the config carries them, checkpoints.synthetic_config); only
hidden_size, the expert sizes and the layer count come from the writer's arguments. Values
keep a forward pass finite: projections N(0, 0.02), norms at their identity (1, or 0 where
the norm scales by 1 + weight), Qwen3-Next's decay parameters as transformers initializes
them. tests/test_synthetic_model.py holds the names and shapes to transformers' own classes
and SGLang's own loader.
"""

from __future__ import annotations

import math
import re

import torch

VOCAB = 512  # checkpoints.tokenizer.VOCAB_SIZE
# Full attention (Qwen): head_dim 32 is the smallest vLLM's CPU attention takes.
ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
# Gated DeltaNet (Qwen3-Next, Qwen3.5 linear_attention layers); every other layer is full attention.
LINEAR_ATTENTION = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
FULL_ATTENTION_INTERVAL = 2
# Multi-head latent attention (DeepSeek-V3)
MLA = {"num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
       "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16}
# Qwen3.5's vision tower, as small as transformers builds it
VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32, "num_position_embeddings": 16,
          "patch_size": 4, "spatial_merge_size": 1, "temporal_patch_size": 1, "in_channels": 3,
          "deepstack_visual_indexes": []}
STD = 0.02
# Norms that scale by (1 + weight): identity at 0 (Qwen3-Next and Qwen3.5 decoders)
ZERO_CENTERED_NORMS = ("qwen3_next", "qwen3_5_moe")
HYBRID = ("qwen3_next", "qwen3_5_moe")  # linear and full attention layers


def layer_types(family: str, num_layers: int) -> list[str] | None:
    """Which attention each layer has, as transformers and SGLang derive it from
    full_attention_interval."""
    if family not in HYBRID:
        return None
    return ["full_attention" if (L + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for L in range(num_layers)]


def shared_intermediate(family: str, fmt: str, intermediate: int, shared_expert: bool) -> int:
    """The shared expert's intermediate size. shared_expert=True: the routed one (it is then
    written as expert id num_experts, and moetrace indexes it). Otherwise it must never be
    taken for a routed expert's twin (checkpoints.extra.shared_expert_count compares dtype
    and shape): a BF16 shared expert in an FP8 checkpoint differs by dtype already; else half
    the routed size (twice when that is odd), and for DeepSeek, whose size is
    n_shared_experts x moe_intermediate_size, two shared experts' worth."""
    if shared_expert or (family == "deepseek_v3" and fmt != "bf16"):
        return intermediate
    if family == "deepseek_v3":
        return 2 * intermediate
    return intermediate // 2 if intermediate % 2 == 0 else 2 * intermediate


class ModelTensors:
    """Adds the non-expert tensors of one family to `tensors` (name -> tensor, write order)."""

    def __init__(self, family: str, tensors: dict, hidden: int, intermediate: int, generator: torch.Generator):
        self.family, self.tensors, self.H, self.I, self.g = family, tensors, hidden, intermediate, generator
        self.norm_identity = 0.0 if family in ZERO_CENTERED_NORMS else 1.0

    def linear(self, name: str, out_dim: int, in_dim: int) -> None:
        self.tensors[name] = (torch.randn(out_dim, in_dim, generator=self.g) * STD).to(torch.bfloat16)

    def norm(self, name: str, dim: int, value: float | None = None) -> None:
        value = self.norm_identity if value is None else value
        self.tensors[name] = torch.full((dim,), value, dtype=torch.bfloat16)

    def mlp(self, pre: str, intermediate: int) -> None:
        """{gate,up,down}_proj of a BF16 MLP (a dense layer's, or a shared expert's)."""
        self.linear(f"{pre}.gate_proj.weight", intermediate, self.H)
        self.linear(f"{pre}.up_proj.weight", intermediate, self.H)
        self.linear(f"{pre}.down_proj.weight", self.H, intermediate)

    # ------------------------------------------------------------------ one decoder layer

    def layer_attention(self, pre: str, L: int, num_layers: int) -> None:
        """The layer's input norm and attention (before its MLP, in transformers' order)."""
        self.norm(f"{pre}.input_layernorm.weight", self.H)
        if self.family == "deepseek_v3":
            self._mla(f"{pre}.self_attn")
        elif self.family in HYBRID and layer_types(self.family, num_layers)[L] == "linear_attention":
            self._gated_delta_net(f"{pre}.linear_attn")
        else:
            self._attention(f"{pre}.self_attn", gated=self.family in HYBRID)
        self.norm(f"{pre}.post_attention_layernorm.weight", self.H)

    def router(self, pre: str, num_experts: int) -> None:
        self.linear(f"{pre}.mlp.gate.weight", num_experts, self.H)
        if self.family == "deepseek_v3":  # float32, as DeepSeek-V3 ships it
            self.tensors[f"{pre}.mlp.gate.e_score_correction_bias"] = torch.zeros(num_experts)
        elif self.family in HYBRID:
            self.linear(f"{pre}.mlp.shared_expert_gate.weight", 1, self.H)

    def _attention(self, pre: str, gated: bool) -> None:
        heads, kv, hd = ATTENTION["num_attention_heads"], ATTENTION["num_key_value_heads"], ATTENTION["head_dim"]
        self.linear(f"{pre}.q_proj.weight", heads * hd * (2 if gated else 1), self.H)  # gated: query, then gate
        self.linear(f"{pre}.k_proj.weight", kv * hd, self.H)
        self.linear(f"{pre}.v_proj.weight", kv * hd, self.H)
        self.linear(f"{pre}.o_proj.weight", self.H, heads * hd)
        self.norm(f"{pre}.q_norm.weight", hd)
        self.norm(f"{pre}.k_norm.weight", hd)

    def _gated_delta_net(self, pre: str) -> None:
        a = LINEAR_ATTENTION
        nk, nv, dk, dv = (a["linear_num_key_heads"], a["linear_num_value_heads"], a["linear_key_head_dim"],
                          a["linear_value_head_dim"])
        qkv = 2 * nk * dk + nv * dv
        if self.family == "qwen3_next":
            self.linear(f"{pre}.in_proj_qkvz.weight", qkv + nv * dv, self.H)
            self.linear(f"{pre}.in_proj_ba.weight", 2 * nv, self.H)
        else:  # Qwen3.5 splits the input projection four ways
            self.linear(f"{pre}.in_proj_qkv.weight", qkv, self.H)
            self.linear(f"{pre}.in_proj_z.weight", nv * dv, self.H)
            self.linear(f"{pre}.in_proj_b.weight", nv, self.H)
            self.linear(f"{pre}.in_proj_a.weight", nv, self.H)
        kernel = a["linear_conv_kernel_dim"]
        self.tensors[f"{pre}.conv1d.weight"] = (torch.randn(qkv, 1, kernel, generator=self.g) / math.sqrt(kernel)
                                                ).to(torch.bfloat16)
        self.tensors[f"{pre}.dt_bias"] = torch.ones(nv, dtype=torch.bfloat16)
        # A = exp(A_log) in (0, 16], as transformers initializes it: the per-head decay rate
        decay = torch.rand(nv, generator=self.g) * 15.99 + 0.01
        self.tensors[f"{pre}.A_log"] = decay.log().to(torch.bfloat16)
        self.norm(f"{pre}.norm.weight", dv, 1.0)  # a gated RMSNorm: plain weight
        self.linear(f"{pre}.out_proj.weight", self.H, nv * dv)

    def _mla(self, pre: str) -> None:
        m = MLA
        heads, qk = m["num_attention_heads"], m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
        self.linear(f"{pre}.q_a_proj.weight", m["q_lora_rank"], self.H)
        self.norm(f"{pre}.q_a_layernorm.weight", m["q_lora_rank"])
        self.linear(f"{pre}.q_b_proj.weight", heads * qk, m["q_lora_rank"])
        self.linear(f"{pre}.kv_a_proj_with_mqa.weight", m["kv_lora_rank"] + m["qk_rope_head_dim"], self.H)
        self.norm(f"{pre}.kv_a_layernorm.weight", m["kv_lora_rank"])
        self.linear(f"{pre}.kv_b_proj.weight", heads * (m["qk_nope_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"])
        self.linear(f"{pre}.o_proj.weight", self.H, heads * m["v_head_dim"])

    # ------------------------------------------------------------------ the model's ends

    def embeddings(self, prefix: str) -> None:
        self.linear(f"{prefix}.embed_tokens.weight", VOCAB, self.H)

    def head(self, prefix: str) -> None:
        self.norm(f"{prefix}.norm.weight", self.H)
        self.linear("lm_head.weight", VOCAB, self.H)

    def vision_tower(self) -> None:
        """Qwen3.5's vision encoder (model.visual.*): one block and the patch merger."""
        v, pre = VISION, "model.visual"
        d, p, t = v["hidden_size"], v["patch_size"], v["temporal_patch_size"]
        merged = d * v["spatial_merge_size"] ** 2

        def linear_bias(name, out_dim, in_dim):
            self.linear(f"{name}.weight", out_dim, in_dim)
            self.tensors[f"{name}.bias"] = torch.zeros(out_dim, dtype=torch.bfloat16)

        def layer_norm(name, dim):
            self.norm(f"{name}.weight", dim, 1.0)
            self.tensors[f"{name}.bias"] = torch.zeros(dim, dtype=torch.bfloat16)

        self.tensors[f"{pre}.patch_embed.proj.weight"] = (
            torch.randn(d, v["in_channels"], t, p, p, generator=self.g) * STD).to(torch.bfloat16)
        self.tensors[f"{pre}.patch_embed.proj.bias"] = torch.zeros(d, dtype=torch.bfloat16)
        self.linear(f"{pre}.pos_embed.weight", v["num_position_embeddings"], d)
        for b in range(v["depth"]):
            blk = f"{pre}.blocks.{b}"
            layer_norm(f"{blk}.norm1", d)
            linear_bias(f"{blk}.attn.qkv", 3 * d, d)
            linear_bias(f"{blk}.attn.proj", d, d)
            layer_norm(f"{blk}.norm2", d)
            linear_bias(f"{blk}.mlp.linear_fc1", v["intermediate_size"], d)
            linear_bias(f"{blk}.mlp.linear_fc2", d, v["intermediate_size"])
        layer_norm(f"{pre}.merger.norm", d)
        linear_bias(f"{pre}.merger.linear_fc1", merged, merged)
        linear_bias(f"{pre}.merger.linear_fc2", self.H, merged)


def unquantized_modules(shared_expert: bool) -> list[str]:
    """The modules an FP8 checkpoint leaves in BF16: everything but the routed experts (and
    the shared expert when it is written in their format), as dotted module-name components,
    so they match SGLang's module paths whatever prefix a family's model class gives them
    (Qwen3.5 drops ``self_attn`` and ``language_model``)."""
    names = ["lm_head", "embed_tokens", "visual", "self_attn", "attn", "linear_attn",
             # attention projections as SGLang names them where no self_attn module holds them
             "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj",
             "mlp.gate", "shared_expert_gate", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate_up_proj"]
    return names if shared_expert else names + ["shared_expert", "shared_experts"]


def ignore_patterns(components: list[str]) -> list[str]:
    """compressed-tensors' ``ignore`` for those components: a plain entry there matches a
    whole layer name or its dotted suffix only, so each becomes a regex over any path
    holding the component."""
    return ["re:(.*\\.)?" + re.escape(c) + "(\\..*)?$" for c in components]
