"""Trace ⋈ index -> the report: totals, completeness, first divergence, summaries, loads.

``analyze(paths, index=..., checkpoint=...)`` returns a ``Report``: ``report.doc``
is the JSON document (schema in docs/analysis.md), ``report.exit_code`` the
audit exit code, and ``report.grid`` the per-cell data behind the plot. Which index
the trace is compared with is analysis.index_choice's.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moetrace import __version__
from moetrace.analysis import weight_updates
from moetrace.analysis.coverage import Analysis
from moetrace.analysis.expected import read_expected
from moetrace.analysis.grid import Grid, build_grid
from moetrace.analysis.index_choice import (
    IndexLayoutMismatch,
    check_index_fits,
    check_index_layout,
    choose_index,
    matching_index,
)
from moetrace.analysis.row_check import RowFacts, merged, rows_problems
from moetrace.analysis.row_facts import index_contradictions, row_facts
from moetrace.analysis.sentences import fmt_int, row_doc, sentence
from moetrace.analysis.staging import staging_problem
from moetrace.analysis.staleness import check_fresh
from moetrace.analysis.summaries import load_summaries
from moetrace.analysis.trace import TraceData, read_trace
from moetrace.analysis.verdicts import MATCH, MISSING, OUT_OF_SCOPE, VERDICTS
from moetrace.errors import ExitCode, MoetraceError
from moetrace.schema import REPORT_SCHEMA, REPORT_SCHEMA_VERSION, SOURCES, format_ids, label_key, parse_rank_label
from moetrace.tracer.claim import refusal_problem
from moetrace.tracer.completeness import guard_vouches, rank_problems, run_file_problems

MAX_ROWS_DEFAULT = 1000  # divergent rows listed in the JSON document
MAX_MISSING_LISTED = 64  # missing (expert, tensor) entries listed per load


@dataclass
class Report:
    doc: dict
    grid: Grid | None = None
    exit_code: ExitCode = ExitCode.PASS
    analysis: Analysis | None = None  # the intermediate results (JUnit and plot read them)


# ---------------------------------------------------------------- sections of the document


def _verdict_counts(a: Analysis) -> np.ndarray:
    vv, scope, L = a.verdicts.verdict, a.scope, a.loads
    counts = (np.bincount(vv[scope].astype(np.int64), minlength=len(VERDICTS)) if scope.any()
              else np.zeros(len(VERDICTS), np.int64))
    missing_in_loads = int(L["missing"].sum()) if len(L) else 0
    missing_loads_entries = int(a.missing_loads["expected"].sum()) if len(a.missing_loads) else 0
    counts[MISSING] = missing_in_loads + missing_loads_entries
    return counts


def _rows_per_rank(a: Analysis):
    """rows_of(run code, rank=None) -> rows read for that run (and rank)."""
    d, c = a.data, a.data.cols
    nrk = int(c["rank"].max()) + 1 if d.n else 1
    per = (np.bincount(c["run"].astype(np.int64) * nrk + c["rank"], minlength=max(len(d.run_ids), 1) * nrk)
           if d.n else None)

    def rows_of(rc: int, r: int | None = None) -> int:
        if per is None:
            return 0
        blk = per[rc * nrk : (rc + 1) * nrk]
        return int(blk.sum()) if r is None else (int(blk[r]) if 0 <= r < nrk else 0)

    return rows_of


def _runs_section(a: Analysis, incomplete: list[str], warnings: list[str]) -> list[dict]:
    """One document per run with its manifests; completeness problems appended to `incomplete`
    (the one rule of tracer.completeness: each manifest, and its rows against it (row_check),
    plus what only a reader can see: rows that did not arrive)."""
    d, L, idx = a.data, a.loads, a.idx
    rows_of = _rows_per_rank(a)
    facts = row_facts(a)
    runs_doc = []
    for run in d.runs:
        rc = d.run_ids.code(run.run_id)
        rows_run = rows_of(rc)
        mans = []
        for r in sorted(run.ranks, key=label_key):
            rk = run.ranks[r]
            layers_s, experts_s, tensors_s = rk.sampling()
            read = rows_of(rc, d.label_code(r))
            mans.append({
                "rank": r, "tp_rank": rk.tp_rank, "pp_rank": rk.pp_rank, "replica": rk.replica,
                "models": rk.manifest.get("models") or {},
                "finished": rk.finished, "rows_written": rk.rows_written,
                "rows_dropped": rk.rows_dropped, "hook_errors": rk.errors, "parts": len(rk.parts), "rows_read": read,
                "sampled_layers": sorted(layers_s) if layers_s is not None else None,
                "sampled_experts": sorted(experts_s) if experts_s is not None else None,
                "sampled_tensors": sorted(tensors_s) if tensors_s is not None else None,
                "disabled": bool(rk.manifest.get("disabled")),
            })
            incomplete += [f"run {run.run_id} rank {r} {p}" for p in rank_problems(rk.manifest)]
            if d.partial:  # a segment's rows: held to the manifest with the other segments' (rank_row_problems)
                continue
            incomplete += [f"run {run.run_id} rank {r} {p}"
                           for p in rows_problems(rk.manifest, facts.get((rc, d.label_code(r)), RowFacts()))]
            for path in rk.unlisted_parts:
                incomplete.append(f"run {run.run_id} rank {r}: {path} is not listed in its manifest "
                                  "(a stale or foreign part; not read)")
            for path in rk.absent_parts:
                incomplete.append(f"run {run.run_id} rank {r}: {path} is listed in its manifest but missing")
            if rk.rows_written and read < rk.rows_written:
                incomplete.append(f"run {run.run_id} rank {r}: read {fmt_int(read)} of {fmt_int(rk.rows_written)} "
                                  "rows the manifest says were written")
            elif rk.rows_written and not read:
                incomplete.append(f"run {run.run_id} rank {r}: nothing captured")
        held = {s for (code, _), f in facts.items() if code == rc for s in f.sources}
        problem = staging_problem(run, held)
        if problem:
            incomplete.append(problem)
        if not run.checkpoint_id:
            warnings.append(f"run {run.run_id}: manifests record no checkpoint_id, so the index's checkpoint cannot be "
                            f"confirmed")
        for r in run.missing_ranks:
            incomplete.append(f"run {run.run_id}: rank {r} missing (no rank={r} folder)")
        incomplete += [f"run {run.run_id}: {refusal_problem(x)}" for x in run.refusals]
        incomplete += [f"run {run.run_id}: {p}" for p in run_file_problems(run.run_json)]
        # target layers the index (and sampling) expect that no rank of the run captured
        target = d.models.code("target")
        expected_layers = set(np.unique(idx.layer[idx.model == target]).tolist())
        rk0 = next(iter(run.ranks.values()), None)
        sampled = rk0.sampling()[0] if rk0 else None
        if sampled is not None:
            expected_layers &= sampled
        whole = [d.label_code(r) for r, rk in run.ranks.items() if not guard_vouches(rk.manifest)]
        mine = (L["run"] == rc) & (L["model"] == target) & L["rank"].isin(whole) if len(L) else None
        seen = set(L.loc[mine, "layer"].tolist()) if len(L) else set()
        never = sorted(expected_layers - seen)
        if never and sum(rows_of(rc, code) for code in whole):
            incomplete.append(f"run {run.run_id}: layer(s) {format_ids(never)} never captured")
        runs_doc.append({
            "run_id": run.run_id, "path": run.path, "checkpoint_id": run.checkpoint_id, "tp_size": run.tp_size,
            "ep_size": run.ep_size, "pp_size": run.pp_size, "ranks_expected": run.expected_ranks,
            "ranks_present": sorted(run.ranks, key=label_key),
            "ranks_missing": run.missing_ranks, "rows": rows_run, "manifests": mans,
        })
    return runs_doc


def _trace_problems(a: Analysis, counts: np.ndarray, incomplete: list[str], warnings: list[str]) -> None:
    d, v, L = a.data, a.verdicts, a.loads
    for p, why in d.skipped_parts:
        warnings.append(f"skipped unreadable part {p}: {why}")
    if d.skipped_parts:
        incomplete.append(f"{fmt_int(len(d.skipped_parts))} unreadable Parquet part(s) skipped")
    oos = int((v.verdict == OUT_OF_SCOPE).sum())
    if oos:
        warnings.append(f"{fmt_int(oos)} rows of layers/ranks the index does not cover were ignored")
    missing_in_loads = int(L["missing"].sum()) if len(L) else 0
    if missing_in_loads:
        incomplete.append(f"{fmt_int(missing_in_loads)} expected entries not captured in their loads")
    if len(a.missing_loads):
        entries = int(a.missing_loads["expected"].sum())
        incomplete.append(f"{fmt_int(len(a.missing_loads))} load(s) captured on some ranks but not others "
                          f"({fmt_int(entries)} entries)")
    dups = int(L["duplicates"].clip(lower=0).sum()) if len(L) else 0
    if dups:
        warnings.append(f"{fmt_int(dups)} entries captured more than once within a load")
    if v.no_chunks:
        warnings.append(f"{fmt_int(len(v.no_chunks))} unknown rows have no chunk digests: "
                        "torn copies cannot be told from unknown content")
    for why, n in a.unreproduced.items():
        incomplete.append(f"{fmt_int(n)} captured entries cannot be checked: {why}")
    if a.slot_sampled:
        warnings.append("expert sampling is on: slots of unsampled experts were not captured, so per-slot coverage "
                        "counts only what was captured")
    incomplete += [f"the trace contradicts the index: {p}" for p in index_contradictions(a)]
    if not a.scope.any() and not guard_verified(a):
        incomplete.append("nothing in the index's scope was captured")


def _first_divergence(a: Analysis, drows: np.ndarray, multi_run: bool) -> list[dict]:
    """Per run: every entry of the first diverging (step, layer, source, position, tensor)."""
    d, c, v = a.data, a.data.cols, a.verdicts
    out = []
    for run in d.runs:
        rc = d.run_ids.code(run.run_id)
        rr = drows[c["run"][drows] == rc]
        if len(rr) == 0:
            continue
        f0 = int(rr[0])
        keys = ("step", "layer", "source", "transport_position", "copy_position")
        key = [c[k][f0] for k in keys]
        same = rr[np.logical_and.reduce([c[k][rr] == x for k, x in zip(keys, key)])]
        entries = [row_doc(a, int(i)) for i in same]
        sent = "; ".join([entries[0]["sentence"]] + [
            sentence(e, with_prefix=False, no_chunks=int(i) in v.no_chunks) for e, i in zip(entries[1:], same[1:])
        ])
        out.append({
            "run_id": run.run_id, "step": int(key[0]), "layer": int(key[1]), "source": SOURCES[int(key[2])],
            "transport_position": int(key[3]), "copy_position": int(key[4]),
            "ranks": sorted({e["rank"] for e in entries}, key=label_key), "entries": entries,
            "sentence": f"{run.run_id}: {sent}" if multi_run else sent,
        })
    return out


def _loads_section(a: Analysis, drows: np.ndarray) -> tuple[list[dict], list[dict]]:
    d, L = a.data, a.loads
    loads_doc = []
    if len(L):
        divergent = np.bincount(a.load[drows], minlength=len(L)) if len(drows) else np.zeros(len(L), np.int64)
        for li, row in enumerate(L.itertuples(index=False)):
            doc = {
                "run_id": d.run_ids.names[row.run], "step": int(row.step), "model": d.models.names[row.model],
                "layer": int(row.layer), "rank": d.labels[row.rank], "tp_rank": parse_rank_label(d.labels[row.rank])[2],
                "source": SOURCES[row.source],
                "capture_seq": int(row.capture_seq), "slots": int(row.slot_count),
                "rows": int(row.rows), "expected": int(row.expected), "captured": int(row.captured),
                "missing": int(row.missing), "divergent": int(divergent[li]), "duplicates": max(0, int(row.duplicates)),
            }
            if li in a.missing_entries:
                m = a.missing_entries[li]
                doc["missing_entries"] = [{"slot": slot, "expert": expert, "tensor": d.tensors.names[t]}
                                          for slot, expert, t in m[:MAX_MISSING_LISTED]]
                doc["missing_entries_truncated"] = max(0, len(m) - MAX_MISSING_LISTED)
            loads_doc.append(doc)
    missing_loads_doc = [
        {"run_id": d.run_ids.names[int(r.run)], "step": int(r.step),
         "model": d.models.names[int(r.lkey) // a.layer_stride],
         "layer": int(r.layer), "rank": d.labels[int(r.rank)], "tp_rank": parse_rank_label(d.labels[int(r.rank)])[2],
         "source": SOURCES[int(r.source)], "expected": int(r.expected)}
        for r in a.missing_loads.itertuples(index=False)
    ]
    return loads_doc, missing_loads_doc


def totals_sentence(t: dict) -> str:
    """The totals' sentence from a report's totals."""
    return _totals_sentence(t["match"], t["tensors"], t["steps"], t["ranks"], t["by_verdict"], t["guard_verified"])


def _totals_sentence(n_match: int, total: int, steps: int, ranks: list[int], by_verdict: dict,
                     guard: int = 0) -> str:
    s = (f"{fmt_int(n_match)}/{fmt_int(total)} tensors match across {fmt_int(steps)} step{'s' if steps != 1 else ''}, "
         f"{fmt_int(len(ranks))} rank{'s' if len(ranks) != 1 else ''}")
    if guard:
        s += f" ({fmt_int(guard)} verified by the in-server guard)"
    extra = [f"{fmt_int(by_verdict[name])} {name.replace('_', ' ')}" for name in VERDICTS[1:] if by_verdict[name]]
    return s + ("; " + ", ".join(extra) if extra else "")


def guard_verified(a: Analysis) -> dict[str, int]:
    """{rank label: matching tensors its guard verified} of the ranks whose guard kept rows of
    mismatches only (tracer.completeness.guard_vouches); their rows hold the mismatches."""
    out = {}
    for run in a.data.runs:
        for label, rk in run.ranks.items():
            if guard_vouches(rk.manifest) and rk.manifest["guard"].get("status") in ("ok", "mismatch"):
                out[label] = out.get(label, 0) + int((rk.manifest["guard"].get("tensors") or {}).get("match") or 0)
    return out


def build_report(a: Analysis, inputs: list[str], max_rows: int = MAX_ROWS_DEFAULT) -> Report:
    d, idx, L = a.data, a.idx, a.loads
    multi_run = len(d.runs) > 1
    multi_source = bool(len(L)) and L["source"].nunique() > 1
    warnings: list[str] = []
    incomplete: list[str] = []
    counts = _verdict_counts(a)
    by_verdict = {VERDICTS[i]: int(counts[i]) for i in range(len(VERDICTS))}
    in_scope_rows = int(a.scope.sum())
    divergent = in_scope_rows - int(counts[MATCH])
    # A guard that kept rows of mismatches only verified the rest in the server: its matches count.
    vouched = guard_verified(a)
    by_verdict["match"] += sum(vouched.values())
    total = in_scope_rows + int(counts[MISSING]) + sum(vouched.values())
    n_match = by_verdict["match"]
    steps = int(L["step"].nunique()) if len(L) else 0
    ranks = (sorted({d.labels[int(r)] for r in L["rank"].unique()} | set(vouched), key=label_key)
             if len(L) or vouched else [])

    runs_doc = _runs_section(a, incomplete, warnings)
    _trace_problems(a, counts, incomplete, warnings)
    drows = a.order_rows(a.divergent_rows())
    loads_doc, missing_loads_doc = _loads_section(a, drows)

    if divergent:
        status, code = "divergent", ExitCode.DIVERGENT
    elif incomplete:
        status, code = "incomplete", ExitCode.INCOMPLETE
    else:
        status, code = "match", ExitCode.PASS
    doc = {
        "schema": REPORT_SCHEMA,
        "version": REPORT_SCHEMA_VERSION,
        "moetrace_version": __version__,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "inputs": {"trace": list(inputs), "index": a.index_path, "checkpoint_id": idx.checkpoint_id,
                   "tp_size": idx.tp_size, "ep_size": idx.ep_size, "index_entries": int(idx.n)},
        "status": status,
        "audit_exit_code": int(code),
        "totals": {
            "rows_read": int(d.n), "rows_in_scope": in_scope_rows, "rows_out_of_scope": int(d.n) - in_scope_rows,
            "tensors": total, "match": n_match, "divergent": divergent, "missing": int(counts[MISSING]),
            "by_verdict": by_verdict, "guard_verified": sum(vouched.values()), "steps": steps, "ranks": ranks,
            "loads": int(len(L)),
            "sentence": _totals_sentence(n_match, total, steps, ranks, by_verdict, sum(vouched.values())),
        },
        "incomplete": incomplete,
        "warnings": warnings,
        "first_divergence": _first_divergence(a, drows, multi_run),
        "summaries": load_summaries(a, drows, multi_source, multi_run),
        "runs": runs_doc,
        "skipped_parts": [{"path": p, "reason": why} for p, why in d.skipped_parts],
        "loads": loads_doc,
        "missing_loads": missing_loads_doc,
        "divergent_rows": [row_doc(a, int(i)) for i in drows[:max_rows]],
        "divergent_rows_truncated": max(0, len(drows) - max_rows),
    }
    return Report(doc=doc, grid=build_grid(a, drows), exit_code=code, analysis=a)


# ---------------------------------------------------------------- the entry point


def analyze(paths: Sequence[str], index: str | None = None, checkpoint: str | None = None,
            max_rows: int = MAX_ROWS_DEFAULT) -> Report:
    """Analyze traces against an index (or a checkpoint, via the index cache)."""
    if isinstance(paths, str):
        paths = [paths]
    data = read_trace(paths)
    if data.n == 0 and not all(guard_vouches(rk.manifest) for run in data.runs for rk in run.ranks.values()):
        skipped = data.skipped_parts
        why = f"; {len(skipped)} unreadable part(s) skipped, first {skipped[0][0]}" if skipped else ""
        raise MoetraceError(f"trace {', '.join(paths)} holds no rows: nothing was captured{why}")
    seg, later, problems = weight_updates.split(data)
    served = _served_folder(data)
    if not later and not problems:
        return _judge(data, paths, index, checkpoint, max_rows, served)
    first = _judge(weight_updates.subset(data, seg == 0), paths, index, checkpoint, max_rows, served)
    reports = []
    for segment in later:
        rep = None
        if segment.unverifiable is None and segment.mask.any():
            part = weight_updates.subset(data, segment.mask, segment.checkpoint_id)
            rep = _judge(part, paths, None, segment.model_path, max_rows, segment.model_path)  # its own index
        elif segment.unverifiable is None:
            continue  # no row after it (the run ended first)
        reports.append((segment, rep))
    problems += _rows_against_manifests(data, [first] + [rep for _, rep in reports if rep is not None])
    return weight_updates.combine(first, reports, problems)


def _rows_against_manifests(data: TraceData, reports: list[Report]) -> list[str]:
    """Every rank's rows, over all segments, held to its manifest (each segment's report skips
    this: its rows are a part of the rank's)."""
    facts: dict = {}
    for rep in reports:
        for key, f in row_facts(rep.analysis).items():
            facts[key] = merged(facts[key], f) if key in facts else f
    out = []
    c = data.cols
    for run in data.runs:
        rc = data.run_ids.code(run.run_id)
        for r, rk in sorted(run.ranks.items(), key=lambda x: label_key(x[0])):
            code = data.label_code(r) if r in data.labels else -1
            f = facts.get((rc, code), RowFacts())
            out += [f"run {run.run_id} rank {r} {p}" for p in rows_problems(rk.manifest, f)]
            read = int(((c["run"] == rc) & (c["rank"] == code)).sum())
            if rk.rows_written and read < rk.rows_written:
                out.append(f"run {run.run_id} rank {r}: read {fmt_int(read)} of {fmt_int(rk.rows_written)} rows the "
                           "manifest says were written")
    return out


def _served_folder(data: TraceData) -> str | None:
    """The checkpoint folder every rank's server loaded at start (manifests' checkpoint_path), or None."""
    paths = {rk.manifest.get("checkpoint_path") for run in data.runs for rk in run.ranks.values()}
    return paths.pop() if len(paths) == 1 and None not in paths else None


def _judge(data: TraceData, paths: Sequence[str], index: str | None, checkpoint: str | None,
           max_rows: int, served: str | None = None) -> Report:
    """The report of these rows against one reference (served: the folder the server loaded)."""
    index_path, trace_layout = choose_index(data, index, checkpoint)
    idx = read_expected(index_path, data.tensors, data.dtypes, models=data.models)
    check_index_fits(data, idx, checkpoint=None if index else checkpoint)
    notes = []
    try:
        trace_layout = check_index_layout(data, idx, trace_layout)
    except IndexLayoutMismatch as err:
        index_path, idx, trace_layout, note = matching_index(data, index_path, idx, err)
        notes.append(note)
    analysis = Analysis(data, idx, index_path)
    # a divergence against a stale index, or one of another folder, is the reference's, never the server's
    check_fresh(analysis, checkpoint, served)
    report = build_report(analysis, list(paths), max_rows=max_rows)
    report.doc["inputs"]["layout"] = idx.layout.to_json()
    report.doc["warnings"] = notes + list(report.doc.get("warnings") or []) + trace_layout.warnings
    return report
