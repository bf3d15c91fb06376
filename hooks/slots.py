"""Which logical expert each physical slot of a FusedMoE holds, from the server's own map.

Read on every capture: EPLB rebalancing rewrites SGLang's expert-location
metadata in place, and KT's dynamic expert update replaces its slot tables.
Sources, first that applies:
- KT fork (KTEPWrapperMethod): ``gpu_index_to_logical`` / ``logical_to_gpu_index``;
- EPLB metadata (``get_global_expert_location_metadata()``, only when the
  module's loader used it: 0.5.23 drafts do not): ``physical_to_logical_map_cpu``;
- otherwise contiguous EP blocks, as the loader maps them without metadata.
Slots past the routed ones hold fused shared experts (logical id E + j).
Nothing here imports SGLang: the metadata module is read from sys.modules.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

EXPERT_LOCATION_MODULE = "sglang.srt.eplb.expert_location"
UNUSED = -1  # a slot the loader never writes (e.g. a draft's redundant slots without metadata)


class SlotMapError(Exception):
    """The module's slots cannot be mapped to checkpoint experts (said by name)."""


@dataclass(frozen=True)
class SlotMap:
    experts: list[int]  # logical expert per slot; UNUSED for a slot nothing is loaded into
    copies: list[int]  # physical copy number of that logical expert in the layer (0 = first)
    found_by: str  # how the map was read
    num_logical: int  # routed logical experts; shared expert j has id num_logical + j


def _ints(value) -> list[int]:
    return [int(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]


def _metadata():
    mod = sys.modules.get(EXPERT_LOCATION_MODULE)
    getter = getattr(mod, "get_global_expert_location_metadata", None)
    if getter is None:
        return None
    try:
        return getter()
    except Exception:  # the server's context is not published in this thread
        return None


def _geometry(module, n_slots: int) -> tuple[int, int, int, int]:
    """(storage ep rank, routed slots per rank, fused shared slots, ep size)."""
    shared = int(getattr(module, "num_fused_shared_experts", 0) or 0)
    ep_size = int(getattr(module, "moe_ep_size", 1) or 1)
    rank = getattr(module, "_expert_storage_rank", None)  # 0.5.23 (elastic EP "scale" joins)
    rank = int(getattr(module, "moe_ep_rank", 0) or 0) if rank is None else int(rank)
    routed = getattr(module, "_num_local_routed", None)  # 0.5.23
    if routed is None:
        local = getattr(module, "num_local_experts", None)
        routed = (int(local) - shared) if local is not None else n_slots - shared
    return rank, int(routed), shared, ep_size


_COPIES_CACHE: dict = {}


def _copies(row: list[int], key) -> list[int]:
    """Copy number of each physical slot of a map row (cached per map version)."""
    hit = _COPIES_CACHE.get(key)
    if hit is not None:
        return hit
    seen: dict[int, int] = {}
    out = []
    for e in row:
        out.append(seen.get(e, 0))
        seen[e] = out[-1] + 1
    if len(_COPIES_CACHE) > 4096:
        _COPIES_CACHE.clear()
    _COPIES_CACHE[key] = out
    return out


def read_slot_map(module, n_slots: int, layer: int) -> SlotMap | None:
    """The slot map of a FusedMoE-like module whose stacked params have n_slots rows.
    None: nothing real is resident (KT with no GPU experts keeps a dummy slot)."""
    qm = getattr(module, "quant_method", None)
    if qm is not None and getattr(qm, "num_gpu_experts", None) == 0:
        return None
    rank, routed, shared, ep_size = _geometry(module, n_slots)
    base = rank * routed
    kt = _kt_tables(qm, n_slots)
    if kt is not None:
        table, how = kt
        experts = [base + e for e in table]
        return SlotMap(experts, [0] * n_slots, how, _num_logical(module, None, routed, ep_size))
    meta = _metadata() if getattr(module, "uses_expert_location", True) else None
    if n_slots > routed + shared:
        raise SlotMapError(f"layer {layer}: {n_slots} slots but the module declares {routed} routed + {shared} shared")
    n_routed = min(n_slots, routed)
    num_logical = _num_logical(module, meta, routed, ep_size)
    if meta is not None:
        p2l = meta.physical_to_logical_map_cpu
        if not 0 <= layer < p2l.shape[0]:
            raise SlotMapError(f"layer {layer} is outside the expert-location map ({p2l.shape[0]} layers)")
        if p2l.shape[1] != routed * ep_size:
            raise SlotMapError(f"layer {layer}: the expert-location map has {p2l.shape[1]} physical experts, "
                               f"the module {routed} per rank x {ep_size} ranks")
        row = p2l[layer].tolist()
        copies = _copies(row, (id(p2l), p2l._version, layer))
        experts = row[base:base + n_routed]
        copies = copies[base:base + n_routed]
        found_by = "eplb"
    else:
        experts = [base + i if base + i < num_logical else UNUSED for i in range(n_routed)]
        copies = [0] * n_routed
        found_by = "ep-contiguous"
    for j in range(n_slots - n_routed):
        experts.append(num_logical + j)
        copies.append(rank if ep_size > 1 else 0)
    if shared and n_slots > n_routed:
        found_by += "+shared"
    return SlotMap(experts, copies, found_by, num_logical)


def _num_logical(module, meta, routed: int, ep_size: int) -> int:
    meta = meta if meta is not None else _metadata()
    if meta is not None:
        return int(meta.num_logical_experts)
    g = getattr(module, "_num_global_routed", None)
    return int(g) if g is not None else routed * ep_size


def _kt_tables(qm, n_slots: int) -> tuple[list[int], str] | None:
    """KT's GPU slot -> logical table (fork), when it describes these slots."""
    if qm is None:
        return None
    g2l = getattr(qm, "gpu_index_to_logical", None)
    if g2l is not None and len(g2l) == n_slots:
        return _ints(g2l), "kt-gpu-index"
    l2g = getattr(qm, "logical_to_gpu_index", None)
    if l2g is not None:
        inv = [UNUSED] * n_slots
        for e, g in enumerate(_ints(l2g)):
            if 0 <= g < n_slots:
                inv[g] = e
        if UNUSED not in inv:
            return inv, "kt-logical-index"
    return None
