"""A small Qwen3-MoE-shaped decoder whose MoE layers compute with real FP8 experts.

Module tree (as SGLang names it): ``model.embed_tokens``,
``model.layers.{L}.self_attn``, ``model.layers.{L}.mlp.gate`` (router),
``model.layers.{L}.mlp.experts`` (``EmulatedFusedMoE``: the resident
FusedMoE, its forward called on every pass so forward hooks fire),
``model.norm``, ``lm_head``. Non-expert weights are synthetic, deterministic
from a seed; expert weights are the rank's TP shards.

The experts' ``quant_method`` is a ``KTEPWrapperMethod`` like the fork's:
passes with at least ``gpu_prefill_token_threshold`` tokens (long prefill chunks) stage the whole
layer through ``SharedFullContext.load`` and compute with ``ctx.gpu_layer``;
shorter passes (decode) use the resident weights. The MoE block all-reduces
the rank's partial output over TP, so a wrong staged tensor on any rank
changes every rank's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.emulator.config import VOCAB_SIZE, WEIGHT_NAMES_FP8, ModelDims

HEAD_DIM = 64


class TopKOutput(NamedTuple):
    topk_weights: torch.Tensor  # [T, k] float32
    topk_ids: torch.Tensor  # [T, k] int64


def dequant_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 weight [N, K] times its 128x128 block scales [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]."""
    n, k = w.shape
    bn, bk = block
    s = scale_inv.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w.to(torch.float32) * s


def expert_weights(params: dict[str, torch.Tensor], e: int, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized (w13 [2*I_tp, H], w2 [H, I_tp]) of expert e."""
    return (dequant_block_fp8(params["w13_weight"][e], params["w13_weight_scale_inv"][e], block),
            dequant_block_fp8(params["w2_weight"][e], params["w2_weight_scale_inv"][e], block))


def fused_moe_partial(x: torch.Tensor, topk: TopKOutput, get_expert: Callable[[int], tuple]) -> torch.Tensor:
    """This rank's share of the MoE output: sum over routed experts of
    weight * (silu(gate) * up) @ down, over the rank's I_tp slice."""
    out = torch.zeros_like(x)
    ids, wts = topk.topk_ids, topk.topk_weights
    for e in torch.unique(ids).tolist():  # ascending: a fixed summation order
        tok, pos = (ids == e).nonzero(as_tuple=True)
        w13, w2 = get_expert(e)
        i_tp = w13.shape[0] // 2
        h = x[tok] @ w13.t()
        y = (F.silu(h[:, :i_tp]) * h[:, i_tp:]) @ w2.t()
        out.index_add_(0, tok, y * wts[tok, pos].unsqueeze(1))
    return out


def route(router_logits: torch.Tensor, top_k: int) -> TopKOutput:
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return TopKOutput(w / w.sum(dim=-1, keepdim=True), ids)


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ResidentMethod:
    """Quant method of a plain (non-KT) FusedMoE: always the resident weights."""

    def __init__(self, block):
        self.block = block
        self._cache: dict[tuple[int, int], tuple] = {}

    def resident_expert(self, layer: "EmulatedFusedMoE", e: int):
        key = (id(layer), e)
        if key not in self._cache:  # resident weights never change: dequantize once
            self._cache[key] = expert_weights(layer.expert_params(), e, self.block)
        return self._cache[key]

    def apply(self, layer: "EmulatedFusedMoE", x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        return fused_moe_partial(x, topk, lambda e: self.resident_expert(layer, e))


@dataclass(frozen=True)
class KTConfig:
    """What the fork's KTConfig says of staging (its field names): the hooks read it."""

    gpu_prefill_token_threshold: int
    chunked_prefill_size: int


@dataclass(frozen=True)
class ServerArgs:
    """The launch settings SGLang's ModelRunner keeps (its field names)."""

    model_path: str | None
    tp_size: int
    chunked_prefill_size: int
    kt_gpu_prefill_token_threshold: int


@dataclass
class EmulatedRunner:
    """What SGLang's hook manager is called from: the runner of `model` (hooks.registration
    reads it from the calling frame); no forward_pass_id counter (None)."""

    model: nn.Module
    server_args: ServerArgs
    forward_pass_id: int | None = None


class KTEPWrapperMethod(ResidentMethod):
    """The fork's wrapper: long passes stage the full layer, short ones stay resident.

    ``wrapper`` is rank 0's per-layer CPU-expert object (None elsewhere);
    ``full_context`` the global SharedFullContext; ``on_load(ctx, layer_idx)``
    is called after each staged load (snapshots and the load log). The threshold and
    the chunk size sit where the fork keeps them (``gpu_prefill_token_threshold``,
    ``kt_config.chunked_prefill_size``)."""

    def __init__(self, block, kt_config: KTConfig, full_context, wrapper=None, gpu_experts_mask=None,
                 logical_to_gpu_index=None, on_load=None):
        super().__init__(block)
        self.kt_config = kt_config
        self.gpu_prefill_token_threshold = kt_config.gpu_prefill_token_threshold
        self.full_context = full_context
        self.wrapper = wrapper
        self.gpu_experts_mask = gpu_experts_mask
        self.logical_to_gpu_index = logical_to_gpu_index
        self.on_load = on_load

    def apply(self, layer, x, topk):
        if x.shape[0] < self.gpu_prefill_token_threshold or self.full_context is None:
            return super().apply(layer, x, topk)
        ctx = self.full_context
        # Looked up on the class at call time, so a wrapper installed on
        # SharedFullContext.load (moetrace's KT capture) sees every load.
        ctx.load(layer.layer_id, self.wrapper, layer, self.gpu_experts_mask, self.logical_to_gpu_index)
        if self.on_load is not None:
            self.on_load(ctx, layer.layer_id)
        params = ctx.gpu_layer.expert_params()
        return fused_moe_partial(x, topk, lambda e: expert_weights(params, e, self.block))


class EmulatedFusedMoE(nn.Module):
    """FusedMoE-like module: stacked FP8 block expert params ``[E, ...]`` of one TP rank."""

    def __init__(self, layer_id: int, num_experts: int, hidden: int, i_tp: int, block, tp_rank: int, tp_size: int,
                 device=None, quant_method=None):
        super().__init__()
        bn, bk = block
        self.layer_id = layer_id
        self.num_experts = self.num_local_experts = num_experts
        self.hidden_size = hidden
        self.intermediate_size_per_partition = i_tp
        self.moe_tp_rank, self.moe_tp_size = tp_rank, tp_size
        self.moe_ep_rank, self.moe_ep_size = 0, 1
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight_block_size = list(block)
        # As SGLang's FusedMoE on the Triton runner says it (the trace records it: hooks.layout_facts)
        self.use_flashinfer_trtllm_moe = self.use_triton_kernels = False
        shapes = {
            "w13_weight": ((num_experts, 2 * i_tp, hidden), torch.float8_e4m3fn),
            "w13_weight_scale_inv": ((num_experts, 2 * -(-i_tp // bn), -(-hidden // bk)), torch.float32),
            "w2_weight": ((num_experts, hidden, i_tp), torch.float8_e4m3fn),
            "w2_weight_scale_inv": ((num_experts, -(-hidden // bn), -(-i_tp // bk)), torch.float32),
        }
        for name, (shape, dtype) in shapes.items():
            zeros = torch.zeros(shape, dtype=dtype, device=device)
            self.register_parameter(name, nn.Parameter(zeros, requires_grad=False))
        self.quant_method = quant_method

    def expert_params(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n).data for n in WEIGHT_NAMES_FP8}

    def load_shards(self, shards: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n in WEIGHT_NAMES_FP8:
                getattr(self, n).copy_(shards[n])

    def forward(self, hidden_states: torch.Tensor, topk_output: TopKOutput) -> torch.Tensor:
        return self.quant_method.apply(self, hidden_states, topk_output)

    def extra_repr(self) -> str:
        return (f"layer_id={self.layer_id}, num_experts={self.num_experts}, hidden={self.hidden_size}, "
                f"I_tp={self.intermediate_size_per_partition}, moe_tp_rank={self.moe_tp_rank}/{self.moe_tp_size}")


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


class Router(nn.Module):
    def __init__(self, g: torch.Generator, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(_randn(g, num_experts, hidden, scale=1 / math.sqrt(hidden)), requires_grad=False)

    def forward(self, x):
        return x @ self.weight.t()


class SparseMoeBlock(nn.Module):
    """Router + experts; ``all_reduce`` sums the TP partial outputs (in place);
    the reduced output is RMS-normalized (see forward)."""

    def __init__(self, gate: Router, experts: nn.Module, top_k: int, all_reduce: Callable[[torch.Tensor], None]):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.top_k = top_k
        self._all_reduce = all_reduce

    def forward(self, x):
        y = self.experts(x, route(self.gate(x), self.top_k))
        self._all_reduce(y)
        # Synthetic FP8 experts have arbitrary magnitudes: normalized, the MoE
        # output neither drowns the residual stream nor vanishes in it.
        return rms_norm(y)


class ReferenceExperts(nn.Module):
    """Reference (no transport): every rank's shards in one module; the TP
    all-reduce becomes a rank-ordered sum (bit-equal to gloo's for TP2)."""

    def __init__(self, per_rank: list[dict[str, torch.Tensor]], block):
        super().__init__()
        self.per_rank = per_rank
        self.block = block
        self._cache: dict[tuple[int, int], tuple] = {}

    def _expert(self, r: int, e: int):
        if (r, e) not in self._cache:
            self._cache[(r, e)] = expert_weights(self.per_rank[r], e, self.block)
        return self._cache[(r, e)]

    def forward(self, x, topk):
        out = None
        for r in range(len(self.per_rank)):
            part = fused_moe_partial(x, topk, lambda e, r=r: self._expert(r, e))
            out = part if out is None else out + part
        return out


class DenseMLP(nn.Module):
    """Stand-in for a dense (non-MoE) layer's MLP; replicated on every rank."""

    def __init__(self, g, hidden: int):
        super().__init__()
        self.up = nn.Parameter(_randn(g, 4 * hidden, hidden, scale=1 / math.sqrt(hidden)), requires_grad=False)
        self.down = nn.Parameter(_randn(g, hidden, 4 * hidden, scale=1 / math.sqrt(4 * hidden)), requires_grad=False)

    def forward(self, x):
        return F.silu(x @ self.up.t()) @ self.down.t()


class KVCache:
    """Per-request keys and values of every layer (the prefix cache stores these)."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[0]

    def truncated(self, n: int) -> "KVCache":
        out = KVCache(len(self.k))
        out.k = [None if t is None or n == 0 else t[:n].clone() for t in self.k]
        out.v = [None if t is None or n == 0 else t[:n].clone() for t in self.v]
        return out


class Attention(nn.Module):
    """Single-head causal attention over the KV cache; replicated on every rank."""

    def __init__(self, g, hidden: int, layer_idx: int):
        super().__init__()
        d = min(HEAD_DIM, hidden)
        s = 1 / math.sqrt(hidden)
        self.layer_idx = layer_idx
        self.q_proj = nn.Parameter(_randn(g, d, hidden, scale=s), requires_grad=False)
        self.k_proj = nn.Parameter(_randn(g, d, hidden, scale=s), requires_grad=False)
        self.v_proj = nn.Parameter(_randn(g, d, hidden, scale=s), requires_grad=False)
        self.o_proj = nn.Parameter(_randn(g, hidden, d, scale=1 / math.sqrt(d)), requires_grad=False)

    def forward(self, x, kv: KVCache, start: int):
        q, k, v = x @ self.q_proj.t(), x @ self.k_proj.t(), x @ self.v_proj.t()
        L = self.layer_idx
        K = k if kv.k[L] is None else torch.cat([kv.k[L], k])
        V = v if kv.v[L] is None else torch.cat([kv.v[L], v])
        kv.k[L], kv.v[L] = K, V
        scores = (q @ K.t()) / math.sqrt(q.shape[-1])
        qpos = torch.arange(start, start + x.shape[0], device=x.device).unsqueeze(1)
        kpos = torch.arange(K.shape[0], device=x.device).unsqueeze(0)
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ V) @ self.o_proj.t()


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp

    def forward(self, h, kv, start):
        h = h + self.self_attn(rms_norm(h), kv, start)
        return h + self.mlp(rms_norm(h))


class Decoder(nn.Module):
    def __init__(self, embed: torch.Tensor, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Identity()  # RMSNorm without weight, applied in forward

    def forward(self, ids, kv, start):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h, kv, start)
        return self.norm(rms_norm(h))


class EmulatedMoeForCausalLM(nn.Module):
    """``model`` (the decoder) + ``lm_head``; forward(ids, kv, start) -> logits [T, V]."""

    def __init__(self, decoder: Decoder, lm_head: torch.Tensor):
        super().__init__()
        self.model = decoder
        self.lm_head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head)
        self.lm_head.weight.requires_grad_(False)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, kv: KVCache, start: int) -> torch.Tensor:
        return self.lm_head(self.model(ids, kv, start)).float()


def build_model(dims: ModelDims, seed: int, make_experts: Callable[[int], nn.Module],
                all_reduce: Callable[[torch.Tensor], None], device) -> EmulatedMoeForCausalLM:
    """The decoder with synthetic non-expert weights from ``seed`` (identical on
    every rank and in the reference); ``make_experts(layer)`` builds each MoE
    layer's experts module."""
    g = torch.Generator().manual_seed(seed)
    H = dims.hidden
    embed = _randn(g, VOCAB_SIZE, H)
    layers = []
    for L in range(dims.num_layers):
        attn = Attention(g, H, L)
        if L in dims.moe_layers:
            mlp = SparseMoeBlock(Router(g, H, dims.num_experts), make_experts(L), dims.top_k, all_reduce)
        else:
            mlp = DenseMLP(g, H)
        layers.append(DecoderLayer(attn, mlp))
    lm_head = _randn(g, VOCAB_SIZE, H, scale=1 / math.sqrt(H))
    return EmulatedMoeForCausalLM(Decoder(embed, layers), lm_head).to(device)
