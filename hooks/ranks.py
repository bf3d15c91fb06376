"""Which rank this process is: config, SGLang's parallel state, torch.distributed, env.

Nothing here imports SGLang: its parallel state is consulted only when the
server already imported it (``sys.modules``).
"""

from __future__ import annotations

import os
import sys

from moetrace.schema import RankIdentity


def detect_rank(tp_rank: int | None = None, tp_size: int | None = None) -> tuple[int, int, str]:
    """(tp_rank, tp_size, how it was found)."""
    if tp_rank is not None:
        return int(tp_rank), int(tp_size or max(int(tp_rank) + 1, 1)), "config"
    ps = sys.modules.get("sglang.srt.distributed")
    if ps is not None:
        try:
            return int(ps.get_tensor_model_parallel_rank()), int(ps.get_tensor_model_parallel_world_size()), "sglang"
        except Exception:  # parallel state not initialized (yet)
            pass
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), "torch.distributed"
    except Exception:
        pass
    for key in ("MOETRACE_TP_RANK", "RANK", "LOCAL_RANK"):
        if os.environ.get(key, "").isdigit():
            size = os.environ.get("MOETRACE_TP_SIZE") or os.environ.get("WORLD_SIZE") or "0"
            rank = int(os.environ[key])
            return rank, max(int(size) if size.isdigit() else 0, rank + 1), "env"
    return 0, int(tp_size or 1), "default"


def module_ranks(module, tp_rank: int, tp_size: int) -> RankIdentity:
    """Row ranks from a FusedMoE-like module's attributes (moe_tp_*, moe_ep_*)."""
    ep_size = int(getattr(module, "moe_ep_size", None) or 1)
    ep_rank = int(getattr(module, "moe_ep_rank", None) or 0)
    moe_tp_size = getattr(module, "moe_tp_size", None)
    moe_tp_rank = getattr(module, "moe_tp_rank", None)
    moe_tp_size = int(moe_tp_size) if moe_tp_size is not None else max(1, tp_size // ep_size)
    moe_tp_rank = int(moe_tp_rank) if moe_tp_rank is not None else tp_rank % moe_tp_size
    return RankIdentity(int(tp_size), int(tp_rank), ep_size, ep_rank, moe_tp_size, moe_tp_rank)
