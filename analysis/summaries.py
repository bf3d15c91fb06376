"""Per-load summaries of what diverged: counts per (load, tensor kind, verdict)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from moetrace.analysis.coverage import Analysis
from moetrace.analysis.sentences import SHARED_STALE, load_label, summary_fragment
from moetrace.analysis.verdicts import MISSING, STALE, VERDICTS, WRONG_LAYER, WRONG_RANK, WRONG_TENSOR
from moetrace.schema import SOURCES, copy_position, label_key, parse_rank_label


def load_summaries(a: Analysis, drows: np.ndarray, multi_source: bool, multi_run: bool) -> list[dict]:
    """One summary per (load, tensor kind) with a divergent or missing entry, e.g.
    "rank 1, layer 0, step 3 (staged): 253/256 w2_weight_scale_inv are E+2"."""
    d, c, v, idx, L = a.data, a.data.cols, a.verdicts, a.idx, a.loads
    names = d.tensors
    parts = []
    if len(drows):
        vv = v.verdict[drows].astype(np.int64)
        f = np.maximum(v.found[drows], 0)
        shared = idx.num_experts > 0 and ((c["expert"][drows] >= idx.num_experts) | (idx.expert[f] >= idx.num_experts))
        detail = np.select(
            [(vv == STALE) & shared, vv == STALE, vv == WRONG_RANK, vv == WRONG_LAYER, vv == WRONG_TENSOR],
            [SHARED_STALE - idx.expert[f].astype(np.int64), v.k[drows], idx.rank[f], idx.lkey[f], idx.tensor[f]], 0,
        )
        parts.append(pd.DataFrame({"load": a.load[drows], "tensor": c["tensor"][drows].astype(np.int64),
                                   "verdict": vv, "detail": detail.astype(np.int64)}))
    if a.missing_entries:
        ml = [li for li, entries in a.missing_entries.items() for _ in entries]
        mt = [t for entries in a.missing_entries.values() for (_, _, t) in entries]
        parts.append(pd.DataFrame({"load": np.array(ml, np.int64), "tensor": np.array(mt, np.int64),
                                   "verdict": MISSING, "detail": 0}))
    if not parts:
        return []
    df = pd.concat(parts, ignore_index=True)
    g = df.groupby(["load", "tensor", "verdict", "detail"], sort=False).size().rename("count").reset_index()
    # totals per (load, tensor): the load's slots (one entry of each tensor kind per slot)
    tot = {}
    for li, t in set(zip(g["load"].tolist(), g["tensor"].tolist())):
        got = int(((a.load == li) & (c["tensor"] == t)).sum())
        tot[(li, t)] = max(int(L["slot_count"].iat[li]), got)
    g["total"] = [tot[(li, t)] for li, t in zip(g["load"], g["tensor"])]
    g = g.sort_values(["load", "tensor", "count"], ascending=[True, True, False])
    out = []
    Ld = L.to_dict("list")
    for (li, t), grp in g.groupby(["load", "tensor"], sort=False):
        li = int(li)
        run_id = d.run_ids.names[Ld["run"][li]]
        model = d.models.names[Ld["model"][li]]
        label = load_label(run_id, d.labels[Ld["rank"][li]], Ld["layer"][li], Ld["step"][li], SOURCES[Ld["source"][li]],
                           multi_source, multi_run, model)
        tname = names.names[int(t)]
        stride = a.layer_stride

        def layer_name(lkey: int, model=model) -> str:
            other = d.models.names[lkey // stride]
            return f"{other} layer {lkey % stride}" if other != model else f"layer {lkey % stride}"

        frags = [summary_fragment(int(r.verdict), int(r.detail), int(r.count), int(r.total), tname if i == 0 else "",
                                  names.names, layer_name, idx.num_experts or None)
                 for i, r in enumerate(grp.itertuples(index=False))]
        out.append({
            "run_id": run_id, "step": int(Ld["step"][li]), "model": model, "layer": int(Ld["layer"][li]),
            "rank": d.labels[Ld["rank"][li]], "tp_rank": parse_rank_label(d.labels[Ld["rank"][li]])[2],
            "source": SOURCES[Ld["source"][li]], "capture_seq": int(Ld["capture_seq"][li]), "tensor": tname,
            "total": int(grp["total"].iloc[0]),
            "counts": [{"verdict": VERDICTS[int(r.verdict)], "detail": int(r.detail), "count": int(r.count)}
                       for r in grp.itertuples(index=False)],
            "sentence": f"{label}: " + ", ".join(frags),
        })
    # order: as loads are ordered for the first divergence, then by copy order of the tensor
    out.sort(key=lambda s: (s["run_id"], s["step"], s["model"] != "target", s["layer"], SOURCES.index(s["source"]),
                            label_key(s["rank"]), _copy_rank(s["tensor"])))
    return out


def _copy_rank(t: str) -> int:
    try:
        return copy_position(t)
    except KeyError:
        return 99
