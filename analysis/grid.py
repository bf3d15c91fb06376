"""The per-cell data behind the plot: worst verdict per (run, rank, layer, expert)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrace.analysis.coverage import Analysis
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


@dataclass
class Grid:
    """Worst verdict per (run, rank, layer, expert) cell, for the plot."""

    runs: list[str]
    ranks: list[str]  # rank labels
    layers: np.ndarray  # layer ids along the y axis
    experts: np.ndarray  # expert ids along the x axis
    verdict: np.ndarray  # int8 [runs, ranks, layers, experts]; -1 = nothing expected
    k: np.ndarray  # int32, E+k offset of stale cells
    steps: int = 0
    layer_names: list[str] | None = None  # tick labels of the layer axis ("draft 0" for a draft's layer)


# plot severity: which verdict a cell shows when its tensors/steps disagree. Unknown bytes
# (no shard of the checkpoint) are the least explained and on top: under stale, the
# race's stale w2 scales would hide them in every cell they share.
SEVERITY = {MATCH: 0, MISSING: 1, UNEXPECTED: 2, CONSTANT: 3, ZEROS: 4, WRONG_TENSOR: 5, WRONG_LAYER: 6,
            WRONG_RANK: 7, TORN: 8, STALE: 9, UNKNOWN: 10}
_BY_SEVERITY = sorted(SEVERITY, key=SEVERITY.get)


def build_grid(a: Analysis, drows: np.ndarray) -> Grid | None:
    """Worst verdict per (run, rank, layer, expert) cell; None without runs. A draft's
    layers are rows of their own ("draft 0"), after the target's."""
    d, c, v, idx, L = a.data, a.data.cols, a.verdicts, a.idx, a.loads
    if not len(d.runs):
        return None
    lkeys = np.unique(np.concatenate([idx.lkey, L["lkey"].to_numpy().astype(np.int64)]))
    experts = np.unique(idx.expert)
    ranks = d.labels
    nr, nl, ne = len(ranks), len(lkeys), len(experts)
    runs = [r.run_id for r in d.runs]
    run_pos = np.full(max(len(d.run_ids), 1), 0, np.int64)
    for i, r in enumerate(runs):
        run_pos[d.run_ids.code(r)] = i
    sev = np.full((len(runs), nr, nl, ne), -1, dtype=np.int8)
    kk = np.zeros(sev.shape, dtype=np.int32)

    def cells(run_c, rank, lkey, expert):
        return (run_pos[run_c], np.asarray(rank, np.int64), np.searchsorted(lkeys, lkey),
                np.searchsorted(experts, expert))

    for (rc, rk, _lkey), p in a.captured_entries.items():
        sev[cells(np.full(len(p), rc), np.full(len(p), rk), idx.lkey[p], idx.expert[p])] = 0
    # missing entries (of a known expert) and loads absent on a rank
    for li, entries in a.missing_entries.items():
        ex = np.array([e for _, e, _ in entries if e >= 0], np.int64)
        if len(ex):
            row = L.iloc[li]
            cl = cells(np.full(len(ex), row["run"]), np.full(len(ex), row["rank"]), np.full(len(ex), row["lkey"]), ex)
            np.maximum.at(sev, cl, SEVERITY[MISSING])
    for r in a.missing_loads.itertuples(index=False):
        ex = np.unique(idx.expert[idx.lkey == r.lkey])
        cl = cells(np.full(len(ex), r.run), np.full(len(ex), r.rank), np.full(len(ex), r.lkey), ex)
        np.maximum.at(sev, cl, SEVERITY[MISSING])
    if len(drows):
        dv = np.array([SEVERITY[int(x)] for x in range(len(VERDICTS))], np.int8)[v.verdict[drows]]
        ok2 = v.pos[drows] >= 0
        dr = drows[ok2]
        cl = cells(c["run"][dr], c["rank"][dr], c["lkey"][dr], c["expert"][dr])
        np.maximum.at(sev, cl, dv[ok2])
        st = dr[v.verdict[dr] == STALE]
        if len(st):
            kk[cells(c["run"][st], c["rank"][st], c["lkey"][st], c["expert"][st])] = v.k[st]
    verdict = np.where(sev >= 0, np.array(_BY_SEVERITY, np.int8)[np.maximum(sev, 0)], -1).astype(np.int8)
    steps = int(L["step"].nunique()) if len(L) else 0
    stride = a.layer_stride
    names = [str(k % stride) if k < stride else f"{d.models.names[k // stride]} {k % stride}" for k in lkeys.tolist()]
    return Grid(runs=runs, ranks=list(ranks), layers=lkeys % stride, experts=experts, verdict=verdict, k=kk,
                steps=steps, layer_names=names)
