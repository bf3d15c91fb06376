"""The sgl_kernel CPU ops SGLang 0.5.23's Qwen3.5 (and Qwen3-Next) code binds at module import
and calls on its CPU path (tests only; ../README.md), in plain torch.

``models/qwen3_5.py`` binds ``torch.ops.sgl_kernel.*_cpu`` names when it is imported, the GDN
backend (``layers/attention/linear/gdn_backend.py``, ``kernels/gdn_triton.py``) two more. Each
op here is written from what the op computes, as SGLang's own non-CPU paths define it (the
file named in each docstring), in float32, for correctness rather than speed. None is AMX's
``convert_weight_packed``, so SGLang still sees no AMX kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LIB = None  # the library the ops live in (kept alive for the process)


def _gemma_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * (1 + weight) over the last dim (GemmaRMSNorm.forward_native)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def fused_sigmoid_mul_cpu(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x *= sigmoid(gate), in place: the attention output gate (qwen3_5.py fused_sigmoid_mul)."""
    x.copy_((x.float() * torch.sigmoid(gate.float().reshape(x.shape))).to(x.dtype))


def fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps: float, head_dim: int):
    """Per-head Gemma RMSNorm of q and k, as [tokens*heads, head_dim] (qwen3_5.py _apply_qk_norm)."""
    return (_gemma_rms(q.reshape(-1, head_dim), q_weight, eps),
            _gemma_rms(k.reshape(-1, head_dim), k_weight, eps))


def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_weight, k_weight, eps: float, head_dim: int,
                                         num_heads: int):
    """q_gate [T, heads * 2 * head_dim] holds, per head, the query then its gate: split them,
    Gemma-RMSNorm q and k per head (qwen3_5.py forward_prepare_native). Returns q
    [T*heads, head_dim], k [T*kv_heads, head_dim], gate [T, heads, head_dim]."""
    tokens = q_gate.shape[0]
    q, gate = torch.chunk(q_gate.reshape(tokens, num_heads, 2 * head_dim), 2, dim=-1)
    return (_gemma_rms(q.reshape(-1, head_dim), q_weight, eps), _gemma_rms(k.reshape(-1, head_dim), k_weight, eps),
            gate.contiguous())


def fused_rmsnorm_gated_cpu(x, weight, z, eps: float):
    """The DeltaNet output norm, norm before gate: x / rms(x) * weight * silu(z) over the last
    dim (fla/layernorm_gated.py, RMSNorm.forward's docstring and its reference path)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(z.float().reshape(y.shape))).to(x.dtype)


def fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, num_q_heads: int, num_v_heads: int, head_q_dim: int,
                                                  head_v_dim: int):
    """Qwen3.5's contiguous projections [q | k | v | z] and [b | a] split into mixed_qkv,
    z [T, v_heads, head_v], b and a [T, v_heads] (triton_gdn_fused_proj.py, its docstring)."""
    qkv_dim = 2 * num_q_heads * head_q_dim + num_v_heads * head_v_dim
    tokens = qkvz.shape[0]
    mixed_qkv = qkvz[:, :qkv_dim].contiguous()
    z = qkvz[:, qkv_dim:qkv_dim + num_v_heads * head_v_dim].reshape(tokens, num_v_heads, head_v_dim).contiguous()
    return mixed_qkv, z, ba[:, :num_v_heads].contiguous(), ba[:, num_v_heads:2 * num_v_heads].contiguous()


def _gates(A_log, a, dt_bias, beta_softplus: float = 1.0, threshold: float = 20.0):
    """g = -exp(A_log) * softplus(a + dt_bias) (the decay's log), float32."""
    x = a.float() + dt_bias.float()
    softplus = torch.where(beta_softplus * x <= threshold, torch.log1p(torch.exp(beta_softplus * x)) / beta_softplus, x)
    return -torch.exp(A_log.float()) * softplus


def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """(g, beta) as [1, T, v_heads] float32: g as above, beta = sigmoid(b)
    (kernels/ops/attention/linear/fused_gdn_gating.py)."""
    return _gates(A_log, a, dt_bias).unsqueeze(0), torch.sigmoid(b.float()).unsqueeze(0)


def fused_input_proj_cpu(hidden, w_qkvz, w_ba, packed: bool):
    """The two input projections of a DeltaNet layer, hidden @ w.T each (qwen3_5.py
    _forward_input_proj's unfused branch). Weights here are never AMX-packed: `packed` is moot."""
    return F.linear(hidden, w_qkvz), F.linear(hidden, w_ba)


def delta_rule_step(state, q, k, v, g, beta):
    """One token of the gated delta rule for one sequence, every value head at once
    (fla/fused_recurrent.py): state [HV, V, K] float32 decays by exp(g), v is corrected by
    beta * (v - state k), state += v' k^T, and the output is state q. q, k: [HV, K], already
    normalized and scaled; v: [HV, V]; g, beta: [HV]."""
    state = state * torch.exp(g)[:, None, None]
    v_new = beta[:, None] * (v - torch.einsum("hvk,hk->hv", state, k))
    state = state + v_new[:, :, None] * k[:, None, :]
    return state, torch.einsum("hvk,hk->hv", state, q)


def prepare_qk(q, k, num_v_heads: int, l2norm: bool):
    """q, k [T, H, K] -> float32 [T, HV, K]: L2-normalized (eps 1e-6 under the root) when the
    kernel does it, q scaled by K^-1/2, each key head shared by HV/H value heads."""
    q, k = q.float(), k.float()
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    groups = num_v_heads // q.shape[1]
    return q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)


def run_delta_rule(q, k, v, g, beta, states, indices, cu_seqlens, l2norm: bool):
    """The gated delta rule over variable-length sequences: q, k [T, H, K], v [T, HV, V],
    g, beta [T, HV]; sequence n is rows cu_seqlens[n]:cu_seqlens[n+1], its state
    states[indices[n]] ([HV, V, K]), read as the initial state and written back in place
    (a negative index is a padding row: skipped). Returns the output [T, HV, V]."""
    num_v_heads = v.shape[1]
    qf, kf = prepare_qk(q, k, num_v_heads, l2norm)
    out = torch.zeros(v.shape, dtype=torch.float32)
    bounds = cu_seqlens.tolist()
    for n, slot in enumerate(indices.tolist()[:len(bounds) - 1]):
        if slot < 0:
            continue
        state = states[slot].float()
        for t in range(bounds[n], bounds[n + 1]):
            state, out[t] = delta_rule_step(state, qf[t], kf[t], v[t].float(), g[t].float(), beta[t].float())
        states[slot] = state.to(states.dtype)
    return out


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel: bool,
                                               softplus_beta: float, softplus_threshold: float):
    """Decode: the gates from a, b (as fused_gdn_gating), then the delta rule with the pool's
    states updated in place (linear/fused_sigmoid_gating_recurrent.py). q, k [1, T, H, K],
    v [1, T, HV, V], a, b [T, HV]; returns [1, T, HV, V] in v's dtype."""
    g = _gates(A_log, a, dt_bias, softplus_beta, softplus_threshold).reshape(v.shape[1], -1)
    beta = torch.sigmoid(b.float()).reshape(v.shape[1], -1)
    out = run_delta_rule(q[0], k[0], v[0], g, beta, initial_state_source, initial_state_indices, cu_seqlens,
                         use_qk_l2norm_in_kernel)
    return out.unsqueeze(0).to(v.dtype)


SCHEMAS = {
    "fused_sigmoid_mul_cpu": ("(Tensor(a!) x, Tensor gate) -> ()", fused_sigmoid_mul_cpu),
    "fused_qk_gemma_rmsnorm_cpu": (
        "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) -> (Tensor, Tensor)",
        fused_qk_gemma_rmsnorm_cpu),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim, int num_heads)"
        " -> (Tensor, Tensor, Tensor)", fused_qk_gemma_rmsnorm_with_gate_cpu),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "(Tensor qkvz, Tensor ba, int num_q_heads, int num_v_heads, int head_q_dim, int head_v_dim)"
        " -> (Tensor, Tensor, Tensor, Tensor)", fused_qkvzba_split_reshape_cat_contiguous_cpu),
    "fused_rmsnorm_gated_cpu": ("(Tensor x, Tensor weight, Tensor z, float eps) -> Tensor", fused_rmsnorm_gated_cpu),
    "fused_gdn_gating_cpu": ("(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
                             fused_gdn_gating_cpu),
    "fused_input_proj_cpu": ("(Tensor hidden, Tensor w_qkvz, Tensor w_ba, bool packed) -> (Tensor, Tensor)",
                             fused_input_proj_cpu),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, "
        "Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens, "
        "bool use_qk_l2norm_in_kernel, float softplus_beta, float softplus_threshold) -> Tensor",
        fused_sigmoid_gating_delta_rule_update_cpu),
}


def register() -> None:
    """Define the ops once per process (nothing when something already defined them)."""
    global LIB
    if LIB is not None or hasattr(torch.ops.sgl_kernel, "fused_sigmoid_mul_cpu"):
        return
    LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, (schema, fn) in SCHEMAS.items():
        LIB.define(name + schema)
        LIB.impl(name, fn, "CPU")
