"""Trace ⋈ index -> verdicts -> loads, coverage, first divergence, summaries, totals.

``analyze(paths, index=..., checkpoint=...)`` returns a ``Report``: ``report.doc``
is the JSON document (schema in docs/analysis.md), ``report.exit_code`` the
audit exit code, and ``report.grid`` the per-cell data behind the plot.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from moetrace import __version__
from moetrace.analysis.inputs import (
    SOURCES,
    IndexData,
    TraceData,
    Vocab,
    pair_to_hex,
    read_index,
    read_trace,
)
from moetrace.analysis.verdicts import (
    CONSTANT,
    MATCH,
    MISSING,
    OUT_OF_SCOPE,
    STALE,
    TORN,
    UNEXPECTED,
    UNKNOWN,
    VERDICTS,
    WRONG_LAYER,
    WRONG_RANK,
    WRONG_TENSOR,
    ZEROS,
    KeyLookup,
    Verdicts,
    classify,
)
from moetrace.errors import MoetraceError

JSON_SCHEMA = "moetrace.analysis"
JSON_VERSION = 1
MAX_ROWS_DEFAULT = 1000  # divergent rows listed in the JSON document
MAX_MISSING_LISTED = 64  # missing (expert, tensor) entries listed per load

EXIT_OK, EXIT_DIVERGENT, EXIT_INCOMPLETE = 0, 1, 2


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


@dataclass
class Report:
    doc: dict
    grid: Grid | None = None
    exit_code: int = EXIT_OK
    analysis: "Analysis | None" = None  # the intermediate results (JUnit and plot read them)


# ---------------------------------------------------------------- sentences


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


# ---------------------------------------------------------------- analysis


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
            self.loads = pd.DataFrame(columns=["run", "step", "layer", "rank", "source", "load_seq"])
            return
        step0 = int(c["step"].min())
        ns = int(c["step"].max()) - step0 + 1
        nl = int(c["layer"].max()) + 1
        nr = int(c["rank"].max()) + 1
        nrun = len(self.data.run_ids) or 1
        staged = c["source"] == 0
        ls = c["load_seq"]
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
            "load_seq": np.where(c["source"][first] == 0, c["load_seq"][first], -1).astype(np.int64),
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
        c, v, lk, L = self.data.cols, self.v, self.lookup, self.loads
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
        o = np.lexsort((c["rank"][rows], c["copy_order"][rows], c["transport_order"][rows], c["source"][rows],
                        c["layer"][rows], c["step"][rows], c["run"][rows]))
        return rows[o]

    def row_doc(self, i: int) -> dict:
        c, v, idx, d = self.data.cols, self.v, self.idx, self.data
        code = int(v.verdict[i])
        doc = {
            "run_id": d.run_ids.names[int(c["run"][i])],
            "step": int(c["step"][i]),
            "layer": int(c["layer"][i]),
            "tp_rank": int(c["rank"][i]),
            "source": SOURCES[int(c["source"][i])],
            "load_seq": int(c["load_seq"][i]),
            "transport_order": int(c["transport_order"][i]),
            "copy_order": int(c["copy_order"][i]),
            "expert": int(c["expert"][i]),
            "tensor": d.tensors.names[int(c["tensor"][i])],
            "verdict": VERDICTS[code],
            "k": None,
            "found": None,
            "value": v.value.get(i),
            "chunks": None,
            "fp": pair_to_hex(int(c["hi"][i]), int(c["lo"][i])),
            "expected_fp": pair_to_hex(int(idx.hi[v.pos[i]]), int(idx.lo[v.pos[i]])) if v.pos[i] >= 0 else None,
        }
        f = int(v.found[i])
        if f >= 0:
            doc["k"] = int(v.k[i])
            doc["found"] = {"tp_rank": int(idx.rank[f]), "layer": int(idx.layer[f]), "expert": int(idx.expert[f]),
                            "tensor": d.tensors.names[int(idx.tensor[f])]}
        if code == TORN:
            doc["chunks"] = [dict(g) for g in v.torn.get(i, [])]
        doc["sentence"] = self.sentence(doc, no_chunks=i in v.no_chunks)
        return doc

    def what(self, doc: dict, no_chunks: bool = False) -> str:
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
            " (no chunk fingerprints recorded, so a torn copy cannot be told apart)" if no_chunks else ""
        )

    def sentence(self, doc: dict, with_prefix: bool = True, no_chunks: bool = False) -> str:
        pre = f"step {doc['step']}, layer {doc['layer']}, " if with_prefix else ""
        return f"{pre}rank {doc['tp_rank']}, expert {doc['expert']}: {self.what(doc, no_chunks)}"


# ---------------------------------------------------------------- report


def _summary_fragment(verdict: int, detail: int, count: int, total: int, tensor: str, names: Vocab) -> str:
    frac = f"{count}/{total}" + (f" {tensor}" if tensor else "")
    if verdict == STALE:
        return f"{frac} are E{detail:+d}"
    if verdict == WRONG_RANK:
        return f"{frac} hold rank {detail}'s shard"
    if verdict == WRONG_LAYER:
        return f"{frac} hold layer {detail}'s tensors"
    if verdict == WRONG_TENSOR:
        return f"{frac} hold {names.names[detail]}"
    word = {ZEROS: "are zeros", CONSTANT: "are constant fills", TORN: "are torn", UNKNOWN: "are unknown",
            UNEXPECTED: "are not in the index", MISSING: "are missing"}[verdict]
    return f"{frac} {word}"


def steps_text(steps) -> str:
    """'step 3' for one step, 'steps 0-9,12' for several (an int is one step)."""
    if isinstance(steps, (int, np.integer)):
        return f"step {int(steps)}"
    xs = sorted({int(x) for x in steps})
    return f"step {xs[0]}" if len(xs) == 1 else f"steps {_ranges(xs)}"


def _load_label(run_id: str, rank: int, layer: int, step, source: str, multi_source: bool, multi_run: bool) -> str:
    """'rank R, layer L, step S' (+ ' (source)' when the trace has several sources, 'run: ' in
    front when it has several runs); ``step`` may be a list of steps: 'steps 0-9,12'."""
    s = f"rank {rank}, layer {layer}, {steps_text(step)}"
    if multi_source:
        s += f" ({source})"
    if multi_run:
        s = f"{run_id}: " + s
    return s


def build_report(a: Analysis, inputs: list[str], max_rows: int = MAX_ROWS_DEFAULT) -> Report:
    d, c, v, idx, L = a.data, a.data.cols, a.v, a.idx, a.loads
    names = d.tensors
    vv = v.verdict
    scope = a.scope
    multi_run = len(d.runs) > 1
    multi_source = bool(len(L)) and L["source"].nunique() > 1
    warnings: list[str] = []
    incomplete: list[str] = []

    # ---- per-verdict totals
    counts = np.bincount(vv[scope].astype(np.int64), minlength=len(VERDICTS)) if scope.any() else np.zeros(len(VERDICTS), np.int64)
    missing_in_loads = int(L["missing"].sum()) if len(L) else 0
    missing_loads_entries = int(a.missing_loads["expected"].sum()) if len(a.missing_loads) else 0
    counts[MISSING] = missing_in_loads + missing_loads_entries
    by_verdict = {VERDICTS[i]: int(counts[i]) for i in range(len(VERDICTS))}
    in_scope_rows = int(scope.sum())
    total = in_scope_rows + int(counts[MISSING])
    n_match = int(counts[MATCH])
    steps = int(L["step"].nunique()) if len(L) else 0
    ranks = sorted(int(r) for r in L["rank"].unique()) if len(L) else []
    nrk = int(c["rank"].max()) + 1 if d.n else 1
    per_run_rank = np.bincount(c["run"].astype(np.int64) * nrk + c["rank"], minlength=max(len(d.run_ids), 1) * nrk) if d.n else None

    def rows_of(rc: int, r: int | None = None) -> int:
        if per_run_rank is None:
            return 0
        blk = per_run_rank[rc * nrk : (rc + 1) * nrk]
        return int(blk.sum()) if r is None else (int(blk[r]) if 0 <= r < nrk else 0)
    divergent = in_scope_rows - n_match

    # ---- runs, manifests, completeness
    runs_doc = []
    for run in d.runs:
        rc = d.run_ids.code(run.run_id)
        rows_run = rows_of(rc)
        mans = []
        for r in sorted(run.ranks):
            rk = run.ranks[r]
            layers_s, experts_s, tensors_s = rk.sampling()
            mans.append({
                "tp_rank": r, "finished": rk.finished, "rows_written": rk.rows_written,
                "rows_dropped": rk.rows_dropped, "hook_errors": rk.errors, "parts": len(rk.parts),
                "rows_read": rows_of(rc, r),
                "sampled_layers": sorted(layers_s) if layers_s is not None else None,
                "sampled_experts": sorted(experts_s) if experts_s is not None else None,
                "sampled_tensors": sorted(tensors_s) if tensors_s is not None else None,
                "disabled": bool(rk.manifest.get("disabled")),
            })
            if not rk.finished:
                incomplete.append(f"run {run.run_id} rank {r}: manifest says the tracer did not finish")
            if rk.rows_dropped:
                incomplete.append(f"run {run.run_id} rank {r}: {fmt_int(rk.rows_dropped)} rows dropped by the tracer")
            if rk.errors:
                incomplete.append(f"run {run.run_id} rank {r}: {fmt_int(rk.errors)} hook/sink errors")
            if rk.manifest.get("disabled"):
                why = rk.manifest.get("disabled_reason") or "no reason recorded"
                incomplete.append(f"run {run.run_id} rank {r}: tracing disabled itself ({why})")
            if mans[-1]["rows_read"] == 0:
                incomplete.append(f"run {run.run_id} rank {r}: nothing captured")
            elif rk.rows_written and mans[-1]["rows_read"] < rk.rows_written:
                incomplete.append(
                    f"run {run.run_id} rank {r}: read {fmt_int(mans[-1]['rows_read'])} of {fmt_int(rk.rows_written)} rows the manifest says were written"
                )
        if not run.checkpoint_id:
            warnings.append(f"run {run.run_id}: manifests record no checkpoint_id, so the index's checkpoint cannot be confirmed")
        for r in run.missing_ranks:
            incomplete.append(f"run {run.run_id}: rank {r} missing (no rank={r} folder)")
        rj = run.run_json or {}
        code = rj.get("server_exit_code")
        if rj.get("finished") and code not in (None, 0) and not rj.get("stop_reason"):
            # the launcher did not stop it: the server died, whatever the ranks wrote
            incomplete.append(f"run {run.run_id}: the server exited with code {code} on its own (_run.json)")
        # layers the index (and sampling) expect that no rank of the run captured
        lay_idx = set(np.unique(idx.layer).tolist())
        rk0 = next(iter(run.ranks.values()), None)
        sl = rk0.sampling()[0] if rk0 else None
        if sl is not None:
            lay_idx &= sl
        seen_layers = set(L.loc[L["run"] == rc, "layer"].tolist()) if len(L) else set()
        never = sorted(lay_idx - seen_layers)
        if never and rows_run:
            incomplete.append(f"run {run.run_id}: layer(s) {_ranges(never)} never captured")
        runs_doc.append({
            "run_id": run.run_id, "path": run.path, "checkpoint_id": run.checkpoint_id, "tp_size": run.tp_size,
            "ep_size": run.ep_size, "ranks_expected": run.expected_ranks, "ranks_present": sorted(run.ranks),
            "ranks_missing": run.missing_ranks, "rows": rows_run, "manifests": mans,
        })
    for p, why in d.skipped_parts:
        warnings.append(f"skipped unreadable part {p}: {why}")
    if d.skipped_parts:
        incomplete.append(f"{fmt_int(len(d.skipped_parts))} unreadable Parquet part(s) skipped")
    oos = int((vv == OUT_OF_SCOPE).sum())
    if oos:
        warnings.append(f"{fmt_int(oos)} rows of layers/ranks the index does not cover were ignored")
    if missing_in_loads:
        incomplete.append(f"{fmt_int(missing_in_loads)} expected entries not captured in their loads")
    if len(a.missing_loads):
        incomplete.append(
            f"{fmt_int(len(a.missing_loads))} load(s) captured on some ranks but not others ({fmt_int(missing_loads_entries)} entries)"
        )
    dups = int(L["duplicates"].clip(lower=0).sum()) if len(L) else 0
    if dups:
        warnings.append(f"{fmt_int(dups)} entries captured more than once within a load")
    if v.no_chunks:
        warnings.append(
            f"{fmt_int(len(v.no_chunks))} unknown rows have no chunk fingerprints: torn copies cannot be told from unknown content"
        )
    if in_scope_rows == 0:
        incomplete.append("nothing in the index's scope was captured")

    # ---- first divergence per run
    drows = a.order_rows(a.divergent_rows())
    first_docs = []
    for run in d.runs:
        rc = d.run_ids.code(run.run_id)
        rr = drows[c["run"][drows] == rc]
        if len(rr) == 0:
            continue
        f0 = int(rr[0])
        key = [c[k][f0] for k in ("step", "layer", "source", "transport_order", "copy_order")]
        same = rr[(c["step"][rr] == key[0]) & (c["layer"][rr] == key[1]) & (c["source"][rr] == key[2])
                  & (c["transport_order"][rr] == key[3]) & (c["copy_order"][rr] == key[4])]
        entries = [a.row_doc(int(i)) for i in same]
        sent = "; ".join([entries[0]["sentence"]] + [
            a.sentence(e, with_prefix=False, no_chunks=int(i) in v.no_chunks) for e, i in zip(entries[1:], same[1:])
        ])
        if multi_run:
            sent = f"{run.run_id}: {sent}"
        first_docs.append({
            "run_id": run.run_id, "step": int(key[0]), "layer": int(key[1]), "source": SOURCES[int(key[2])],
            "transport_order": int(key[3]), "copy_order": int(key[4]),
            "ranks": sorted({e["tp_rank"] for e in entries}), "entries": entries, "sentence": sent,
        })

    # ---- summaries per (load, tensor)
    summaries = _summaries(a, drows, multi_source, multi_run)

    # ---- divergent rows listed
    listed = [a.row_doc(int(i)) for i in drows[:max_rows]]

    # ---- loads
    loads_doc = []
    if len(L):
        Lx = L.copy()
        Lx["divergent"] = np.bincount(a.load[drows], minlength=len(L)) if len(drows) else 0
        for li, row in enumerate(Lx.itertuples(index=False)):
            doc = {
                "run_id": d.run_ids.names[row.run], "step": int(row.step), "layer": int(row.layer),
                "tp_rank": int(row.rank), "source": SOURCES[row.source], "load_seq": int(row.load_seq),
                "rows": int(row.rows), "expected": int(row.expected), "captured": int(row.captured),
                "missing": int(row.missing), "divergent": int(row.divergent), "duplicates": max(0, int(row.duplicates)),
            }
            if li in a.missing_entries:
                m = a.missing_entries[li]
                doc["missing_entries"] = [
                    {"expert": int(idx.expert[p]), "tensor": names.names[int(idx.tensor[p])]} for p in m[:MAX_MISSING_LISTED]
                ]
                doc["missing_entries_truncated"] = max(0, len(m) - MAX_MISSING_LISTED)
            loads_doc.append(doc)
    missing_loads_doc = [
        {"run_id": d.run_ids.names[int(r.run)], "step": int(r.step), "layer": int(r.layer), "tp_rank": int(r.rank),
         "source": SOURCES[int(r.source)], "expected": int(r.expected)}
        for r in a.missing_loads.itertuples(index=False)
    ]

    # ---- totals sentence
    sentence = (f"{fmt_int(n_match)}/{fmt_int(total)} tensors match across {fmt_int(steps)} step{'s' if steps != 1 else ''}, "
                f"{fmt_int(len(ranks))} rank{'s' if len(ranks) != 1 else ''}")
    extra = [f"{fmt_int(by_verdict[VERDICTS[i]])} {VERDICTS[i].replace('_', ' ')}" for i in range(1, len(VERDICTS))
             if by_verdict[VERDICTS[i]]]
    if extra:
        sentence += "; " + ", ".join(extra)

    if divergent:
        status, code = "divergent", EXIT_DIVERGENT
    elif incomplete:
        status, code = "incomplete", EXIT_INCOMPLETE
    else:
        status, code = "match", EXIT_OK

    doc = {
        "schema": JSON_SCHEMA,
        "version": JSON_VERSION,
        "moetrace_version": __version__,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "inputs": {"trace": list(inputs), "index": a.index_path, "checkpoint_id": idx.checkpoint_id,
                   "tp_size": idx.tp_size, "ep_size": idx.ep_size, "index_entries": int(idx.n)},
        "status": status,
        "audit_exit_code": code,
        "totals": {
            "rows_read": int(d.n), "rows_in_scope": in_scope_rows, "rows_out_of_scope": oos,
            "tensors": total, "match": n_match, "divergent": divergent, "missing": int(counts[MISSING]),
            "by_verdict": by_verdict, "steps": steps, "ranks": ranks, "loads": int(len(L)),
            "sentence": sentence,
        },
        "incomplete": incomplete,
        "warnings": warnings,
        "first_divergence": first_docs,
        "summaries": summaries,
        "runs": runs_doc,
        "skipped_parts": [{"path": p, "reason": why} for p, why in d.skipped_parts],
        "loads": loads_doc,
        "missing_loads": missing_loads_doc,
        "divergent_rows": listed,
        "divergent_rows_truncated": max(0, len(drows) - max_rows),
    }
    rep = Report(doc=doc, grid=_grid(a, drows), exit_code=code)
    return rep


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _summaries(a: Analysis, drows: np.ndarray, multi_source: bool, multi_run: bool) -> list[dict]:
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
        label = _load_label(run_id, Ld["rank"][li], Ld["layer"][li], Ld["step"][li], SOURCES[Ld["source"][li]],
                            multi_source, multi_run)
        tname = names.names[int(t)]
        frags = [_summary_fragment(int(r.verdict), int(r.detail), int(r.count), int(r.total), tname if i == 0 else "", names)
                 for i, r in enumerate(grp.itertuples(index=False))]
        out.append({
            "run_id": run_id, "step": int(Ld["step"][li]), "layer": int(Ld["layer"][li]), "tp_rank": int(Ld["rank"][li]),
            "source": SOURCES[Ld["source"][li]], "load_seq": int(Ld["load_seq"][li]), "tensor": tname,
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
    from moetrace.tracer.schema import copy_order

    try:
        return copy_order(t)
    except KeyError:
        return 99


# plot severity: which verdict a cell shows when its tensors/steps disagree
SEVERITY = {MATCH: 0, MISSING: 1, UNEXPECTED: 2, CONSTANT: 3, ZEROS: 4, UNKNOWN: 5, WRONG_TENSOR: 6,
            WRONG_LAYER: 7, WRONG_RANK: 8, TORN: 9, STALE: 10}
_BY_SEVERITY = sorted(SEVERITY, key=SEVERITY.get)


def _grid(a: Analysis, drows: np.ndarray) -> Grid | None:
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


# ---------------------------------------------------------------- entry points


def check_layout(data: TraceData, idx: IndexData, checkpoint: str | None = None) -> None:
    """The index must be for the trace's TP/EP layout and checkpoint. ``checkpoint``: the
    --checkpoint folder the index was built from, named in the message instead of the cache file."""
    for run in data.runs:
        if run.tp_size != idx.tp_size or run.ep_size != idx.ep_size:
            what = f"the index of --checkpoint {checkpoint} ({idx.path})" if checkpoint else f"index {idx.path}"
            raise MoetraceError(
                f"run {run.run_id} is TP{run.tp_size} EP{run.ep_size} but {what} is for TP{idx.tp_size} EP{idx.ep_size}"
            )
        if run.checkpoint_id and idx.checkpoint_id and run.checkpoint_id != idx.checkpoint_id:
            if checkpoint:
                raise MoetraceError(_checkpoint_mismatch(checkpoint, idx.checkpoint_id, run))
            raise MoetraceError(
                f"run {run.run_id} traced checkpoint {run.checkpoint_id!r} but index {idx.path} is for {idx.checkpoint_id!r}"
            )


def _checkpoint_mismatch(checkpoint: str, identity: str, run) -> str:
    return (f"--checkpoint {checkpoint} is checkpoint {identity}, but trace {run.path} (run {run.run_id}) "
            f"was captured from checkpoint {run.checkpoint_id}")


def check_checkpoint(data: TraceData, checkpoint: str) -> None:
    """Fail fast, before any index is built: the --checkpoint folder's identity (headers only)
    must be the checkpoint_id the trace's manifests recorded."""
    from moetrace.checkpoints.reader import open_checkpoint

    try:
        identity = open_checkpoint(checkpoint).identity
    except MoetraceError:
        raise
    except Exception as err:
        raise MoetraceError(f"--checkpoint {checkpoint}: cannot read the checkpoint: {type(err).__name__}: {err}") from None
    for run in data.runs:
        if run.checkpoint_id and run.checkpoint_id != identity:
            raise MoetraceError(_checkpoint_mismatch(checkpoint, identity, run))


def resolve_index(data: TraceData, index: str | None, checkpoint: str | None) -> str:
    if index and checkpoint:
        raise MoetraceError("pass --index or --checkpoint, not both")
    if index:
        return index
    if not checkpoint:
        raise MoetraceError("pass --index FILE or --checkpoint CKPT so the trace can be compared with the expected shards")
    try:
        from moetrace.tracer.index import cached_index
    except ImportError:
        raise MoetraceError("this moetrace cannot build an index (moetrace.tracer.index.cached_index is missing); pass --index") from None
    layouts = {(r.tp_size, r.ep_size) for r in data.runs}
    if len(layouts) != 1:
        raise MoetraceError(f"runs use several TP/EP layouts {sorted(layouts)}; analyze them separately")
    (tp, ep), = layouts
    check_checkpoint(data, checkpoint)
    got = cached_index(checkpoint, tp, ep)
    return str(got[0] if isinstance(got, tuple) else got)


def analyze(paths: Sequence[str], index: str | None = None, checkpoint: str | None = None,
            max_rows: int = MAX_ROWS_DEFAULT) -> Report:
    """Analyze traces against an index (or a checkpoint, via the index cache)."""
    if isinstance(paths, str):
        paths = [paths]
    data = read_trace(paths)
    if data.n == 0:
        why = f"; {len(data.skipped_parts)} unreadable part(s) skipped, first {data.skipped_parts[0][0]}" if data.skipped_parts else ""
        raise MoetraceError(f"trace {', '.join(paths)} holds no rows: nothing was captured{why}")
    index_path = resolve_index(data, index, checkpoint)
    idx = read_index(index_path, data.tensors, data.dtypes)
    check_layout(data, idx, checkpoint=None if index else checkpoint)
    a = Analysis(data, idx, index_path)
    rep = build_report(a, list(paths), max_rows=max_rows)
    rep.analysis = a
    return rep
