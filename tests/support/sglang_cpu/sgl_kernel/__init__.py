"""Import stand-in for sgl_kernel under SGLang's CPU engine (tests only; README.md here).

No AMX op (``convert_weight_packed``) is registered: SGLang then sees no AMX kernels and runs
its torch-native paths. The ops Qwen3.5's CPU path binds and calls are, in plain torch
(qwen3_5_ops; sgl_kernel.mamba beside it).
"""

from __future__ import annotations

from sgl_kernel import qwen3_5_ops

qwen3_5_ops.register()


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the next
    end-start entries of out_cache_loc, request by request (what SGLang's Triton
    assign_req_to_token_pool does beside this call site)."""
    taken = 0
    starts, ends, rows = start_offset.tolist(), end_offset.tolist(), req_pool_indices.tolist()
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + n].to(req_to_token.dtype)
        taken += n


def _not_on_this_path(name: str):
    def stand_in(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: an import stand-in (tests/support/sglang_cpu); "
                                  "this SGLang path needs the real CPU kernel")
    stand_in.__name__ = name
    return stand_in


# Imported at module import by SGLang 0.5.23 with SGLANG_USE_CPU_ENGINE=1; never called on the
# plain decode path (KV-cache moves between layers, speculative decoding).
for _name in ("copy_all_layer_kv_cache_cpu", "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
              "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "rotate_input_ids_cpu",
              "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu"):
    globals()[_name] = _not_on_this_path(_name)
del _name
