"""Trace ⋈ index: verdicts per row, the loads they form, and what each load covered.

``Analysis(data, idx, index_path)`` holds every intermediate result (verdicts,
loads, expected/captured/missing per load, loads absent on some ranks); the
report, renderers, plot and diff read from it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moetrace.analysis.expected import IndexData
from moetrace.analysis.trace import TraceData
from moetrace.analysis.verdicts import MATCH, OUT_OF_SCOPE, KeyLookup, Verdicts, classify


class Analysis:
    """All intermediate results of one analysis; build once, render many ways."""

    def __init__(self, data: TraceData, idx: IndexData, index_path: str):
        self.data, self.idx, self.index_path = data, idx, index_path
        self.lookup = KeyLookup(idx, len(data.tensors))
        self.v: Verdicts = classify(data, idx, self.lookup)
        self._loads()
        self._coverage()

    # -- loads ---------------------------------------------------------------

    def _loads(self) -> None:
        c, v = self.data.cols, self.v
        n = self.data.n
        scope = v.verdict != OUT_OF_SCOPE
        self.scope = scope
        if n == 0 or not scope.any():
            self.load = np.full(n, -1, dtype=np.int64)
            self.loads = pd.DataFrame(columns=["run", "step", "layer", "rank", "source", "capture_seq"])
            return
        step0 = int(c["step"].min())
        ns = int(c["step"].max()) - step0 + 1
        nl = int(c["layer"].max()) + 1
        nr = int(c["rank"].max()) + 1
        nrun = len(self.data.run_ids) or 1
        staged = c["source"] == 0
        ls = c["capture_seq"]
        ls0 = int(ls.min())
        nls = int(ls.max()) - ls0 + 2
        if nrun * ns * nl * nr * 2 * nls < (1 << 62) and int(c["layer"].min()) >= 0 and int(c["rank"].min()) >= 0:
            key = (((c["run"].astype(np.int64) * ns + (c["step"] - step0)) * nl + c["layer"]) * nr + c["rank"]) * 2 + c["source"]
            key = key * nls + np.where(staged, ls - ls0 + 1, 0)
            key = np.where(scope, key, -1)
            codes, uniques = pd.factorize(key)
        else:  # huge id ranges: let pandas hash the tuple
            df = pd.DataFrame({k: c[k] for k in ("run", "step", "layer", "rank", "source")})
            df["ls"] = np.where(staged, ls, np.iinfo(np.int64).min)
            codes = df.groupby(list(df.columns), sort=False).ngroup().to_numpy()
            codes = np.where(scope, codes, -1)
            codes, uniques = pd.factorize(codes)
        # drop the out-of-scope pseudo load
        codes = codes.astype(np.int64)
        first = np.empty(len(uniques), dtype=np.int64)
        first[codes[::-1]] = np.arange(n - 1, -1, -1)
        bad = np.flatnonzero(~scope[first])
        if len(bad):
            b = int(bad[0])
            codes = np.where(codes == b, -1, np.where(codes > b, codes - 1, codes))
            first = np.delete(first, b)
        self.load = codes
        self.loads = pd.DataFrame({
            "run": c["run"][first].astype(np.int64),
            "step": c["step"][first].astype(np.int64),
            "layer": c["layer"][first].astype(np.int64),
            "rank": c["rank"][first].astype(np.int64),
            "source": c["source"][first].astype(np.int64),
            "capture_seq": np.where(c["source"][first] == 0, c["capture_seq"][first], -1).astype(np.int64),
        })
        self.loads["rows"] = np.bincount(codes[codes >= 0], minlength=len(first))

    # -- coverage ------------------------------------------------------------

    def _expert_masks(self) -> dict[tuple[int, int], np.ndarray | None]:
        """(run code, rank) -> bool mask over index entries in the sampling scope (None = all)."""
        out = {}
        for run in self.data.runs:
            rc = self.data.run_ids.code(run.run_id)
            for r in set(run.expected_ranks) | set(run.ranks):
                rk = run.ranks.get(r) or next(iter(run.ranks.values()), None)
                _, experts, tensors = rk.sampling() if rk is not None else (None, None, None)
                mask = None
                if experts is not None:
                    mask = np.isin(self.idx.expert, np.array(sorted(experts), dtype=np.int64))
                if tensors is not None:
                    codes = np.array([self.data.tensors.code(t) for t in sorted(tensors)], dtype=np.int64)
                    tm = np.isin(self.idx.tensor, codes)
                    mask = tm if mask is None else mask & tm
                out[(rc, r)] = mask
        return out

    def _expected_mask(self, run_code: int, rank: int, layer: int) -> tuple[int, np.ndarray]:
        """(block start, bool mask of the block's entries that are expected)."""
        lk = self.lookup
        b = int(lk.block_of(np.array([rank]), np.array([layer]))[0])
        if b < 0:
            return -1, np.zeros(0, dtype=bool)
        s, n = int(lk.block_start[b]), int(lk.block_len[b])
        em = self.emasks.get((run_code, rank))
        return s, (np.ones(n, dtype=bool) if em is None else em[s : s + n].copy())

    def _coverage(self) -> None:
        v, lk, L = self.v, self.lookup, self.loads
        self.emasks = self._expert_masks()
        nl = len(L)
        L["expected"] = 0
        L["captured"] = 0
        L["missing"] = 0
        L["duplicates"] = 0
        self.missing_entries: dict[int, np.ndarray] = {}  # load -> index positions not captured
        self.captured_entries: dict[tuple, np.ndarray] = {}  # (run, rank, layer) -> index positions seen
        if nl == 0:
            self.missing_loads = self._missing_loads()
            return
        ok = (self.load >= 0) & (v.pos >= 0)
        rows_ok = np.flatnonzero(ok) if not ok.all() else None
        load = self.load if rows_ok is None else self.load[rows_ok]
        pos = v.pos if rows_ok is None else v.pos[rows_ok]
        blk_of_load = lk.block_of(L["rank"].to_numpy(), L["layer"].to_numpy())
        start_of_load = lk.block_start[np.maximum(blk_of_load, 0)]
        width = int(lk.block_len.max())
        j = pos - start_of_load[load]
        batch = max(1, (1 << 27) // max(width, 1))
        captured = np.zeros(nl, dtype=np.int64)
        distinct_all = np.zeros(nl, dtype=np.int64)
        expected = np.zeros(nl, dtype=np.int64)
        group_key = L["run"].to_numpy() * (1 << 40) + L["rank"].to_numpy() * (1 << 20) + L["layer"].to_numpy()
        for a in range(0, nl, batch):
            b = min(nl, a + batch)
            sel = (load >= a) & (load < b) if (a > 0 or b < nl) else slice(None)
            bm = np.zeros((b - a, width), dtype=bool)
            bm[load[sel] - a, j[sel]] = True
            distinct_all[a:b] = bm.sum(axis=1)
            gk = group_key[a:b]
            for g in np.unique(gk):
                ls = np.flatnonzero(gk == g)
                lrow = L.iloc[a + ls[0]]
                gid = (int(lrow["run"]), int(lrow["rank"]), int(lrow["layer"]))
                s, em = self._expected_mask(*gid)
                if s >= 0:
                    seen = s + np.flatnonzero(bm[ls].any(axis=0))
                    prev = self.captured_entries.get(gid)
                    self.captured_entries[gid] = seen if prev is None else np.union1d(prev, seen)
                full = np.zeros(width, dtype=bool)
                full[: len(em)] = em
                got = bm[ls] & full
                expected[a + ls] = int(em.sum())
                captured[a + ls] = got.sum(axis=1)
                miss_rows = np.flatnonzero(got.sum(axis=1) < em.sum())
                for m in miss_rows.tolist():
                    self.missing_entries[a + int(ls[m])] = s + np.flatnonzero(full & ~bm[ls[m]])
        L["expected"] = expected
        L["captured"] = captured
        L["missing"] = expected - captured
        L["duplicates"] = L["rows"].to_numpy() - np.bincount(
            self.load[(self.load >= 0) & (v.pos < 0)], minlength=nl
        ) - distinct_all
        self.missing_loads = self._missing_loads()

    def _missing_loads(self) -> pd.DataFrame:
        """Loads some rank of a run captured and another expected rank did not."""
        L = self.loads
        out = []
        for run in self.data.runs:
            rc = self.data.run_ids.code(run.run_id)
            Lr = L[L["run"] == rc] if len(L) else L
            seen = set(zip(Lr["step"], Lr["layer"], Lr["source"])) if len(Lr) else set()
            for r in run.expected_ranks:
                have = set(zip(*(Lr.loc[Lr["rank"] == r, k] for k in ("step", "layer", "source")))) if len(Lr) else set()
                for step, layer, source in sorted(seen - have):
                    s, em = self._expected_mask(rc, r, int(layer))
                    if s < 0:
                        continue
                    out.append((rc, int(step), int(layer), r, int(source), int(em.sum())))
        return pd.DataFrame(out, columns=["run", "step", "layer", "rank", "source", "expected"])

    # -- helpers -------------------------------------------------------------

    def divergent_rows(self) -> np.ndarray:
        vv = self.v.verdict
        return np.flatnonzero((vv != MATCH) & (vv != OUT_OF_SCOPE))

    def order_rows(self, rows: np.ndarray) -> np.ndarray:
        """rows sorted in first-divergence order."""
        c = self.data.cols
        o = np.lexsort((c["rank"][rows], c["copy_position"][rows], c["transport_position"][rows], c["source"][rows],
                        c["layer"][rows], c["step"][rows], c["run"][rows]))
        return rows[o]
