"""`moetrace conform`: run the installed fork's own staging code and audit what
each rank ends up holding.

synthetic checkpoint -> index -> TP rank processes (gloo) running sglang-kt's
``SharedFullContext.load`` under the simulated CUDA runtime (rank 0's writer:
kt-kernel's when it runs here), moetrace's KT capture on ``load`` -> analysis.
Exit 1: a rank holds wrong bytes (first divergence named); 0: every rank holds
its shard, full coverage; 2: it could not run (no fork, a class conform cannot
drive, a format whose layout moetrace cannot reproduce, a stalled schedule), said
by name. Every result carries its provenance (the file and class that ran, their
sha256, whether the file is the released one, the --patch-fence diff), and
--json-out is written for every exit code. docs/conform.md. The cases are planned in
jobs.conform_plan and run in rank processes by jobs.conform_ranks; this module judges
them and words the result.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from moetrace import outputs
from moetrace.errors import ExitCode, MoetraceError
from moetrace.jobs.conform_plan import Case, Plan, check_case, plan_case
from moetrace.jobs.conform_ranks import group_of, run_group, work_folder

# --json-out replaces only a conform document (one case's or the releases table's)
CONFORM_JSON = outputs.json_document("a moetrace conform result",
                                     lambda doc: str(doc.get("schema", "")).startswith("moetrace.conform"))


@dataclass
class ConformResult:
    case: Case
    tp: int
    fork: dict  # path, version, how it was found
    exit_code: ExitCode  # PASS: every rank holds its shard, full coverage; DIVERGENT; INCOMPLETE: could not tell
    status: str  # the analysis status: "match" | "divergent" | "incomplete"
    run_id: str
    writer: str  # what wrote rank 0's host slots, in words
    writer_kind: str  # "kt-kernel" | "moetrace"
    patched: list[str]  # methods --patch-fence rewrote
    held: dict[int, dict[str, list]]  # rank -> tensor -> per expert: whose bytes it holds (None: unknown)
    first_divergence: list[str]
    totals: str
    seconds: dict = field(default_factory=dict)
    report: object = None  # analysis.Report
    guard: dict = field(default_factory=dict)  # rank -> the in-server guard's record (manifest "guard")
    error: str = ""  # exit 2: why it could not run
    patch: dict = field(default_factory=dict)  # --patch-fence: {"methods", "diff"}
    method: str = ""  # the fork's staging method for the format
    marlin: dict | None = None  # int4: what ran after staging, what the bytes judged are (conform.marlin)


def experts_held(report, fmt: str, tp: int, experts: int) -> dict[int, dict[str, list]]:
    """Per rank and tensor, whose bytes each expert holds, from the analysis' rows."""
    from moetrace.schema import COPY_ORDERS

    held = {r: {t: list(range(experts)) for t in COPY_ORDERS[fmt]} for r in range(tp)}
    for row in report.doc["divergent_rows"]:
        found = row.get("found")
        held[row["tp_rank"]][row["tensor"]][row["expert"]] = found["expert"] if found else None
    return held


def _refused(plan: Plan, tp: int, error: str) -> ConformResult:
    return ConformResult(plan.case, tp, plan.fork, ExitCode.INCOMPLETE, plan.status, "", "", "", [], {}, [], "",
                         error=error, patch=plan.patch, method=plan.method)


def run_conform(cases: Sequence[Case], tp: int = 2, workdir: str | None = None,
                timeout_s: float = 120.0, guard: str | None = "all") -> list[ConformResult]:
    """Run every case that can run, in one set of TP rank processes per group (group_of;
    the forks of a group share one kt-kernel, the first case's); a case that cannot is
    a result with exit 2 and the reason. ``guard``: the in-server guard's rows ("all":
    the whole trace, "mismatch": production's) or None (capture only)."""
    from moetrace.analysis import analyze
    from moetrace.tracer.manifest import read_manifests

    for c in cases:
        check_case(c, tp)
    t0 = time.perf_counter()
    plans = [plan_case(c, tp) for c in cases]
    out: dict[int, ConformResult] = {i: _refused(p, tp, p.error) for i, p in enumerate(plans) if p.error}
    groups: dict[str, list[Plan]] = {}
    for p in plans:
        if not p.error:
            groups.setdefault(group_of(p), []).append(p)
    if not groups:
        return [out[i] for i in range(len(plans))]
    wd, temporary = work_folder(workdir)
    try:
        prep = round(time.perf_counter() - t0, 2)
        for runnable in groups.values():
            results, prepared, err, spent = run_group(runnable, tp, wd, temporary, guard, timeout_s)
            for i, (p, index, run_id) in enumerate(prepared):
                at = plans.index(p)
                if err:
                    out[at] = _refused(p, tp, err[1])
                    out[at].status = "error"
                    continue
                c, facts = p.case, results[0]["cases"][i]
                report = analyze([str(wd / "traces" / run_id)], index=str(index), max_rows=1 << 20)
                doc = report.doc
                seconds = {"prepare": prep, "ranks": round(spent, 2), "rank0": facts["seconds"]}
                out[at] = ConformResult(
                    c, tp, p.fork, report.exit_code, doc["status"], run_id, facts["writer"], facts["writer_kind"],
                    facts["patched"], experts_held(report, c.fmt, tp, c.experts),
                    [f["sentence"] for f in doc["first_divergence"]], doc["totals"]["sentence"], seconds, report,
                    {r: m.get("guard") for r, m in read_manifests(str(wd / "traces"), run_id).items()},
                    patch=p.patch, method=p.method, marlin=facts.get("marlin"))
        return [out[i] for i in range(len(plans))]
    finally:
        if temporary:
            shutil.rmtree(wd, ignore_errors=True)


def e_plus_k(doc: dict) -> list[int]:
    """The distinct k of the wrong experts' bytes (a row holding expert e+k), from the analysis."""
    rows = (doc.get("analysis") or {}).get("divergent_rows") or []
    return sorted({r["k"] for r in rows if r.get("k") is not None})


def result_doc(res: ConformResult) -> dict:
    """The --json-out document (docs/conform.md), for every exit code; also what the
    terminal lines are made of."""
    from moetrace import __version__
    from moetrace.schema import CONFORM_SCHEMA, CONFORM_SCHEMA_VERSION

    doc = {"schema": CONFORM_SCHEMA, "version": CONFORM_SCHEMA_VERSION, "moetrace_version": __version__,
           "fork": res.fork, "case": {**asdict(res.case), "tp": res.tp}, "method": res.method, "run_id": res.run_id,
           "exit_code": int(res.exit_code), "status": res.status, "error": res.error or None, "writer": res.writer,
           "writer_kind": res.writer_kind, "patched": res.patched, "patch": res.patch or None,
           "held": {str(r): h for r, h in res.held.items()}, "first_divergence": res.first_divergence,
           "totals": res.totals, "seconds": res.seconds, "guard": {str(r): g for r, g in res.guard.items()},
           "marlin": res.marlin,
           "analysis": res.report.doc if res.report is not None else None}
    doc["e_plus_k"] = e_plus_k(doc)
    return doc


def fork_line(doc: dict) -> str:
    f, c = doc["fork"], doc["case"]
    if not f.get("found"):
        return f"fork: {f.get('path') or 'sglang-kt'} (not found)"
    fence = (f"seed PR fence patched into {', '.join(doc['patch']['methods'])} (diff in --json-out)"
             if doc.get("patch") else "--patch-fence not applied" if c["patch_fence"] else "as installed")
    same = {True: "the released file", False: "NOT the released file", None: "no release RECORD to compare"}
    return (f"fork: sglang-kt {f['version']} ({f['path']}, sha256 {f['file_sha256'][:12]}, "
            f"{same[f.get('released')]}), SharedFullContext {fence} (class sha256 {f['class_sha256'][:12]})")


def result_lines(doc: dict) -> list[str]:
    c = doc["case"]
    lines = [fork_line(doc)]
    if doc["error"]:
        return lines + [f"run: {c['fmt']}, TP{c['tp']}, {c['experts']} experts: could not run"]
    lines.append(f"run: {c['fmt']} ({doc['method']}), TP{c['tp']}, {c['experts']} experts, schedule {c['schedule']}; "
                 f"rank 0's writer: {doc['writer']}")
    if doc.get("marlin"):
        m = doc["marlin"]
        lines.append(f"judged: {m['judged']} (gptq_marlin_repack: a recorded identity, {m['repack']['calls']} calls "
                     f"on rank 0; marlin_permute_scales: {m['permute']['from']}, {m['permute']['path']})")
    if c["schedule"] == "none":
        lines.append("note: no injected delay: a match proves nothing (the race depends on timing), "
                     "a divergence is real")
    lines += [f"first divergence: {s}" for s in doc["first_divergence"]]
    if doc.get("guard"):
        from moetrace.analysis.sentences import guard_sentence

        lines.append(f"in-server guard: {guard_sentence(doc['guard'])}")
    for r, tensors in doc["held"].items():
        groups: dict[tuple, list[str]] = {}
        for t, got in tensors.items():
            groups.setdefault(tuple(got), []).append(t)
        for got, names in groups.items():
            if list(got) != list(range(c["experts"])):
                shown = ", ".join("?" if e is None else str(e) for e in got)
                lines.append(f"  rank {r} {'/'.join(names)}: experts 0..{c['experts'] - 1} hold [{shown}]")
    code = ExitCode(doc["exit_code"])
    word = code.label + (": every rank holds its shard, full coverage" if code == ExitCode.PASS else "")
    lines.append(f"{word}: {doc['totals']}")  # the verdict, last
    return lines


def write_doc(json_out: str | None, doc: dict, exit_code: int, echo: Callable[[str], None]) -> int:
    """Write --json-out whole or not at all; a report that cannot be written turns a pass
    into 3 and leaves another exit code as it was (the line says why)."""
    if not json_out:
        return exit_code
    try:
        outputs.write_local_text(json_out, "--json-out", json.dumps(doc, indent=1) + "\n", ours=CONFORM_JSON,
                                 make_parents=True)
    except MoetraceError as err:
        echo(f"moetrace: error: {err}")
        return ExitCode.REPORT_UNWRITTEN if exit_code == ExitCode.PASS else exit_code
    return exit_code


def conform_main(case: Case, tp: int, workdir: str | None, json_out: str | None,
                 echo: Callable[[str], None] = print) -> int:
    """The command's body: check --json-out, run, print, write --json-out (for every
    exit code), return the exit code; exit 2 ends with the one-line error."""
    if json_out:
        outputs.probe_output(json_out, "--json-out", CONFORM_JSON)
    (res,) = run_conform([case], tp=tp, workdir=workdir)
    doc = result_doc(res)
    code = write_doc(json_out, doc, res.exit_code, echo)
    if res.error:
        raise MoetraceError(res.error)
    for line in result_lines(doc):
        echo(line)
    return code
