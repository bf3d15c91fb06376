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
--json-out is written for every exit code. docs/conform.md.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from moetrace.errors import ExitCode, MoetraceError

FORMATS = ("fp8_block", "fp8_channel", "bf16", "int4", "mxfp4", "mxfp8")  # what the fork's load stages
# Layouts moetrace's expected side cannot reproduce for a staged format: (what, why).
UNJUDGED = {
    "int4": ("Marlin-repacked INT4 weights", "_prepare_weight_int4 repacks every staged expert for the Marlin "
             "kernel on the GPU, and checkpoints/ writes no INT4 checkpoint"),
    "mxfp4": ("MXFP4 nibble-packed weights with UE8M0 scales", "re-swizzled for triton_kernels after staging; "
              "checkpoints/ writes no MXFP4 checkpoint"),
    "mxfp8": ("MXFP8 UE8M0 scales", "converted to block FP8 by a Triton kernel after staging; checkpoints/ writes "
              "no MXFP8 checkpoint"),
}
SCHEDULES = ("slow-peer", "none")
WRITERS = ("kt-kernel", "moetrace")
HIDDEN, BLOCK = 256, 128  # per rank I_tp = one 128 block
WORKDIR_MARK = ".moetrace-conform"
ERROR_KINDS = {"layout": "unsupported fork layout", "refused": "refused", "timeout": "the schedule stalled",
               "crash": "the fork's code failed", "peer": "a rank lost its peer", "writer": "rank 0's writer failed"}


@dataclass(frozen=True)
class Case:
    """One load of one layer: what the user picks on the command line."""

    fmt: str = "fp8_block"
    schedule: str = "slow-peer"
    patch_fence: bool = False
    writer: str = "kt-kernel"
    experts: int = 8
    fork_path: str | None = None  # None: the installed sglang-kt

    @property
    def name(self) -> str:
        return f"{self.fmt}-{self.schedule}-{'patched' if self.patch_fence else 'shipped'}-{self.writer}"


@dataclass
class Plan:
    """A case checked against its fork before any process starts."""

    case: Case
    fork: dict  # provenance (fork_provenance)
    error: str = ""  # why it cannot run (exit 2), "" when it can
    status: str = "refused"  # "absent" when the release's load has no path for the format
    src: object = None  # ForkSource
    method: str = ""  # the staging method load dispatches the format to
    patch: dict = field(default_factory=dict)  # --patch-fence: {"methods", "diff"}


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


def check_case(case: Case, tp: int) -> None:
    checks = [(case.fmt in FORMATS, f"--format must be one of {', '.join(FORMATS)}, got {case.fmt!r}"),
              (case.schedule in SCHEDULES, f"--schedule must be one of {', '.join(SCHEDULES)}, got {case.schedule!r}"),
              (case.writer in WRITERS, f"--writer must be one of {', '.join(WRITERS)}, got {case.writer!r}"),
              (3 <= case.experts <= 256, f"--experts must be in [3, 256] (a host slot is reused from the "
                                         f"third expert on), got {case.experts}"),
              (2 <= tp <= 8, f"--tp must be in [2, 8] (the race needs a peer rank), got {tp}")]
    for ok, msg in checks:
        if not ok:
            raise MoetraceError(msg)


def _workdir(path: str | None) -> tuple[Path, bool]:
    """(folder, whether it is ours to delete). A given folder must be new, empty, or
    one conform made before (its checkpoints and indexes are reused)."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="moetrace-conform-")), True
    p = Path(path)
    if p.exists() and (not p.is_dir() or (any(p.iterdir()) and not (p / WORKDIR_MARK).exists())):
        raise MoetraceError(f"--workdir {p}: exists and is neither empty nor a previous conform --workdir")
    p.mkdir(parents=True, exist_ok=True)
    (p / WORKDIR_MARK).write_text("moetrace conform work folder: checkpoints, indexes, traces, rank logs\n")
    return p, False


def _prepare(wd: Path, fmt: str, experts: int, tp: int) -> tuple[Path, Path, str]:
    """A one-layer synthetic Qwen3.5 checkpoint (every element a known function of
    where it sits) and its TP index; reused when the work folder has them."""
    from moetrace.checkpoints.index import write_index
    from moetrace.checkpoints.index_build import build_index
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint

    inter = BLOCK * tp
    ck = wd / f"checkpoint-{fmt}-e{experts}-i{inter}"
    if not (ck / "config.json").exists():
        shutil.rmtree(ck, ignore_errors=True)
        write_synthetic_checkpoint(ck, family="qwen3_5_moe", fmt=fmt, num_layers=1, num_experts=experts,
                                   hidden=HIDDEN, intermediate=inter, scale_dtype="bfloat16", num_files=1)
    index = wd / f"index-{fmt}-e{experts}-i{inter}-tp{tp}.parquet"
    if not index.exists():
        write_index(build_index(ck, tp), index)
    return ck, index, open_checkpoint(ck).identity


def _dead(rank: int, code: int | None, results: Path) -> dict:
    """A rank that exited without its result file: a signal in rank 0 while kt-kernel's
    writer ran (results/rank0.phase) is the writer's fault, named with the ISA it needs."""
    from moetrace.conform.rank import signal_words

    if code is not None and code < 0:
        path = results / "rank0.phase"
        phase = json.loads(path.read_text()) if rank == 0 and path.exists() else {}
        kind, words = signal_words(code, phase.get("what", ""))
        return {"rank": rank, "error": words, "error_kind": kind, "cases": [], "signal": -code,
                "fmt": phase.get("fmt") if phase.get("what") else None}
    return {"rank": rank, "error": f"rank {rank} exited with code {code} and wrote no result", "error_kind": "crash",
            "cases": []}


def _spawn(job) -> list[dict]:
    """Start the ranks, wait for their result files; stop the others once one failed,
    and every one on the way out (Ctrl-C included)."""
    from moetrace.conform.rank import rank_main

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, job), name=f"conform-rank{r}") for r in range(job.tp)]
    limit = job.timeout_s * (2 + len(job.cases))
    results: dict[int, dict] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + limit
        while len(results) < job.tp and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                path = Path(job.results) / f"rank{r}.json"
                if r not in results and path.exists():
                    results[r] = json.loads(path.read_text())
                elif r not in results and not p.is_alive():
                    results[r] = _dead(r, p.exitcode, Path(job.results))
            if any(v.get("error") for v in results.values()):
                time.sleep(1.0)  # let the peers notice and report, then stop them
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=2)
                if p.is_alive():
                    p.kill()
                    p.join()
    for r in range(job.tp):
        path = Path(job.results) / f"rank{r}.json"
        if r not in results:
            results[r] = json.loads(path.read_text()) if path.exists() else {
                "rank": r, "error": f"rank {r} did not finish within {limit:.0f} s", "error_kind": "timeout",
                "cases": []}
    return [results[r] for r in range(job.tp)]


def _rank_error(results: list[dict], logs: Path, keep: bool) -> tuple[str, str] | None:
    """(kind, one line) of the root cause, a rank's own error rather than a peer that saw
    the connection drop; None when every rank finished."""
    bad = [r for r in results if r.get("error")]
    if not bad:
        return None
    first = next((r for r in bad if r.get("error_kind") != "peer"), bad[0])
    where = f" (rank logs: {logs})" if keep else " (rerun with --workdir to keep the rank logs)"
    kind = first.get("error_kind")
    return kind, (f"conform could not run ({ERROR_KINDS.get(kind, 'failed')}): rank {first['rank']}: "
                  f"{first['error']}{where}")


def _held(report, fmt: str, tp: int, experts: int) -> dict[int, dict[str, list]]:
    """Per rank and tensor, whose bytes each expert holds, from the analysis' rows."""
    from moetrace.schema import COPY_ORDERS

    held = {r: {t: list(range(experts)) for t in COPY_ORDERS[fmt]} for r in range(tp)}
    for row in report.doc["divergent_rows"]:
        found = row.get("found")
        held[row["tp_rank"]][row["tensor"]][row["expert"]] = found["expert"] if found else None
    return held


def fork_provenance(src, parsed, kt: tuple[str | None, str | None]) -> dict:
    """What ran: the distribution, the file and class with their sha256, whether the file
    is the one the release shipped (its RECORD), and the kt-kernel beside it."""
    from moetrace.conform.source import released_sha256

    released = released_sha256(src.path)
    return {"distribution": "sglang-kt", "version": src.version, "path": str(src.path), "found": src.origin,
            "file_sha256": parsed.file_sha256, "class_sha256": parsed.class_sha256,
            "released_sha256": released, "released": None if released is None else released == parsed.file_sha256,
            "kt_kernel": kt[1], "kt_kernel_path": kt[0]}


def _who(fork: dict) -> str:
    return f"sglang-kt {fork.get('version', '?')}"


def _unjudged(case: Case, method: str, who: str) -> str:
    what, why = UNJUDGED[case.fmt]
    return (f"--format {case.fmt}: {who}'s load stages it with {method}; moetrace's expected side cannot reproduce "
            f"{what} ({why}), so conform refuses it")


def plan_case(case: Case, tp: int) -> Plan:
    """Everything that can be told before a process starts: the fork, its provenance,
    what its class needs (conform.requirements), the format's method, the fence diff."""
    from moetrace.conform import fence, requirements
    from moetrace.conform.source import ForkError, find_fork, find_kt_kernel, fork_root, parse_fork

    try:
        src = find_fork(case.fork_path)
        parsed = parse_fork(src)
    except ForkError as err:
        return Plan(case, {"distribution": "sglang-kt", "path": case.fork_path, "found": None}, str(err))
    fork = fork_provenance(src, parsed, find_kt_kernel([str(fork_root(src.path))] if case.fork_path else []))
    plan = Plan(case, fork, src=src)
    try:
        req = requirements.check(parsed.cls_node, case.fmt, _who(fork))
        plan.method = req.dispatch[case.fmt]
        if case.fmt in UNJUDGED:
            plan.error = _unjudged(case, plan.method, _who(fork))
        elif case.patch_fence:
            plan.patch = {"methods": [plan.method],
                          "diff": fence.patch_diff(parsed.cls_node, [plan.method], parsed.free, src.path.name)}
    except ForkError as err:
        plan.error = str(err)
        plan.status = "absent" if isinstance(err, requirements.NoPath) else "refused"
    return plan


def _refused(plan: Plan, tp: int, error: str) -> ConformResult:
    return ConformResult(plan.case, tp, plan.fork, ExitCode.INCOMPLETE, plan.status, "", "", "", [], {}, [], "", error=error,
                         patch=plan.patch, method=plan.method)


def _job(plans: list[Plan], tp: int, wd: Path, guard: str | None, timeout_s: float, notes: dict):
    from moetrace.conform.rank import RankCase, RankJob

    rank_cases, prepared = [], []
    for p in plans:
        c = p.case
        ck, index, cid = _prepare(wd, c.fmt, c.experts, tp)
        run_id = f"conform-{c.name}-{uuid.uuid4().hex[:6]}"
        writer = "moetrace" if c.name in notes else c.writer
        prepared.append((p, index, run_id))
        rank_cases.append(RankCase(run_id, c.fmt, c.schedule, tuple(p.patch.get("methods", ())), writer, str(ck),
                                   cid, str(wd / "traces"), 0, c.experts, HIDDEN, BLOCK * tp,
                                   tuple(range(1, c.experts, 4)), str(p.src.path), p.src.version,
                                   str(index) if guard else None, guard or "all", notes.get(c.name, "")))
    logs = wd / f"ranks-{uuid.uuid4().hex[:6]}"
    logs.mkdir()
    kt = plans[0].fork
    job = RankJob(tp, str(logs / "store"), None, str(logs), kt.get("kt_kernel_path"), kt.get("kt_kernel"),
                  timeout_s, tuple(rank_cases))
    return job, prepared, logs


def _run_job(plans: list[Plan], tp: int, wd: Path, temporary: bool, guard: str | None, timeout_s: float,
             notes: dict) -> tuple[list, list, tuple | None, Path]:
    from dataclasses import replace

    from moetrace.conform.slow_peer import Control

    job, prepared, logs = _job(plans, tp, wd, guard, timeout_s, notes)
    ctl = Control(None, tp, create=True) if any(p.case.schedule == "slow-peer" for p in plans) else None
    try:
        results = _spawn(replace(job, control=ctl.name if ctl else None))
    finally:
        if ctl is not None:
            ctl.close(unlink=True)
    return results, prepared, _rank_error(results, logs, not temporary), logs


def _group(p: Plan) -> str:
    """Cases that share one set of rank processes: kt-kernel's writers of different
    methods never share a process (kt-kernel 0.5.2-0.6.1 wrote wrong per-channel scales
    for layer 0 after its FP8 block wrapper had loaded layer 0 in the same process, and
    right ones alone); moetrace's writer has no such state."""
    return p.case.fmt if p.case.writer == "kt-kernel" else "moetrace"


def _run_group(runnable: list[Plan], tp: int, wd: Path, temporary: bool, guard: str | None,
               timeout_s: float) -> tuple[list, list, tuple | None, float]:
    """One set of rank processes for `runnable`; kt-kernel's writer dying by a signal for
    one method gives that method's cases moetrace's writer, and they run again."""
    notes: dict = {}
    t1 = time.perf_counter()
    results, prepared, err, _ = _run_job(runnable, tp, wd, temporary, guard, timeout_s, notes)
    for _ in FORMATS:
        dead = next((r for r in results if r.get("error_kind") == "writer"), None)
        if not err or err[0] != "writer" or dead is None:
            break
        fresh = {p.case.name: dead["error"] for p in runnable
                 if p.case.writer == "kt-kernel" and p.case.fmt == dead.get("fmt") and p.case.name not in notes}
        if not fresh:
            break
        notes.update(fresh)
        results, prepared, err, _ = _run_job(runnable, tp, wd, temporary, guard, timeout_s, notes)
    return results, prepared, err, time.perf_counter() - t1


def run_conform(cases: Sequence[Case], tp: int = 2, workdir: str | None = None,
                timeout_s: float = 120.0, guard: str | None = "all") -> list[ConformResult]:
    """Run every case that can run, in one set of TP rank processes per group (_group;
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
            groups.setdefault(_group(p), []).append(p)
    if not groups:
        return [out[i] for i in range(len(plans))]
    wd, temporary = _workdir(workdir)
    try:
        prep = round(time.perf_counter() - t0, 2)
        for runnable in groups.values():
            results, prepared, err, spent = _run_group(runnable, tp, wd, temporary, guard, timeout_s)
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
                    facts["patched"], _held(report, c.fmt, tp, c.experts),
                    [f["sentence"] for f in doc["first_divergence"]], doc["totals"]["sentence"], seconds, report,
                    {r: m.get("guard") for r, m in read_manifests(str(wd / "traces"), run_id).items()},
                    patch=p.patch, method=p.method)
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
    if c["schedule"] == "none":
        lines.append("note: no injected delay: a match proves nothing (the race depends on timing), "
                     "a divergence is real")
    lines += [f"first divergence: {s}" for s in doc["first_divergence"]]
    if doc.get("guard"):
        from moetrace.jobs.demo import guard_sentence

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
    from moetrace.outputs import write_local_text

    if not json_out:
        return exit_code
    try:
        write_local_text(json_out, "--json-out", json.dumps(doc, indent=1) + "\n")
    except MoetraceError as err:
        echo(f"moetrace: error: {err}")
        return ExitCode.REPORT_UNWRITTEN if exit_code == ExitCode.PASS else exit_code
    return exit_code


def conform_main(case: Case, tp: int, workdir: str | None, json_out: str | None,
                 echo: Callable[[str], None] = print) -> int:
    """The command's body: check --json-out, run, print, write --json-out (for every
    exit code), return the exit code; exit 2 ends with the one-line error."""
    from moetrace.outputs import probe_output

    if json_out:
        probe_output(json_out, "--json-out")
    (res,) = run_conform([case], tp=tp, workdir=workdir)
    doc = result_doc(res)
    code = write_doc(json_out, doc, res.exit_code, echo)
    if res.error:
        raise MoetraceError(res.error)
    for line in result_lines(doc):
        echo(line)
    return code
