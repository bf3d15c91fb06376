"""``moetrace diff RUN_A RUN_B``: the same (step, layer, rank, source, expert, tensor) in two runs.

Without an index the comparison is by fingerprint (same / changed / only in one
run). With ``--index`` or ``--checkpoint`` each side also gets its verdict, and
changes are grouped as transitions, e.g. "rank 1, w2_weight_scale_inv: 253
entries E+2 → match".
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from moetrace.analysis.coverage import Analysis
from moetrace.analysis.expected import read_expected
from moetrace.analysis.index_choice import (
    IndexLayoutMismatch,
    check_index_fits,
    check_index_layout,
    choose_index,
    matching_index,
)
from moetrace.analysis.sentences import fmt_int, layer_text
from moetrace.analysis.trace import TraceData, pair_to_hex, read_trace
from moetrace.analysis.verdicts import MATCH, OUT_OF_SCOPE, STALE, VERDICTS, WRONG_RANK
from moetrace.errors import MoetraceError
from moetrace.schema import DIFF_SCHEMA, DIFF_SCHEMA_VERSION, SOURCES

# One physical copy of one expert's tensor in one pass, on one process (by rank label:
# the codes of two traces differ).
KEY = ["step", "model", "layer", "rank", "source", "expert", "copy", "tensor"]


def _frame(data: TraceData, tensor_names: list[str], a: Analysis | None) -> pd.DataFrame:
    c = data.cols
    for n in data.tensors.names:
        if n not in tensor_names:
            tensor_names.append(n)
    remap = np.array([tensor_names.index(n) for n in data.tensors.names] or [0], np.int64)
    df = pd.DataFrame({
        "step": c["step"], "model": np.array(data.models.names, dtype=object)[c["model"]] if data.n else [],
        "layer": c["layer"], "rank": np.array(data.labels, dtype=object)[c["rank"]] if data.n else [],
        "source": c["source"], "expert": c["expert"], "copy": c["copy"],
        "tensor": remap[c["tensor"]] if data.n else np.zeros(0, np.int64),
        "transport_position": c["transport_position"], "copy_position": c["copy_position"], "hi": c["hi"],
        "lo": c["lo"],
    })
    if a is not None:
        df["verdict"] = a.verdicts.verdict
        df["k"] = a.verdicts.k
        f = np.maximum(a.verdicts.found, 0)
        df["found_rank"] = np.where(a.verdicts.found >= 0, a.idx.rank[f], -1)
        df = df[df["verdict"] != OUT_OF_SCOPE]
    return df.drop_duplicates(KEY, keep="first")


def _parallel(data: TraceData) -> set[str]:
    return {f"TP{r.tp_size} EP{r.ep_size} PP{r.pp_size}" + (f" moe_tp {r.moe_tp_size}" if r.moe_tp_size else "")
            for r in data.runs}


def check_same_layout(da: TraceData, db: TraceData) -> None:
    """Entries are matched by rank: two runs compare only when every rank holds the same
    shard in both (the same TP/EP/PP sizes), else every entry would read as changed."""
    a, b = _parallel(da), _parallel(db)
    if a != b:
        raise MoetraceError(f"run A is {', '.join(sorted(a))} but run B is {', '.join(sorted(b))}: their ranks hold "
                            "different shards, so their entries cannot be compared; diff runs of one layout "
                            "(analyze each against its own index instead)")


def _label(v: int, k: int, fr: int) -> str:
    if v == STALE:
        return f"E{k:+d}"
    if v == WRONG_RANK:
        return f"rank {fr}'s shard"
    return VERDICTS[v]


def diff(run_a: Sequence[str] | str, run_b: Sequence[str] | str, index: str | None = None,
         checkpoint: str | None = None, max_rows: int = 200) -> dict:
    pa_ = [run_a] if isinstance(run_a, str) else list(run_a)
    pb_ = [run_b] if isinstance(run_b, str) else list(run_b)
    da, db = read_trace(pa_), read_trace(pb_)
    for d, p in ((da, pa_), (db, pb_)):
        if d.n == 0:
            raise MoetraceError(f"trace {', '.join(p)} holds no rows: nothing to compare")
    check_same_layout(da, db)
    aa = ab = None
    index_path = None
    if index or checkpoint:
        index_path, trace_layout = choose_index(da, index, checkpoint)
        for d in (da, db):
            idx = read_expected(index_path, d.tensors, d.dtypes, models=d.models)
            check_index_fits(d, idx)
            try:
                check_index_layout(d, idx, trace_layout if d is da else None)
            except IndexLayoutMismatch as err:  # the matching index of the checkpoint it records, as analyze does
                index_path, idx, trace_layout, _ = matching_index(d, index_path, idx, err)
            an = Analysis(d, idx, index_path)
            if d is da:
                aa = an
            else:
                ab = an
    names: list[str] = list(da.tensors.names)
    fa, fb = _frame(da, names, aa), _frame(db, names, ab)
    m = fa.merge(fb, on=KEY, how="outer", suffixes=("_a", "_b"), indicator=True)
    both = m["_merge"] == "both"
    same = both & (m["hi_a"] == m["hi_b"]) & (m["lo_a"] == m["lo_b"])
    changed = m[both & ~same].copy()
    only_a = int((m["_merge"] == "left_only").sum())
    only_b = int((m["_merge"] == "right_only").sum())
    with_verdicts = aa is not None
    groups = _change_groups(changed, names, with_verdicts)
    rows = _changed_rows(changed, names, with_verdicts, max_rows)
    first = rows[0] if rows else None
    n_both = int(both.sum())
    sentence = f"{fmt_int(len(changed))} of {fmt_int(n_both)} entries present in both runs differ"
    if only_a or only_b:
        sentence += f"; {fmt_int(only_a)} only in A, {fmt_int(only_b)} only in B"
    doc = {
        "schema": DIFF_SCHEMA, "version": DIFF_SCHEMA_VERSION,
        "a": {"trace": pa_, "runs": [r.run_id for r in da.runs]},
        "b": {"trace": pb_, "runs": [r.run_id for r in db.runs]},
        "index": index_path,
        "totals": {"both": n_both, "same": int(same.sum()), "changed": int(len(changed)), "only_a": only_a,
                   "only_b": only_b, "sentence": sentence},
        "first_change": first,
        "changes": groups,
        "changed_rows": rows,
        "changed_rows_truncated": max(0, len(changed) - max_rows),
    }
    if with_verdicts:
        for side, an in (("a", aa), ("b", ab)):
            vv = an.verdicts.verdict[an.verdicts.verdict != OUT_OF_SCOPE]
            counts = np.bincount(vv.astype(np.int64), minlength=len(VERDICTS))
            doc[side]["by_verdict"] = {VERDICTS[i]: int(n) for i, n in enumerate(counts) if n}
            doc[side]["match"] = int((vv == MATCH).sum())
            doc[side]["rows"] = int(len(vv))
    return doc


def _change_groups(changed: pd.DataFrame, names: list[str], with_verdicts: bool) -> list[dict]:
    """Changed entries grouped: by verdict transition (with an index) or by rank, layer, tensor."""
    groups = []
    if len(changed):
        if with_verdicts:
            for col in ("verdict", "k", "found_rank"):
                for s in ("_a", "_b"):
                    changed[col + s] = changed[col + s].astype(np.int64)
            gcols = ["rank", "tensor", "verdict_a", "k_a", "found_rank_a", "verdict_b", "k_b", "found_rank_b"]
        else:
            gcols = ["rank", "layer", "tensor"]
        g = changed.groupby(gcols, sort=True).agg(count=("step", "size"), steps=("step", "nunique"),
                                                   layers=("layer", "nunique")).reset_index()
        g = g.sort_values("count", ascending=False, kind="stable")
        for r in g.itertuples(index=False):
            doc = {"rank": r.rank, "tensor": names[int(r.tensor)], "count": int(r.count), "steps": int(r.steps)}
            if with_verdicts:
                fr = _label(int(r.verdict_a), int(r.k_a), int(r.found_rank_a))
                to = _label(int(r.verdict_b), int(r.k_b), int(r.found_rank_b))
                doc.update({"from": fr, "to": to, "layers": int(r.layers)})
                doc["sentence"] = f"rank {doc['rank']}, {doc['tensor']}: {fmt_int(r.count)} entries {fr} → {to}"
            else:
                doc["layer"] = int(r.layer)
                doc["sentence"] = (f"rank {doc['rank']}, layer {doc['layer']}, {doc['tensor']}: "
                                   f"{fmt_int(r.count)} entries changed digest")
            groups.append(doc)
    return groups


def _changed_rows(changed: pd.DataFrame, names: list[str], with_verdicts: bool, max_rows: int) -> list[dict]:
    """The first `max_rows` changed entries, in first-divergence order."""
    rows = []
    if len(changed):
        changed = changed.sort_values(["step", "layer", "source", "transport_position_a", "copy_position_a", "rank"])
        for r in changed.head(max_rows).itertuples(index=False):
            doc = {"step": int(r.step), "model": r.model, "layer": int(r.layer), "rank": r.rank,
                   "source": SOURCES[int(r.source)],
                   "expert": int(r.expert), "tensor": names[int(r.tensor)], "digest_a": pair_to_hex(r.hi_a, r.lo_a),
                   "digest_b": pair_to_hex(r.hi_b, r.lo_b)}
            if with_verdicts:
                doc["a"] = _label(int(r.verdict_a), int(r.k_a), int(r.found_rank_a))
                doc["b"] = _label(int(r.verdict_b), int(r.k_b), int(r.found_rank_b))
                what = f"{doc['a']} in A, {doc['b']} in B"
            else:
                what = "digest differs"
            doc["sentence"] = (f"step {doc['step']}, {layer_text(r.model, doc['layer'])}, rank {doc['rank']}, "
                               f"expert {doc['expert']}: "
                               f"{doc['tensor']} {what}")
            rows.append(doc)
    return rows


def diff_text(doc: dict, max_lines: int = 20) -> str:
    out = [f"moetrace diff: A = {', '.join(doc['a']['trace'])}  B = {', '.join(doc['b']['trace'])}"]
    for side in ("a", "b"):
        if "match" in doc[side]:
            out.append(f"  {side.upper()}: {fmt_int(doc[side]['match'])}/{fmt_int(doc[side]['rows'])} match")
    out.append(doc["totals"]["sentence"])
    if doc["first_change"]:
        out.append(f"first change: {doc['first_change']['sentence']}")
    if doc["changes"]:
        out.append("changes:")
        out += ["  " + g["sentence"] for g in doc["changes"][:max_lines]]
        if len(doc["changes"]) > max_lines:
            out.append(f"  … and {len(doc['changes']) - max_lines} more (see --json)")
    return "\n".join(out)
