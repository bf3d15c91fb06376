"""The torch stand-ins for sgl_kernel's Qwen3.5 CPU ops (tests/support/sglang_cpu), held to an
independent implementation: transformers' own torch paths of the same model family
(Qwen3-Next's ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``, its
causal convolution, Qwen3.5's RMSNorm), on random inputs with several sequences, initial
states and grouped value heads. A stand-in that drifts from what the op computes would make
the real server's Qwen3.5 run pass on wrong arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

STAND_INS = Path(__file__).resolve().parent / "support" / "sglang_cpu"
transformers_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


@pytest.fixture(scope="module")
def ops():
    sys.path.insert(0, str(STAND_INS))
    try:
        import cpu_fixes
        from sgl_kernel import mamba, qwen3_5_ops
    finally:
        sys.path.remove(str(STAND_INS))
    assert Path(qwen3_5_ops.__file__).parent.parent == STAND_INS  # the stand-in, not a real sgl_kernel
    return qwen3_5_ops, mamba, cpu_fixes


H, HV, K, V = 2, 4, 16, 8
LENS = [5, 1, 9]  # three sequences, one of a single token


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    q, k = torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g)
    v = torch.randn(T, HV, V, generator=g)
    decay = -torch.rand(T, HV, generator=g) * 2  # log decay <= 0
    beta = torch.rand(T, HV, generator=g)
    return q, k, v, decay, beta


def test_delta_rule_matches_transformers_chunked(ops):
    """Each sequence from its own pool slot (one a padding row), states written back: equal to
    transformers' chunked form run per sequence from the same initial state."""
    qwen3_5_ops, mamba, _ = ops
    q, k, v, decay, beta = _inputs()
    states = torch.randn(6, HV, V, K) * 0.1  # the pool: [slots, HV, V, K]
    slots = torch.tensor([4, 1, 2])
    before = states.clone()
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(LENS), 0).tolist()])
    out, _, _ = mamba.chunk_gated_delta_rule_cpu(q[None], k[None], v[None], decay[None], beta[None], initial_state=states,
                                                 cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                                 initial_state_indices=slots)
    for n, slot in enumerate(slots.tolist()):
        a, b = cu[n].item(), cu[n + 1].item()
        rep = HV // H
        want, final = transformers_next.torch_chunk_gated_delta_rule(
            q[a:b].repeat_interleave(rep, 1)[None], k[a:b].repeat_interleave(rep, 1)[None], v[a:b][None],
            decay[a:b][None], beta[a:b][None], chunk_size=4, initial_state=before[slot].transpose(-1, -2)[None],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[0, a:b], want[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(states[slot], final[0].transpose(-1, -2), atol=2e-5, rtol=2e-5)
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(states[untouched], before[untouched])


def test_decode_gating_and_update_match_transformers(ops):
    """One decode token per request: the gates from a, b, dt_bias, A_log (transformers'
    Qwen3-Next formula), then one recurrent step; a negative slot is a padding row."""
    qwen3_5_ops, _, _ = ops
    g = torch.Generator().manual_seed(1)
    B = 3
    q, k, v = torch.randn(1, B, H, K, generator=g), torch.randn(1, B, H, K, generator=g), torch.randn(1, B, HV, V, generator=g)
    a, b = torch.randn(B, HV, generator=g), torch.randn(B, HV, generator=g)
    A_log, dt_bias = torch.rand(HV, generator=g).log(), torch.rand(HV, generator=g)
    states = torch.randn(5, HV, V, K, generator=g) * 0.1
    before = states.clone()
    slots = torch.tensor([3, -1, 0])
    out = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=states,
        initial_state_indices=slots, cu_seqlens=torch.arange(B + 1), use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0, softplus_threshold=20.0)
    decay = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # transformers' Qwen3NextGatedDeltaNet
    gate_g, gate_beta = torch.ops.sgl_kernel.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    torch.testing.assert_close(gate_g[0], decay)
    torch.testing.assert_close(gate_beta[0], b.sigmoid())
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        rep = HV // H
        want, final = transformers_next.torch_recurrent_gated_delta_rule(
            q[:, i:i + 1].repeat_interleave(rep, 2), k[:, i:i + 1].repeat_interleave(rep, 2), v[:, i:i + 1],
            decay[None, i:i + 1], b.sigmoid()[None, i:i + 1], initial_state=before[slot].transpose(-1, -2)[None],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[0, i], want[0, 0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(states[slot], final[0].transpose(-1, -2), atol=2e-5, rtol=2e-5)
    assert torch.equal(states[[1, 2, 4]], before[[1, 2, 4]])


def test_causal_conv_prefill_then_decode_matches_transformers(ops):
    """Prefill two sequences (one continuing from its conv state), then decode one token each:
    every output equals transformers' causal depthwise conv over the whole history, and the
    states hold the last width-1 inputs."""
    _, mamba, _ = ops
    g = torch.Generator().manual_seed(2)
    dim, width, lens = 6, 4, [5, 2]
    x = torch.randn(dim, sum(lens), generator=g)
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    states = torch.zeros(3, dim, width - 1)
    history = torch.randn(dim, 3, generator=g)  # sequence 1 already saw these inputs
    states[0] = history
    out = mamba.causal_conv1d_fn_cpu(x, weight, bias, query_start_loc=torch.tensor([0, 5, 7]),
                                     cache_indices=torch.tensor([2, 0]), has_initial_state=torch.tensor([False, True]),
                                     conv_states=states, activation="silu")
    step = torch.randn(2, dim, generator=g)
    out_step = mamba.causal_conv1d_update_cpu(step, states, weight, bias, "silu", conv_state_indices=torch.tensor([2, 0]))

    def reference(seq):  # transformers' Qwen3-Next causal conv over one whole sequence [dim, L]
        return F.silu(F.conv1d(seq[None], weight[:, None, :], bias, padding=width - 1, groups=dim)[0, :, :seq.shape[1]])

    seq0 = torch.cat([x[:, :5], step[0][:, None]], 1)
    seq1 = torch.cat([history, x[:, 5:], step[1][:, None]], 1)
    torch.testing.assert_close(out[:, :5], reference(seq0)[:, :5])
    torch.testing.assert_close(out_step[0], reference(seq0)[:, -1])
    torch.testing.assert_close(out[:, 5:], reference(seq1)[:, 3:5])
    torch.testing.assert_close(out_step[1], reference(seq1)[:, -1])
    torch.testing.assert_close(states[2], seq0[:, -3:])
    torch.testing.assert_close(states[0], seq1[:, -3:])


def test_attention_pieces_match_transformers(ops):
    """The full-attention layer's pieces: Gemma RMSNorm per head (transformers' Qwen3.5 norm),
    the query/gate split per head, the sigmoid output gate, the contiguous DeltaNet split."""
    qwen3_5_ops, _, _ = ops
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    g = torch.Generator().manual_seed(3)
    T, heads, kv, hd = 3, 2, 1, 8
    norm_q, norm_k = Qwen3_5MoeRMSNorm(hd, eps=1e-6), Qwen3_5MoeRMSNorm(hd, eps=1e-6)
    with torch.no_grad():
        norm_q.weight.normal_(generator=g)
        norm_k.weight.normal_(generator=g)
    q_gate, k = torch.randn(T, heads * 2 * hd, generator=g), torch.randn(T, kv * hd, generator=g)
    q, kk, gate = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_with_gate_cpu(
        q_gate, k, norm_q.weight.data, norm_k.weight.data, 1e-6, hd, heads)
    per_head = q_gate.view(T, heads, 2 * hd)
    with torch.no_grad():
        torch.testing.assert_close(q.view(T, heads, hd), norm_q(per_head[..., :hd]))
        torch.testing.assert_close(kk.view(T, kv, hd), norm_k(k.view(T, kv, hd)))
        q2, k2 = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu(per_head[..., :hd].reshape(T, -1), k,
                                                                  norm_q.weight.data, norm_k.weight.data, 1e-6, hd)
        torch.testing.assert_close(q2, q)
    torch.testing.assert_close(gate, per_head[..., hd:])
    x = torch.randn(T, heads * hd, generator=g)
    want = x * torch.sigmoid(gate.reshape(T, -1))
    torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(x, gate.reshape(T, -1))
    torch.testing.assert_close(x, want)
    nk, nv, dk, dv = 2, 4, 3, 5
    qkvz, ba = torch.randn(T, 2 * nk * dk + 2 * nv * dv, generator=g), torch.randn(T, 2 * nv, generator=g)
    mixed, z, b, a = torch.ops.sgl_kernel.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, nk, nv, dk, dv)
    qkv_dim = 2 * nk * dk + nv * dv
    assert torch.equal(mixed, qkvz[:, :qkv_dim]) and torch.equal(z.reshape(T, -1), qkvz[:, qkv_dim:])
    assert torch.equal(b, ba[:, :nv]) and torch.equal(a, ba[:, nv:])


def test_cpu_fixes_match_transformers(ops):
    """The two SGLang CPU paths that need AMX, stood in: the DeltaNet output norm equals
    transformers' Qwen3-Next gated RMSNorm; the shared-expert gate adds
    sigmoid(gate(hidden)) * shared as transformers' Qwen3-Next MoE block does."""
    _, _, cpu_fixes = ops
    g = torch.Generator().manual_seed(4)
    norm = transformers_next.Qwen3NextRMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    x, z = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    with torch.no_grad():
        want = norm(x, gate=z)
    torch.testing.assert_close(torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu(x, norm.weight.data, z, 1e-6), want)
    hidden, shared, routed = (torch.randn(3, 8, generator=g) for _ in range(3))
    gate = torch.nn.Linear(8, 1, bias=False)
    out = routed.clone()
    cpu_fixes.shared_expert_gate(hidden, gate.weight.data.squeeze(), shared, out)
    with torch.no_grad():
        torch.testing.assert_close(out, routed + torch.sigmoid(gate(hidden)) * shared)
    module = type("M", (), {"is_cpu": staticmethod(lambda: True), "_use_cpu": False})
    cpu_fixes.gated_norm_on_cpu(module)
    cpu_fixes.shared_gate_on_cpu(module)
    assert module._use_cpu is True and module.fused_gate_sigmoid_mul_add is cpu_fixes.shared_expert_gate
