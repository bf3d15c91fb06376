"""`moetrace conform`: run the installed fork's own staging code and audit what
each rank ends up holding.

synthetic checkpoint -> index -> TP rank processes (gloo) running sglang-kt's
``SharedFullContext.load`` under the simulated CUDA runtime (rank 0's writer:
kt-kernel's when it runs here), moetrace's KT capture on ``load`` -> analysis.
Exit 1: a rank holds wrong bytes (first divergence named); 0: every rank holds
its shard, full coverage; 2: it could not run (no fork, an unsupported fork
layout, a stalled schedule), said by name. docs/conform.md.
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

from moetrace.errors import MoetraceError

FORMATS = ("fp8_block", "fp8_channel", "bf16")
SCHEDULES = ("slow-peer", "none")
WRITERS = ("kt-kernel", "moetrace")
HIDDEN, BLOCK = 256, 128  # per rank I_tp = one 128 block
WORKDIR_MARK = ".moetrace-conform"
ERROR_KINDS = {"layout": "unsupported fork layout", "refused": "refused", "timeout": "the schedule stalled",
               "crash": "the fork's code failed", "peer": "a rank lost its peer"}


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
class ConformResult:
    case: Case
    tp: int
    fork: dict  # path, version, how it was found
    exit_code: int  # 0 every rank holds its shard, full coverage; 1 divergence; 2 could not tell
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
                    results[r] = {"rank": r, "error": f"rank {r} exited with code {p.exitcode} and wrote no result",
                                  "error_kind": "crash", "cases": []}
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


def _raise_rank_error(results: list[dict], logs: Path, keep: bool) -> None:
    bad = [r for r in results if r.get("error")]
    if bad:  # the root cause is a rank's own error, not a peer that saw the connection drop
        first = next((r for r in bad if r.get("error_kind") != "peer"), bad[0])
        where = f" (rank logs: {logs})" if keep else " (rerun with --workdir to keep the rank logs)"
        raise MoetraceError(f"conform could not run ({ERROR_KINDS.get(first.get('error_kind'), 'failed')}): "
                            f"rank {first['rank']}: {first['error']}{where}")


def _held(report, fmt: str, tp: int, experts: int) -> dict[int, dict[str, list]]:
    """Per rank and tensor, whose bytes each expert holds, from the analysis' rows."""
    from moetrace.schema import COPY_ORDERS

    held = {r: {t: list(range(experts)) for t in COPY_ORDERS[fmt]} for r in range(tp)}
    for row in report.doc["divergent_rows"]:
        found = row.get("found")
        held[row["tp_rank"]][row["tensor"]][row["expert"]] = found["expert"] if found else None
    return held


def run_conform(cases: Sequence[Case], tp: int = 2, workdir: str | None = None,
                timeout_s: float = 120.0, guard: str | None = "all") -> list[ConformResult]:
    """Run every case in one set of TP rank processes (one start-up for all). ``guard``:
    the in-server guard's rows ("all": the whole trace, "mismatch": production's) or None
    (no guard: capture only)."""
    from moetrace.analysis import analyze
    from moetrace.conform.fence import check_patchable
    from moetrace.conform.rank import RankCase, RankJob
    from moetrace.conform.source import find_fork, find_kt_kernel, parse_fork
    from moetrace.conform.slow_peer import Control
    from moetrace.tracer.manifest import read_manifests

    for c in cases:
        check_case(c, tp)
    t0 = time.perf_counter()
    forks = {c.fork_path: find_fork(c.fork_path) for c in cases}
    for c in cases:  # refuse an unusable fork here, before any process starts
        parsed = parse_fork(forks[c.fork_path])
        if c.patch_fence:
            check_patchable(parsed.cls_node)
    kt_path, kt_version = find_kt_kernel([p for p in forks if p])
    wd, temporary = _workdir(workdir)
    ctl = None
    try:
        rank_cases, prepared = [], []
        for c in cases:
            ck, index, cid = _prepare(wd, c.fmt, c.experts, tp)
            run_id = f"conform-{c.name}-{uuid.uuid4().hex[:6]}"
            src = forks[c.fork_path]
            prepared.append((c, index, run_id, {"path": str(src.path), "version": src.version, "found": src.origin,
                                                "kt_kernel": kt_version}))
            rank_cases.append(RankCase(run_id, c.fmt, c.schedule, c.patch_fence, c.writer, str(ck), cid,
                                       str(wd / "traces"), 0, c.experts, HIDDEN, BLOCK * tp,
                                       tuple(range(1, c.experts, 4)), str(src.path), src.version,
                                       str(index) if guard else None, guard or "all"))
        logs = wd / f"ranks-{uuid.uuid4().hex[:6]}"
        logs.mkdir()
        if any(c.schedule == "slow-peer" for c in cases):
            ctl = Control(None, tp, create=True)
        job = RankJob(tp, str(logs / "store"), ctl.name if ctl else None, str(logs), kt_path, timeout_s,
                      tuple(rank_cases))
        t1 = time.perf_counter()
        results = _spawn(job)
        _raise_rank_error(results, logs, not temporary)
        t2 = time.perf_counter()
        out = []
        for i, (c, index, run_id, fork) in enumerate(prepared):
            facts = results[0]["cases"][i]
            report = analyze([str(wd / "traces" / run_id)], index=str(index), max_rows=1 << 20)
            doc = report.doc
            seconds = {"prepare": round(t1 - t0, 2), "ranks": round(t2 - t1, 2), "rank0": facts["seconds"]}
            out.append(ConformResult(
                c, tp, fork, report.exit_code, doc["status"], run_id, facts["writer"], facts["writer_kind"],
                facts["patched"], _held(report, c.fmt, tp, c.experts),
                [f["sentence"] for f in doc["first_divergence"]], doc["totals"]["sentence"], seconds, report,
                {r: m.get("guard") for r, m in read_manifests(str(wd / "traces"), run_id).items()}))
        return out
    finally:
        if ctl is not None:
            ctl.close(unlink=True)
        if temporary:
            shutil.rmtree(wd, ignore_errors=True)


def result_doc(res: ConformResult) -> dict:
    """The --json-out document (docs/conform.md); also what the terminal lines are made of."""
    from moetrace import __version__
    from moetrace.schema import CONFORM_SCHEMA, CONFORM_SCHEMA_VERSION

    return {"schema": CONFORM_SCHEMA, "version": CONFORM_SCHEMA_VERSION, "moetrace_version": __version__,
            "fork": res.fork, "case": {**asdict(res.case), "tp": res.tp}, "run_id": res.run_id,
            "exit_code": res.exit_code, "status": res.status, "writer": res.writer, "writer_kind": res.writer_kind,
            "patched": res.patched, "held": {str(r): h for r, h in res.held.items()},
            "first_divergence": res.first_divergence, "totals": res.totals, "seconds": res.seconds,
            "guard": {str(r): g for r, g in res.guard.items()}, "analysis": res.report.doc}


def result_lines(doc: dict) -> list[str]:
    c = doc["case"]
    fence = f"seed PR fence patched into {', '.join(doc['patched'])}" if c["patch_fence"] else "as installed"
    lines = [f"fork: sglang-kt {doc['fork']['version']} ({doc['fork']['path']}), SharedFullContext {fence}",
             f"run: {c['fmt']}, TP{c['tp']}, {c['experts']} experts, schedule {c['schedule']}; "
             f"rank 0's writer: {doc['writer']}"]
    if c["schedule"] == "none":
        lines.append("note: no injected delay: a match proves nothing (the race depends on timing), "
                     "a divergence is real")
    word = {0: "PASS: every rank holds its shard, full coverage", 1: "DIVERGENT", 2: "INCOMPLETE"}[doc["exit_code"]]
    lines.append(f"{word}: {doc['totals']}")
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
    return lines


def conform_main(case: Case, tp: int, workdir: str | None, json_out: str | None,
                 echo: Callable[[str], None] = print) -> int:
    """The command's body: run, print, write --json-out, return the exit code."""
    from moetrace.storage import open_fs, write_json

    (res,) = run_conform([case], tp=tp, workdir=workdir)
    doc = result_doc(res)
    for line in result_lines(doc):
        echo(line)
    if json_out:
        fs, path = open_fs(json_out, "--json-out")
        write_json(fs, path, doc)
    return res.exit_code
