"""The words of a report: one sentence per divergent entry and per load summary.

Sentences name the rank, layer, step, expert and what the tensor holds instead,
e.g. "step 3, layer 0, rank 1, expert 17: w2_weight_scale_inv holds expert 19 (E+2)".
"""

from __future__ import annotations

import numpy as np

from moetrace.analysis.verdicts import (
    CONSTANT, MATCH, MISSING, STALE, TORN, UNEXPECTED, UNKNOWN, VERDICTS, WRONG_LAYER, WRONG_RANK, WRONG_TENSOR, ZEROS,
)
from moetrace.analysis.trace import pair_to_hex
from moetrace.schema import SOURCES, format_ids


def fmt_int(n: int) -> str:
    return f"{int(n):,}"


def found_desc(verdict: int, e: int, t: str, r: int, l: int, fe: int, ft: str, fr: int, fl: int, k: int) -> str:
    if verdict == STALE:
        return f"holds expert {fe} (E{k:+d})"
    if verdict == WRONG_RANK:
        s = f"holds rank {fr}'s shard"
        return s + (f" of expert {fe} (E{k:+d})" if fe != e else "")
    parts = []
    if fl != l:
        parts.append(f"layer {fl}")
    parts.append(f"expert {fe}" + (f" (E{k:+d})" if fe != e else ""))
    if fr != r:
        parts.append(f"rank {fr}")
    if verdict == WRONG_TENSOR:
        return f"holds {ft} of " + ", ".join(parts)
    return "holds the tensor of " + ", ".join(parts)


def torn_desc(ranges: list[dict]) -> str:
    bits = []
    for g in ranges:
        span = f"chunk {g['first_chunk']}" if g["first_chunk"] == g["last_chunk"] else f"chunks {g['first_chunk']}-{g['last_chunk']}"
        src = g["source"]
        if src == "expected":
            what = f"expert {g['expert']} (expected)"
        elif src == "index":
            what = f"expert {g['expert']} (E{g['k']:+d})"
            extra = []
            if g.get("_layer_differs"):
                extra.append(f"layer {g['layer']}")
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
    c, v, idx, d = a.data.cols, a.v, a.idx, a.data
    code = int(v.verdict[i])
    doc = {
        "run_id": d.run_ids.names[int(c["run"][i])],
        "step": int(c["step"][i]),
        "layer": int(c["layer"][i]),
        "tp_rank": int(c["rank"][i]),
        "source": SOURCES[int(c["source"][i])],
        "capture_seq": int(c["capture_seq"][i]),
        "transport_position": int(c["transport_position"][i]),
        "copy_position": int(c["copy_position"][i]),
        "expert": int(c["expert"][i]),
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
        doc["found"] = {"tp_rank": int(idx.rank[f]), "layer": int(idx.layer[f]), "expert": int(idx.expert[f]),
                        "tensor": d.tensors.names[int(idx.tensor[f])]}
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
        return f"{t} " + found_desc(code, doc["expert"], t, doc["tp_rank"], doc["layer"], f["expert"],
                                    f["tensor"], f["tp_rank"], f["layer"], doc["k"])
    if code == ZEROS:
        return f"{t} is all zeros"
    if code == CONSTANT:
        return f"{t} is {doc['value']}"
    if code == TORN:
        rngs = []
        for g in doc["chunks"]:
            g = dict(g)
            if g["source"] == "index":
                g["_layer_differs"] = g["layer"] != doc["layer"]
                g["_rank_differs"] = g["tp_rank"] != doc["tp_rank"]
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


def sentence(doc: dict, with_prefix: bool = True, no_chunks: bool = False) -> str:
    pre = f"step {doc['step']}, layer {doc['layer']}, " if with_prefix else ""
    return f"{pre}rank {doc['tp_rank']}, expert {doc['expert']}: {what(doc, no_chunks)}"


def summary_fragment(verdict: int, detail: int, count: int, total: int, tensor: str, tensor_names: list[str]) -> str:
    frac = f"{count}/{total}" + (f" {tensor}" if tensor else "")
    if verdict == STALE:
        return f"{frac} are E{detail:+d}"
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


def load_label(run_id: str, rank: int, layer: int, step, source: str, multi_source: bool, multi_run: bool) -> str:
    """'rank R, layer L, step S' (+ ' (source)' when the trace has several sources, 'run: ' in
    front when it has several runs); ``step`` may be a list of steps: 'steps 0-9,12'."""
    s = f"rank {rank}, layer {layer}, {steps_text(step)}"
    if multi_source:
        s += f" ({source})"
    if multi_run:
        s = f"{run_id}: " + s
    return s
