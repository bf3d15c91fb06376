"""The words of a report: one sentence per divergent entry and per load summary.

Sentences name the rank, layer, step, expert and what the tensor holds instead,
e.g. "step 3, layer 0, rank 1, expert 17: w2_weight_scale_inv holds expert 19 (E+2)".
A slot that is not simply its expert is named too: "rank 3, layer 17, slot 41
(logical expert 43, redundant copy 2): w13_weight holds expert 45 (E+2)"; a draft
model's layers read "draft layer 0"; a process of a pipeline stage or replica
"rank pp1-tp3".
"""

from __future__ import annotations

import numpy as np

from moetrace.analysis.trace import pair_to_hex
from moetrace.analysis.verdicts import (
    CONSTANT,
    MATCH,
    MISSING,
    STALE,
    TORN,
    UNEXPECTED,
    UNKNOWN,
    VERDICTS,
    WRONG_LAYER,
    WRONG_RANK,
    WRONG_TENSOR,
    ZEROS,
)
from moetrace.schema import SOURCES, format_ids


def fmt_int(n: int) -> str:
    return f"{int(n):,}"


def found_desc(verdict: int, e: int, t: str, r: int, l: int, fe: int, ft: str, fr: int, fl: int, k: int,
               m: str = "target", fm: str = "target", shared: bool = False, found_shared: bool = False) -> str:
    """What the tensor holds instead: expert fe of (shard fr, model fm, layer fl); E+k
    only between routed experts (a shared expert's id is not a neighbour's)."""
    who = "the shared expert" if found_shared else f"expert {fe}"
    offset = "" if shared or found_shared or fe == e else f" (E{k:+d})"
    if verdict == STALE:
        return f"holds {who}{offset}"
    if verdict == WRONG_RANK:
        s = f"holds rank {fr}'s shard"
        return s + (f" of {who}{offset}" if fe != e else "")
    parts = []
    if fl != l or fm != m:
        parts.append(f"{fm} layer {fl}" if fm != m else f"layer {fl}")
    parts.append(f"{who}{offset}")
    if fr != r:
        parts.append(f"rank {fr}")
    if verdict == WRONG_TENSOR:
        return f"holds {ft} of " + ", ".join(parts)
    return "holds the tensor of " + ", ".join(parts)


def slot_desc(expert: int, slot: int, copy: int, source: str, shared: bool = False) -> str:
    """'expert 17', or the slot and what the server's map says it holds:
    'slot 41 (logical expert 43, redundant copy 2)', 'slot 8 (shared expert)'."""
    if not shared and copy == 0 and (slot == expert or source == "staged"):
        return f"expert {expert}"
    bits = ["shared expert" if shared else f"logical expert {expert}"]
    if copy and not shared:  # every EP rank holds its own copy of a fused shared expert: not "redundant"
        bits.append(f"redundant copy {copy}")
    return f"slot {slot} (" + ", ".join(bits) + ")"


def torn_desc(ranges: list[dict]) -> str:
    bits = []
    for g in ranges:
        first, last = g["first_chunk"], g["last_chunk"]
        span = f"chunk {first}" if first == last else f"chunks {first}-{last}"
        src = g["source"]
        if src == "expected":
            what = f"expert {g['expert']} (expected)"
        elif src == "index":
            what = f"expert {g['expert']} (E{g['k']:+d})"
            extra = []
            if g.get("_layer_differs"):
                extra.append(layer_text(g.get("model", "target"), g["layer"]))
            if g.get("_rank_differs"):
                extra.append(f"rank {g['tp_rank']}")
            if g.get("_tensor_differs"):
                extra.append(g["tensor"])
            if extra:
                what += " [" + ", ".join(extra) + "]"
        else:
            what = src
        bits.append(f"{span} {what}")
    return "is torn: " + ", ".join(bits)


def row_doc(a, i: int) -> dict:
    """The JSON document of trace row i of Analysis `a`, with its sentence."""
    c, v, idx, d = a.data.cols, a.verdicts, a.idx, a.data
    code = int(v.verdict[i])
    doc = {
        "run_id": d.run_ids.names[int(c["run"][i])],
        "step": int(c["step"][i]),
        "model": d.models.names[int(c["model"][i])],
        "layer": int(c["layer"][i]),
        "rank": d.labels[int(c["rank"][i])],
        "tp_rank": int(c["tp"][i]),
        "moe_tp_rank": int(c["shard"][i]),
        "source": SOURCES[int(c["source"][i])],
        "capture_seq": int(c["capture_seq"][i]),
        "transport_position": int(c["transport_position"][i]),
        "copy_position": int(c["copy_position"][i]),
        "expert": int(c["expert"][i]),
        "slot": int(c["slot"][i]),
        "expert_copy": int(c["copy"][i]),
        "shared_expert": bool(idx.num_experts and int(c["expert"][i]) >= idx.num_experts),
        "tensor": d.tensors.names[int(c["tensor"][i])],
        "verdict": VERDICTS[code],
        "k": None,
        "found": None,
        "value": v.value.get(i),
        "chunks": None,
        "digest": pair_to_hex(int(c["hi"][i]), int(c["lo"][i])),
        "expected_digest": pair_to_hex(int(idx.hi[v.pos[i]]), int(idx.lo[v.pos[i]])) if v.pos[i] >= 0 else None,
    }
    f = int(v.found[i])
    if f >= 0:
        doc["k"] = int(v.k[i])
        doc["found"] = {"moe_tp_rank": int(idx.rank[f]), "model": d.models.names[int(idx.model[f])],
                        "layer": int(idx.layer[f]), "expert": int(idx.expert[f]),
                        "tensor": d.tensors.names[int(idx.tensor[f])],
                        "shared_expert": bool(idx.num_experts and int(idx.expert[f]) >= idx.num_experts)}
    if code == TORN:
        doc["chunks"] = [dict(g) for g in v.torn.get(i, [])]
    doc["sentence"] = sentence(doc, no_chunks=i in v.no_chunks)
    return doc


def what(doc: dict, no_chunks: bool = False) -> str:
    """What the row's tensor is, e.g. 'w2_weight_scale_inv holds expert 19 (E+2)'."""
    code = VERDICTS.index(doc["verdict"])
    t = doc["tensor"]
    if code == MATCH:
        return f"{t} matches"
    if code in (STALE, WRONG_RANK, WRONG_LAYER, WRONG_TENSOR):
        f = doc["found"]
        return f"{t} " + found_desc(code, doc["expert"], t, doc["moe_tp_rank"], doc["layer"], f["expert"],
                                    f["tensor"], f["moe_tp_rank"], f["layer"], doc["k"], doc.get("model", "target"),
                                    f.get("model", "target"), doc.get("shared_expert", False),
                                    f.get("shared_expert", False))
    if code == ZEROS:
        return f"{t} is all zeros"
    if code == CONSTANT:
        return f"{t} is {doc['value']}"
    if code == TORN:
        rngs = []
        for g in doc["chunks"]:
            g = dict(g)
            if g["source"] == "index":
                g["_layer_differs"] = (g["layer"] != doc["layer"]
                                       or g.get("model", "target") != doc.get("model", "target"))
                g["_rank_differs"] = g["tp_rank"] != doc["moe_tp_rank"]
                g["_tensor_differs"] = g["tensor"] != t
            rngs.append(g)
        return f"{t} " + torn_desc(rngs)
    if code == UNEXPECTED:
        return f"{t} has no entry in the index"
    if code == MISSING:
        return f"{t} was not captured"
    return f"{t} matches no known tensor" + (
        " (no chunk digests recorded, so a torn copy cannot be told apart)" if no_chunks else ""
    )


def layer_text(model: str, layer: int) -> str:
    return f"layer {layer}" if model == "target" else f"{model} layer {layer}"


def sentence(doc: dict, with_prefix: bool = True, no_chunks: bool = False) -> str:
    pre = f"step {doc['step']}, {layer_text(doc.get('model', 'target'), doc['layer'])}, " if with_prefix else ""
    who = slot_desc(doc["expert"], doc.get("slot", doc["expert"]), doc.get("expert_copy", 0), doc.get("source", ""),
                    doc.get("shared_expert", False))
    return f"{pre}rank {doc.get('rank', doc.get('tp_rank'))}, {who}: {what(doc, no_chunks)}"


# A STALE summary detail at or below this is SHARED_STALE - the expert found, for a fused
# shared expert (where E+k means nothing); above it, k of E+k (negative for E-k).
SHARED_STALE = -(1 << 30)


def summary_fragment(verdict: int, detail: int, count: int, total: int, tensor: str, tensor_names: list[str],
                     layer_name=None, shared_from: int | None = None) -> str:
    """One "6/8 w2_weight_scale_inv are E+2" piece. STALE details are E+k, or SHARED_STALE
    minus the expert found when a fused shared expert is involved (E+k means nothing there);
    WRONG_LAYER details go through `layer_name` (a draft's layers are not the target's)."""
    frac = f"{count}/{total}" + (f" {tensor}" if tensor else "")
    if verdict == STALE and detail <= SHARED_STALE:
        found = SHARED_STALE - detail
        shared = shared_from is not None and found >= shared_from
        return f"{frac} hold " + ("the shared expert" if shared else f"expert {found}")
    if verdict == STALE:
        return f"{frac} are E{detail:+d}"
    if verdict == WRONG_LAYER and layer_name is not None:
        return f"{frac} hold {layer_name(detail)}'s tensors"
    if verdict == WRONG_RANK:
        return f"{frac} hold rank {detail}'s shard"
    if verdict == WRONG_LAYER:
        return f"{frac} hold layer {detail}'s tensors"
    if verdict == WRONG_TENSOR:
        return f"{frac} hold {tensor_names[detail]}"
    word = {ZEROS: "are zeros", CONSTANT: "are constant fills", TORN: "are torn", UNKNOWN: "are unknown",
            UNEXPECTED: "are not in the index", MISSING: "are missing"}[verdict]
    return f"{frac} {word}"


def steps_text(steps) -> str:
    """'step 3' for one step, 'steps 0-9,12' for several (an int is one step)."""
    if isinstance(steps, (int, np.integer)):
        return f"step {int(steps)}"
    xs = sorted({int(x) for x in steps})
    return f"step {xs[0]}" if len(xs) == 1 else f"steps {format_ids(xs)}"


def load_label(run_id: str, rank, layer: int, step, source: str, multi_source: bool, multi_run: bool,
               model: str = "target") -> str:
    """'rank R, layer L, step S' (+ ' (source)' when the trace has several sources, 'run: ' in
    front when it has several runs); ``step`` may be a list of steps: 'steps 0-9,12'."""
    s = f"rank {rank}, {layer_text(model, layer)}, {steps_text(step)}"
    if multi_source:
        s += f" ({source})"
    if multi_run:
        s = f"{run_id}: " + s
    return s


def guard_sentence(records: dict[str, dict]) -> str:
    """The in-server guard's records ({rank: manifest guard section}) in one sentence."""
    parts = []
    for rank, g in sorted(records.items()):
        t, loads = g.get("tensors") or {}, g.get("loads") or {}
        checked, n, total = t.get("match", 0) + t.get("mismatch", 0), loads.get("mismatch", 0), sum(loads.values())
        cov = ", ".join(f"{k} {v:.0%}" for k, v in sorted((g.get("coverage") or {}).items())) or "none"
        # loads as the record counts them: mismatching loads of all loads verified
        parts.append(f"rank {rank} {g.get('status')}: {t.get('mismatch', 0):,}/{checked:,} tensors mismatched, "
                     f"{n:,}/{total:,} load{'' if total == 1 else 's'} mismatched, coverage {cov}")
    return "; ".join(parts) or "no guard record"
