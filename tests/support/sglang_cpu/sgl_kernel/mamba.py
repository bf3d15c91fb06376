"""sgl_kernel.mamba's CPU functions, imported by SGLang 0.5.23's GDN backend at module import
and called on its CPU path (tests only; ../README.md), in plain torch: the causal depthwise
convolution over the DeltaNet's q/k/v with its per-request conv state, and the chunked gated
delta rule of prefill. Each is written from what it computes, as SGLang's own references
define it (``layers/attention/mamba/causal_conv1d.py``'s docstrings, ``fla/fused_recurrent.py``),
token by token in float32: correctness, not speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_kernel.qwen3_5_ops import run_delta_rule


def _activate(x: torch.Tensor, activation) -> torch.Tensor:
    return F.silu(x) if activation in ("silu", "swish", True) else x


def causal_conv1d_fn_cpu(x, weight, bias=None, query_start_loc=None, cache_indices=None, has_initial_state=None,
                         conv_states=None, activation="silu", pad_slot_id=-1, **kwargs):
    """Prefill. x [dim, tokens] (sequences one after another, bounds query_start_loc),
    weight [dim, width]: out[:, t] = act(bias + sum_j weight[:, j] * window[:, t + j]) over the
    sequence prefixed by its conv state (zeros unless has_initial_state); the sequence's last
    width-1 inputs become conv_states[cache_indices[n]] ([dim, width-1])."""
    width = weight.shape[1]
    out = torch.empty_like(x)
    bounds = query_start_loc.tolist()
    slots = cache_indices.tolist()
    initial = has_initial_state.tolist() if has_initial_state is not None else [False] * len(slots)
    w = weight.float()
    for n in range(len(bounds) - 1):
        start, end, slot = bounds[n], bounds[n + 1], slots[n]
        if slot == pad_slot_id or end <= start:
            continue
        seq = x[:, start:end].float()
        prefix = conv_states[slot].float() if initial[n] else torch.zeros(x.shape[0], width - 1)
        window = torch.cat([prefix, seq], dim=1)  # [dim, width-1+len]
        y = sum(w[:, j:j + 1] * window[:, j:j + seq.shape[1]] for j in range(width))
        if bias is not None:
            y = y + bias.float()[:, None]
        out[:, start:end] = _activate(y, activation).to(x.dtype)
        conv_states[slot] = window[:, -(width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None, pad_slot_id=-1, **kwargs):
    """Decode. x [batch, dim] (or [batch, dim, steps]): each step's input joins its request's
    conv state (conv_state[conv_state_indices[i]], [dim, width-1]), the window is convolved
    as above, and the state keeps the newest width-1 inputs."""
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    out = torch.empty_like(xs)
    width = weight.shape[1]
    w = weight.float()
    slots = conv_state_indices.tolist() if conv_state_indices is not None else list(range(xs.shape[0]))
    for i, slot in enumerate(slots[:xs.shape[0]]):
        if slot == pad_slot_id:
            out[i] = 0
            continue
        state = conv_state[slot].float()  # [dim, state_len], state_len >= width-1
        for t in range(xs.shape[2]):
            step = xs[i, :, t:t + 1].float()
            window = torch.cat([state[:, state.shape[1] - (width - 1):], step], dim=1)  # [dim, width]
            y = (window * w).sum(-1) + (bias.float() if bias is not None else 0.0)
            out[i, :, t] = _activate(y, activation).to(x.dtype)
            state = torch.cat([state[:, 1:], step], dim=1)
        conv_state[slot] = state.to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first=False,
                               use_qk_l2norm_in_kernel=False, initial_state_indices=None, **kwargs):
    """Prefill of the gated delta rule (the chunked form computes the same recurrence):
    q, k [1, T, H, K], v [1, T, HV, V], g (log decay) and beta [1, T, HV]; each sequence
    starts from initial_state[initial_state_indices[n]] ([HV, V, K]), which is updated in
    place. Returns (output [1, T, HV, V], None, None): the state is already written back."""
    assert not head_first, "head_first layouts are not stood in"
    out = run_delta_rule(q[0], k[0], v[0], g[0], beta[0], initial_state, initial_state_indices, cu_seqlens,
                         use_qk_l2norm_in_kernel)
    return out.unsqueeze(0).to(v.dtype), None, None
