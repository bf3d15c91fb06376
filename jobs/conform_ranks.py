"""`moetrace conform`'s rank processes: the work folder, each case's checkpoint and index,
the TP rank processes (spawned, watched, stopped), and why a set of them failed.

One set of processes per group of cases (``group_of``); kt-kernel's writer dying by a
signal for one method gives that method's cases moetrace's writer, and they run again
(``run_group``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from moetrace.errors import MoetraceError
from moetrace.jobs.conform_plan import FORMATS, Plan
from moetrace.outputs import marked_folder

HIDDEN, BLOCK = 256, 128  # per rank I_tp = one 128 block
INT4_GROUP = 32  # int4: Kimi-K2's group size; I_tp = 128 holds 4 groups, 16 words per row
WORKDIR_MARK = ".moetrace-conform"
MARK_TEXT = "moetrace conform work folder"
ERROR_KINDS = {"layout": "unsupported fork layout", "refused": "refused", "timeout": "the schedule stalled",
               "crash": "the fork's code failed", "peer": "a rank lost its peer", "writer": "rank 0's writer failed"}


def work_folder(path: str | None) -> tuple[Path, bool]:
    """(folder, whether it is ours to delete). A given folder must be new, empty, or
    one conform made before (its checkpoints and indexes are reused)."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="moetrace-conform-")), True
    p = Path(path)
    if p.exists() and (not p.is_dir() or (any(p.iterdir()) and not marked_folder(str(p), WORKDIR_MARK, MARK_TEXT))):
        raise MoetraceError(f"--workdir {p}: exists and is neither empty nor a previous conform --workdir")
    p.mkdir(parents=True, exist_ok=True)
    (p / WORKDIR_MARK).write_text(f"{MARK_TEXT}: checkpoints, indexes, traces, rank logs\n")
    return p, False


def staged_layout(fmt: str):
    """The layout a rank holds after the fork's load: canonical, except INT4, whose load
    repacks (conform: its identity) and permutes the scales (checkpoints.layout_rules)."""
    from moetrace.checkpoints.layout import CANONICAL, ServerLayout
    from moetrace.checkpoints.layout_rules import MARLIN_PERMUTE_SCALES, MARLIN_REPACK_IDENTITY

    return ServerLayout(transforms=(MARLIN_REPACK_IDENTITY, MARLIN_PERMUTE_SCALES)) if fmt == "int4" else CANONICAL


def prepare(wd: Path, fmt: str, experts: int, tp: int) -> tuple[Path, Path, str]:
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
                                   hidden=HIDDEN, intermediate=inter, scale_dtype="bfloat16", num_files=1,
                                   group_size=INT4_GROUP if fmt == "int4" else None)
    index = wd / f"index-{fmt}-e{experts}-i{inter}-tp{tp}.parquet"
    if not index.exists():
        write_index(build_index(ck, tp, layout=staged_layout(fmt)), index)
    return ck, index, open_checkpoint(ck).identity


def _exited_without_result(rank: int, code: int | None, results: Path) -> dict:
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
                    results[r] = _exited_without_result(r, p.exitcode, Path(job.results))
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
    failed = sorted(r for r, v in results.items() if v.get("error"))
    for r in range(job.tp):
        path = Path(job.results) / f"rank{r}.json"
        if r not in results:
            results[r] = json.loads(path.read_text()) if path.exists() else unfinished(r, failed, limit)
    return [results[r] for r in range(job.tp)]


def unfinished(rank: int, failed: list[int], limit: float) -> dict:
    """The result of a rank stopped without its file: after a peer failed (a peer error, so
    the failed rank's own error is named as the cause), else out of time."""
    if failed:
        return {"rank": rank, "error": f"rank {rank} stopped after rank {failed[0]} failed", "error_kind": "peer",
                "cases": []}
    return {"rank": rank, "error": f"rank {rank} did not finish within {limit:.0f} s", "error_kind": "timeout",
            "cases": []}


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


def _rank_job(plans: list[Plan], tp: int, wd: Path, guard: str | None, timeout_s: float, notes: dict):
    """The rank processes' job (conform.rank.RankJob) for `plans`: each case's checkpoint,
    index and run id; returns (job, (plan, index, run id) per case, the rank logs' folder)."""
    from moetrace.conform.rank import RankCase, RankJob

    rank_cases, prepared = [], []
    for p in plans:
        c = p.case
        ck, index, cid = prepare(wd, c.fmt, c.experts, tp)
        run_id = f"conform-{c.name}-{uuid.uuid4().hex[:6]}"
        writer = "moetrace" if c.name in notes else c.writer
        prepared.append((p, index, run_id))
        rank_cases.append(RankCase(run_id, c.fmt, c.schedule, tuple(p.patch.get("methods", ())), writer, str(ck),
                                   cid, str(wd / "traces"), 0, c.experts, HIDDEN, BLOCK * tp,
                                   tuple(range(1, c.experts, 4)), str(p.src.path), p.src.version,
                                   str(index) if guard else None, guard or "all", notes.get(c.name, ""),
                                   INT4_GROUP if c.fmt == "int4" else None))
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

    job, prepared, logs = _rank_job(plans, tp, wd, guard, timeout_s, notes)
    ctl = Control(None, tp, create=True) if any(p.case.schedule == "slow-peer" for p in plans) else None
    try:
        results = _spawn(replace(job, control=ctl.name if ctl else None))
    finally:
        if ctl is not None:
            ctl.close(unlink=True)
    return results, prepared, _rank_error(results, logs, not temporary), logs


def group_of(p: Plan) -> str:
    """Cases that share one set of rank processes: kt-kernel's writers of different
    methods never share a process (kt-kernel 0.5.2-0.6.1 wrote wrong per-channel scales
    for layer 0 after its FP8 block wrapper had loaded layer 0 in the same process, and
    right ones alone); moetrace's writer has no such state."""
    return p.case.fmt if p.case.writer == "kt-kernel" else "moetrace"


def run_group(runnable: list[Plan], tp: int, wd: Path, temporary: bool, guard: str | None,
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
