"""Per-load summaries of what diverged: counts per (load, tensor kind, verdict)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from moetrace.analysis.coverage import Analysis
from moetrace.analysis.sentences import load_label, summary_fragment
from moetrace.analysis.verdicts import MISSING, STALE, VERDICTS, WRONG_LAYER, WRONG_RANK, WRONG_TENSOR
from moetrace.schema import SOURCES, copy_position


def load_summaries(a: Analysis, drows: np.ndarray, multi_source: bool, multi_run: bool) -> list[dict]:
    """One summary per (load, tensor kind) with a divergent or missing entry, e.g.
    "rank 1, layer 0, step 3 (staged): 253/256 w2_weight_scale_inv are E+2"."""
    d, c, v, idx, L = a.data, a.data.cols, a.v, a.idx, a.loads
    names = d.tensors
    parts = []
    if len(drows):
        vv = v.verdict[drows].astype(np.int64)
        f = np.maximum(v.found[drows], 0)
        detail = np.select(
            [vv == STALE, vv == WRONG_RANK, vv == WRONG_LAYER, vv == WRONG_TENSOR],
            [v.k[drows], idx.rank[f], idx.layer[f], idx.tensor[f]], 0,
        )
        parts.append(pd.DataFrame({"load": a.load[drows], "tensor": c["tensor"][drows].astype(np.int64),
                                   "verdict": vv, "detail": detail.astype(np.int64)}))
    if a.missing_entries:
        ml = np.concatenate([np.full(len(p), li) for li, p in a.missing_entries.items()])
        mp = np.concatenate(list(a.missing_entries.values()))
        parts.append(pd.DataFrame({"load": ml, "tensor": idx.tensor[mp], "verdict": MISSING, "detail": 0}))
    if not parts:
        return []
    df = pd.concat(parts, ignore_index=True)
    g = df.groupby(["load", "tensor", "verdict", "detail"], sort=False).size().rename("count").reset_index()
    # totals per (load, tensor): expected entries of that tensor kind in the load
    tot = {}
    for li, t in set(zip(g["load"].tolist(), g["tensor"].tolist())):
        row = L.iloc[li]
        s, em = a._expected_mask(int(row["run"]), int(row["rank"]), int(row["layer"]))
        ex = int((idx.tensor[s : s + len(em)][em] == t).sum()) if s >= 0 else 0
        got = int(((a.load == li) & (c["tensor"] == t)).sum()) if ex == 0 else ex
        tot[(li, t)] = max(ex, got)
    g["total"] = [tot[(li, t)] for li, t in zip(g["load"], g["tensor"])]
    g = g.sort_values(["load", "tensor", "count"], ascending=[True, True, False])
    out = []
    Ld = L.to_dict("list")
    for (li, t), grp in g.groupby(["load", "tensor"], sort=False):
        li = int(li)
        run_id = d.run_ids.names[Ld["run"][li]]
        label = load_label(run_id, Ld["rank"][li], Ld["layer"][li], Ld["step"][li], SOURCES[Ld["source"][li]],
                            multi_source, multi_run)
        tname = names.names[int(t)]
        frags = [summary_fragment(int(r.verdict), int(r.detail), int(r.count), int(r.total), tname if i == 0 else "", names.names)
                 for i, r in enumerate(grp.itertuples(index=False))]
        out.append({
            "run_id": run_id, "step": int(Ld["step"][li]), "layer": int(Ld["layer"][li]), "tp_rank": int(Ld["rank"][li]),
            "source": SOURCES[Ld["source"][li]], "capture_seq": int(Ld["capture_seq"][li]), "tensor": tname,
            "total": int(grp["total"].iloc[0]),
            "counts": [{"verdict": VERDICTS[int(r.verdict)], "detail": int(r.detail), "count": int(r.count)}
                       for r in grp.itertuples(index=False)],
            "sentence": f"{label}: " + ", ".join(frags),
        })
    # order: as loads are ordered for the first divergence, then by copy order of the tensor
    out.sort(key=lambda s: (s["run_id"], s["step"], s["layer"], SOURCES.index(s["source"]), s["tp_rank"],
                            _copy_rank(s["tensor"])))
    return out


def _copy_rank(t: str) -> int:
    try:
        return copy_position(t)
    except KeyError:
        return 99
