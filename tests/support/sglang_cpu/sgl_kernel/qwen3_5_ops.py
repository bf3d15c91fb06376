"""The sgl_kernel CPU ops SGLang 0.5.23's Qwen3.5 / Qwen3-Next code reads at module import
(tests only; ../README.md): ``models/qwen3_5.py`` binds four ``torch.ops.sgl_kernel.*_cpu``
names when it is imported, and ``layers/attention/linear/gdn_backend.py`` one more plus
``sgl_kernel.mamba``. Their schemas are registered here, so those modules import and the
model classes can be built and loaded; none is AMX's ``convert_weight_packed``, so SGLang
still sees no AMX kernels. A forward pass through them is not stood in: each raises.
"""

from __future__ import annotations

import torch

SCHEMAS = {
    "fused_sigmoid_mul_cpu": "(Tensor(a!) x, Tensor gate) -> ()",
    "fused_qk_gemma_rmsnorm_cpu":
        "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) -> (Tensor, Tensor)",
    "fused_qk_gemma_rmsnorm_with_gate_cpu":
        "(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim, int num_heads)"
        " -> (Tensor, Tensor, Tensor)",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu":
        "(Tensor qkvz, Tensor ba, int num_q_heads, int num_v_heads, int head_q_dim, int head_v_dim)"
        " -> (Tensor, Tensor, Tensor, Tensor)",
    "fused_gdn_gating_cpu": "(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
}


def _not_stood_in(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"torch.ops.sgl_kernel.{name}: an import stand-in (tests/support/sglang_cpu); "
                                  "a forward pass through it needs the real CPU kernel")
    return op


def register() -> torch.library.Library | None:
    """Define the ops once per process (None when something already defined them)."""
    if hasattr(torch.ops.sgl_kernel, "fused_sigmoid_mul_cpu"):
        return None
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
        lib.impl(name, _not_stood_in(name), "CompositeExplicitAutograd")
    return lib
