"""The per-cell data behind the plot: worst verdict per (run, rank, layer, expert)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrace.analysis.coverage import Analysis
from moetrace.analysis.verdicts import (
    CONSTANT, MATCH, MISSING, STALE, TORN, UNEXPECTED, UNKNOWN, VERDICTS, WRONG_LAYER, WRONG_RANK, WRONG_TENSOR, ZEROS,
)


@dataclass
class Grid:
    """Worst verdict per (run, rank, layer, expert) cell, for the plot."""

    runs: list[str]
    ranks: list[int]
    layers: np.ndarray  # layer ids along the y axis
    experts: np.ndarray  # expert ids along the x axis
    verdict: np.ndarray  # int8 [runs, ranks, layers, experts]; -1 = nothing expected
    k: np.ndarray  # int32, E+k offset of stale cells
    steps: int = 0


# plot severity: which verdict a cell shows when its tensors/steps disagree
SEVERITY = {MATCH: 0, MISSING: 1, UNEXPECTED: 2, CONSTANT: 3, ZEROS: 4, UNKNOWN: 5, WRONG_TENSOR: 6,
            WRONG_LAYER: 7, WRONG_RANK: 8, TORN: 9, STALE: 10}
_BY_SEVERITY = sorted(SEVERITY, key=SEVERITY.get)


def build_grid(a: Analysis, drows: np.ndarray) -> Grid | None:
    """Worst verdict per (run, rank, layer, expert) cell; None without runs."""
    d, c, v, idx, L = a.data, a.data.cols, a.v, a.idx, a.loads
    if not len(d.runs):
        return None
    layers = np.unique(idx.layer)
    experts = np.unique(idx.expert)
    ranks = sorted({r for run in d.runs for r in run.expected_ranks} | {int(r) for r in np.unique(idx.rank)})
    nr, nl, ne = len(ranks), len(layers), len(experts)
    runs = [r.run_id for r in d.runs]
    run_pos = np.full(max(len(d.run_ids), 1), 0, np.int64)
    for i, r in enumerate(runs):
        run_pos[d.run_ids.code(r)] = i
    rank_pos = {r: i for i, r in enumerate(ranks)}
    sev = np.full((len(runs), nr, nl, ne), -1, dtype=np.int8)
    kk = np.zeros(sev.shape, dtype=np.int32)

    def cells(run_c, rank, layer, expert):
        rp = np.array([rank_pos.get(int(x), 0) for x in range(max(ranks) + 1)], np.int64)[rank]
        return (run_pos[run_c], rp, np.searchsorted(layers, layer), np.searchsorted(experts, expert))

    for (rc, rk, _layer), p in a.captured_entries.items():
        sev[cells(np.full(len(p), rc), idx.rank[p], idx.layer[p], idx.expert[p])] = 0
    # missing entries and loads
    if a.missing_entries:
        ml = np.concatenate([np.full(len(p), li) for li, p in a.missing_entries.items()])
        mp = np.concatenate(list(a.missing_entries.values()))
        cl = cells(L["run"].to_numpy()[ml], idx.rank[mp], idx.layer[mp], idx.expert[mp])
        np.maximum.at(sev, cl, SEVERITY[MISSING])
    for r in a.missing_loads.itertuples(index=False):
        s, em = a._expected_mask(int(r.run), int(r.rank), int(r.layer))
        p = s + np.flatnonzero(em)
        cl = cells(np.full(len(p), r.run), idx.rank[p], idx.layer[p], idx.expert[p])
        np.maximum.at(sev, cl, SEVERITY[MISSING])
    if len(drows):
        dv = np.array([SEVERITY[int(x)] for x in range(len(VERDICTS))], np.int8)[v.verdict[drows]]
        ok2 = v.pos[drows] >= 0
        dr = drows[ok2]
        cl = cells(c["run"][dr], c["rank"][dr], c["layer"][dr], c["expert"][dr])
        np.maximum.at(sev, cl, dv[ok2])
        st = dr[v.verdict[dr] == STALE]
        if len(st):
            kk[cells(c["run"][st], c["rank"][st], c["layer"][st], c["expert"][st])] = v.k[st]
    verdict = np.where(sev >= 0, np.array(_BY_SEVERITY, np.int8)[np.maximum(sev, 0)], -1).astype(np.int8)
    steps = int(L["step"].nunique()) if len(L) else 0
    return Grid(runs=runs, ranks=ranks, layers=layers, experts=experts, verdict=verdict, k=kk, steps=steps)
