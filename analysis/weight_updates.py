"""A run whose server updated its weights: the rows after each update are compared with
the checkpoint that update loaded, never with the reference of the checkpoint before it.

Each rank's manifest lists the server's weight updates (``weight_updates``: the entry
point, whether it succeeded, the model path and checkpoint it loaded, the latest step of
each model captured before it). The rows of a rank split into segments: before its first
update, between its first and second, and so on. Segment 0 is judged against the
reference given (--index / --checkpoint); segment k against the index of the checkpoint
update k loaded, built from its model path through the index cache, as --checkpoint
builds one. A segment whose checkpoint moetrace cannot know (a failed update, an update
from tensors or IPC, a model path not readable here) is unverified (exit 2, named).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from moetrace.analysis.trace import TraceData
from moetrace.errors import ExitCode


@dataclass
class Segment:
    """The rows after the k-th weight update (k >= 1) of every rank."""

    k: int
    mask: np.ndarray  # rows of this segment
    entry: str
    model_path: str | None
    checkpoint_id: str | None
    unverifiable: str | None  # why its rows cannot be compared with any index, or None
    steps: dict  # rank label -> the latest step of the target model before the update

    def sentence(self) -> str:
        where = ", ".join(f"rank {r} after step {s}" for r, s in sorted(self.steps.items()))
        what = f"{self.entry}({self.model_path})" if self.model_path else self.entry
        return f"weights updated ({what}; {where})"


def _updates(manifest: dict) -> list[dict]:
    return [u for u in manifest.get("weight_updates") or [] if isinstance(u, dict)]


def split(data: TraceData) -> tuple[np.ndarray, list[Segment], list[str]]:
    """(segment of each row: 0 before any update, k after the k-th; the later segments;
    problems: ranks that disagree on the updates they saw)."""
    c = data.cols
    seg = np.zeros(data.n, dtype=np.int16)
    per_rank: dict[str, list[dict]] = {}
    for run in data.runs:
        for label, rk in run.ranks.items():
            ups = _updates(rk.manifest)
            if ups:
                per_rank[label] = ups
    if not per_rank:
        return seg, [], []
    problems = []
    counts = {label: len(ups) for label, ups in per_rank.items()}
    all_ranks = {label for run in data.runs for label in run.ranks}
    if len(set(counts.values())) > 1 or set(per_rank) != all_ranks:
        problems.append("the ranks recorded different weight updates (" + ", ".join(
            f"rank {r}: {counts.get(r, 0)}" for r in sorted(all_ranks)) + "): the rows after them cannot be matched "
            "to a checkpoint")
    names = list(data.models.names)
    for label, ups in per_rank.items():
        rows = c["rank"] == data.label_code(label) if label in data.labels else np.zeros(data.n, dtype=bool)
        for u in ups:
            after = u.get("after_step") or {}
            later = np.zeros(data.n, dtype=bool)
            for code, model in enumerate(names):
                in_model = rows & (c["model"] == code)
                step = after.get(model)
                later |= in_model if step is None else in_model & (c["step"] > int(step))  # None: no step before it
            seg[later] += 1
    segments = []
    n = max(counts.values())
    for k in range(1, n + 1):
        first = next(ups[k - 1] for ups in per_rank.values() if len(ups) >= k)
        why = None
        if not first.get("ok"):
            why = f"the update {first.get('entry')} failed"
        elif not first.get("model_path"):
            why = f"{first.get('entry')} loaded weights from no checkpoint folder (tensors, IPC or a peer)"
        elif not first.get("checkpoint_id"):
            why = f"the server could not read {first['model_path']} as a checkpoint"
        paths = {ups[k - 1].get("model_path") for ups in per_rank.values() if len(ups) >= k}
        if why is None and len(paths) > 1:
            why = f"the ranks loaded different folders ({', '.join(sorted(str(p) for p in paths))})"
        steps = {label: (ups[k - 1].get("after_step") or {}).get("target") for label, ups in per_rank.items()
                 if len(ups) >= k}
        segments.append(Segment(k, seg == k, str(first.get("entry")), first.get("model_path"),
                                first.get("checkpoint_id"), why, steps))
    return seg, segments, problems


def subset(data: TraceData, mask: np.ndarray, checkpoint_id: str | None = None) -> TraceData:
    """The rows of `mask`; with checkpoint_id, the runs say that checkpoint was loaded."""
    runs = data.runs if checkpoint_id is None else [replace(r, checkpoint_id=checkpoint_id) for r in data.runs]
    return replace(data, cols={k: v[mask] for k, v in data.cols.items()}, runs=runs, partial=True)


def combine(first, later: list[tuple[Segment, object | None]], problems: list[str]):
    """One report: segment 0's, with each later segment's rows, verdicts and problems added.
    later: (segment, its Report, or None when unverifiable)."""
    doc = first.doc
    t = doc["totals"]
    entries = []
    code = first.exit_code
    for seg, rep in later:
        entry = {"k": seg.k, "entry": seg.entry, "model_path": seg.model_path, "checkpoint_id": seg.checkpoint_id,
                 "after_step": seg.steps, "rows": int(seg.mask.sum()), "sentence": seg.sentence()}
        if rep is None:
            entry.update(status="unverified", why=seg.unverifiable)
            doc["incomplete"].append(f"{seg.sentence()}: its {int(seg.mask.sum()):,} rows are unverified: "
                                     f"{seg.unverifiable}")
            code = max(code, ExitCode.INCOMPLETE) if code != ExitCode.DIVERGENT else code
            entries.append(entry)
            continue
        d = rep.doc
        entry.update(status=d["status"], index=d["inputs"]["index"], totals=d["totals"]["sentence"])
        entries.append(entry)
        for key in ("tensors", "match", "divergent", "missing", "rows_read", "rows_in_scope", "rows_out_of_scope",
                    "guard_verified", "loads", "steps"):
            t[key] = t.get(key, 0) + d["totals"].get(key, 0)
        for name, n in d["totals"]["by_verdict"].items():
            t["by_verdict"][name] = t["by_verdict"].get(name, 0) + n
        t["ranks"] = sorted(set(t["ranks"]) | set(d["totals"]["ranks"]))
        for key in ("incomplete", "warnings", "summaries", "loads", "missing_loads", "divergent_rows"):
            doc[key] = list(doc.get(key) or []) + list(d.get(key) or [])
        if not doc.get("first_divergence") and d.get("first_divergence"):
            doc["first_divergence"] = d["first_divergence"]
        doc["divergent_rows_truncated"] = doc.get("divergent_rows_truncated", 0) + d.get("divergent_rows_truncated", 0)
        code = _worse(code, rep.exit_code)
    doc["incomplete"] = list(dict.fromkeys(list(doc["incomplete"]) + problems))  # each rank's problems once
    if problems and code == ExitCode.PASS:
        code = ExitCode.INCOMPLETE
    from moetrace.analysis.report import totals_sentence

    t["sentence"] = totals_sentence(t)
    doc["weight_updates"] = entries
    doc["warnings"] = [f"{e['sentence']}: its {e['rows']:,} rows compared with "
                       f"{e.get('index') or 'no index'} ({e['status']})" for e in entries] + list(doc["warnings"])
    doc["status"] = {ExitCode.DIVERGENT: "divergent", ExitCode.INCOMPLETE: "incomplete"}.get(code, "match")
    doc["audit_exit_code"] = int(code)
    first.exit_code = code
    return first


def _worse(a: ExitCode, b: ExitCode) -> ExitCode:
    """A divergence wins over incomplete, which wins over a pass."""
    rank = {ExitCode.DIVERGENT: 2, ExitCode.INCOMPLETE: 1, ExitCode.PASS: 0}
    return a if rank.get(a, 0) >= rank.get(b, 0) else b
