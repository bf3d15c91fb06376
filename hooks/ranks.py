"""Which process this is: TP rank, pipeline stage and data-parallel replica.

Sources, first that answers: the hook config, SGLang's own state (0.5.23's
``runtime_context.get_parallel()``; the parallel-state getters, exported by
``sglang.srt.distributed`` in the fork and older releases, kept in
``sglang.srt.distributed.parallel_state`` by 0.5.23), the registering ModelRunner,
torch.distributed, the environment.
Nothing here imports SGLang: its modules are consulted only when the server
already imported them (``sys.modules``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from moetrace.schema import RankIdentity

DP_RANK_ENV = "SGLANG_DP_RANK"  # set for router-launched replicas; both trees read it


@dataclass
class ProcessRanks:
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    replica: int | None = None  # None: the server has one replica
    found_by: dict = field(default_factory=dict)  # {"tp": how, "pp": how, "replica": how} each was found


def detect_rank(tp_rank: int | None = None, tp_size: int | None = None) -> tuple[int, int, str]:
    """(tp_rank, tp_size, how it was found)."""
    if tp_rank is not None:
        return int(tp_rank), int(tp_size or max(int(tp_rank) + 1, 1)), "config"
    par = _runtime_parallel()
    if par is not None and _read(par, "tp_rank") is not None and _read(par, "tp_size"):
        return _read(par, "tp_rank"), _read(par, "tp_size"), "sglang"
    # 0.5.23 keeps the getters in parallel_state only (out of sglang.srt.distributed's
    # exports); the fork and older releases export them from sglang.srt.distributed.
    for name in ("sglang.srt.distributed.parallel_state", "sglang.srt.distributed"):
        ps = sys.modules.get(name)
        try:
            return int(ps.get_tensor_model_parallel_rank()), int(ps.get_tensor_model_parallel_world_size()), "sglang"
        except Exception:  # not loaded, not exported, or the parallel state not initialized (yet)
            pass
    # The global rank: the TP rank only without pipeline stages (it is tp_size * pp_rank + tp_rank).
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


def _runtime_parallel():
    """0.5.23's published ParallelContext, or None."""
    rc = sys.modules.get("sglang.srt.runtime_context")
    try:
        return rc.get_parallel() if rc is not None else None
    except Exception:
        return None


def _read(obj, name: str):
    try:
        v = getattr(obj, name)
    except Exception:  # ParallelContext raises for fields not published in this process
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def detect_stage(pp_rank: int | None = None, pp_size: int | None = None) -> tuple[int, int, str]:
    """(pp_rank, pp_size, how it was found)."""
    if pp_rank is not None:
        return int(pp_rank), int(pp_size or pp_rank + 1), "config"
    par = _runtime_parallel()
    if par is not None and _read(par, "pp_rank") is not None and _read(par, "pp_size"):
        return _read(par, "pp_rank"), _read(par, "pp_size"), "sglang"
    ps = sys.modules.get("sglang.srt.distributed")
    if ps is not None:
        try:
            rank, size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
            return int(rank), int(size), "sglang"
        except Exception:
            pass
    return 0, int(pp_size or 1), "default"


def detect_replica(replica: int | None = None, runner=None, dp_rank: int | None = None) -> tuple[int | None, str]:
    """(replica id or None, how it was found). A replica is a data-parallel copy of the
    whole TP group in its own torch.distributed world (``--dp-size`` without DP
    attention); DP attention keeps one world with distinct TP ranks: no replicas."""
    if replica is not None:
        return int(replica), "config"
    par = _runtime_parallel()
    if par is not None:
        size, rank = _read(par, "dp_size"), _read(par, "dp_rank")  # 0.5.23: replicas only (attn_dp_size is apart)
        if size is not None and size > 1 and rank is not None:
            return rank, "sglang"
        if size == 1:
            return None, "sglang"
    env = os.environ.get(DP_RANK_ENV, "")
    if env.isdigit():
        return int(env), "env"
    args = getattr(runner, "server_args", None)  # the fork: ModelRunner keeps server_args
    rank = dp_rank if dp_rank is not None else getattr(runner, "dp_rank", None)
    if args is not None and rank is not None and (getattr(args, "dp_size", 1) or 1) > 1 \
            and not getattr(args, "enable_dp_attention", False):
        return int(rank), "runner"
    return None, "default"


def detect_process(config, runner=None, dp_rank: int | None = None) -> ProcessRanks:
    """This process's identity from a TraceConfig (overrides) and what the server shows."""
    tp, tps, how_tp = detect_rank(config.tp_rank, config.tp_size)
    pp, pps, how_pp = detect_stage(config.pp_rank, config.pp_size)
    rep, how_rep = detect_replica(config.replica, runner, dp_rank)
    return ProcessRanks(tp, tps, pp, pps, rep, {"tp": how_tp, "pp": how_pp, "replica": how_rep})


def module_ranks(module, tp_rank: int, tp_size: int) -> RankIdentity:
    """Row ranks from a FusedMoE-like module's attributes (moe_tp_*, moe_ep_*); with
    --moe-dp-size, SGLang's moe_tp_size is tp / ep / moe_dp, which the module holds."""
    ep_size = int(getattr(module, "moe_ep_size", None) or 1)
    ep_rank = int(getattr(module, "moe_ep_rank", None) or 0)
    moe_tp_size = getattr(module, "moe_tp_size", None)
    moe_tp_rank = getattr(module, "moe_tp_rank", None)
    moe_tp_size = int(moe_tp_size) if moe_tp_size is not None else max(1, tp_size // ep_size)
    moe_tp_rank = int(moe_tp_rank) if moe_tp_rank is not None else tp_rank % moe_tp_size
    return RankIdentity(int(tp_size), int(tp_rank), ep_size, ep_rank, moe_tp_size, moe_tp_rank)
