"""Two CPU paths SGLang 0.5.23 takes only where AMX is present (tests only; README.md here):
without AMX it runs Triton GPU code there, which fails on a CPU-only build. sitecustomize
applies each function here to its SGLang module right after that module has run as it is.
"""

from __future__ import annotations


def gated_norm_on_cpu(module) -> None:
    """kernels/ops/attention/fla/layernorm_gated.py: ``_use_cpu = is_cpu() and
    cpu_has_amx_support()`` sends the gated RMSNorm (Qwen3.5/Qwen3-Next DeltaNet output norm)
    to ``_layer_norm_fwd``, which asks torch.cuda for the SM count. Set from is_cpu() alone,
    the norm runs torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu (sgl_kernel/qwen3_5_ops.py)."""
    if module.is_cpu():
        module._use_cpu = True


def shared_expert_gate(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
    """final += sigmoid(hidden . gate_weight) * shared, per token: the gated shared expert
    (kernels/ops/elementwise/elementwise.py's fused_gate_sigmoid_mul_add), in float32."""
    import torch

    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())[:, None]
    final_hidden_states.copy_((final_hidden_states.float() + gate * shared_output.float())
                              .to(final_hidden_states.dtype))


def shared_gate_on_cpu(module) -> None:
    """srt/models/qwen2_moe.py takes its fused shared-expert gate unless the gate layer uses the
    AMX backend, and that is a Triton kernel: in this model module only, the name it calls
    becomes shared_expert_gate."""
    if module.is_cpu():
        module.fused_gate_sigmoid_mul_add = shared_expert_gate
