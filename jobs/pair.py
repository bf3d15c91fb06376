"""The emulated TP2 KT staging pair that the demo and the selftest's detector proof run:
one injected schedule, unfenced and fenced, the same requests, moetrace's own hooks, both
analyzed (``run_pair``); and the proof's verdict on such a pair (``judge_detector``).

The staged loads are the installed sglang-kt's own code where it is installed (transport
"fork", kt-kernel's writer on rank 0), else the emulator's. A work folder holds one pair:
``fresh_workdir`` empties it of the earlier run's outputs first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from moetrace.analysis.sentences import guard_sentence
from moetrace.errors import ExitCode, MoetraceError
from moetrace.jobs.progress import Progress
from moetrace.outputs import marked_folder

RUNS = (("unfenced", "none"), ("fenced", "all"))
# A work folder the demo made holds this file (and its lock), starting with MARK_TEXT;
# everything in OUTPUTS there is the demo's own, replaced by the next run. A folder
# without it is the demo's only when empty: the same names in a user's folder (a
# README recipe's traces/, index.parquet, checkpoint/) are never taken for the demo's.
MARK = ".moetrace-demo"
MARK_TEXT = "moetrace demo work folder"
OUTPUTS = ("checkpoint", "index.parquet", "traces", "reports", "logs", "server-act")  # server-act: jobs.demo_server


@dataclass(frozen=True)
class PairSize:
    layers: int = 2
    experts: int = 8
    hidden: int = 256
    intermediate: int = 256
    prompt_repeats: int = 3  # the long prompt is this many copies of one sentence


QUICK = PairSize()
FULL = PairSize(layers=2, experts=16, hidden=512, intermediate=512, prompt_repeats=4)


def pair_requests(size: PairSize) -> list[dict]:
    """A fresh long prompt, then the same prefix replayed with more text: the
    prefix-cache hit that exposed the race in the field."""
    base = "Experts stage through host slots; a slow peer may read a slot after it was refilled. " * size.prompt_repeats
    return [
        {"prompt": base, "max_tokens": 4},
        {"prompt": base + "Which expert did rank one really load?", "max_tokens": 4},
    ]


@contextlib.contextmanager
def fresh_workdir(workdir: Path) -> Iterator[Path]:
    """Hold ``workdir`` for one run, emptied of the earlier run's outputs. It must be new,
    empty, or one the demo made (its MARK file, a regular file starting with MARK_TEXT);
    any other folder is refused, as is one another demo is running in."""
    if workdir.is_symlink() or (workdir.exists() and not workdir.is_dir()):
        raise MoetraceError(f"--workdir {workdir}: exists and is not a folder (a link or a file)")
    entries = sorted(os.listdir(workdir)) if workdir.exists() else []
    if entries and not marked_folder(str(workdir), MARK, MARK_TEXT):
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise MoetraceError(f"--workdir {workdir}: holds {shown} and no {MARK} mark, so moetrace demo did not make "
                            "it; give a new or empty folder, or the work folder of an earlier demo")
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / MARK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise MoetraceError(f"--workdir {workdir}: another moetrace demo is running there") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{MARK_TEXT}: checkpoint, index, traces, reports and rank logs of the last run\n")
        lock.flush()
        for name in OUTPUTS:
            path = workdir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        yield workdir


def _prepare(workdir: Path, size: PairSize, progress: Progress) -> tuple[Path, Path, str]:
    from moetrace.checkpoints.index import write_index
    from moetrace.checkpoints.index_build import build_index
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint

    ckpt = workdir / "checkpoint"
    with progress.step(f"writing a synthetic Qwen3.5 FP8 checkpoint ({size.layers} MoE layers x {size.experts} "
                       f"experts)"):
        write_synthetic_checkpoint(ckpt, family="qwen3_5_moe", fmt="fp8_block", num_layers=size.layers,
                                   num_experts=size.experts, hidden=size.hidden, intermediate=size.intermediate,
                                   scale_dtype="bfloat16", num_files=2)
        checkpoint_id = open_checkpoint(ckpt).identity
    with progress.step("fingerprinting the expected TP2 shards (index)"):
        index = write_index(build_index(ckpt, 2), workdir / "index.parquet")
    return ckpt, index, checkpoint_id


def _run(ckpt: Path, traces: Path, run_id: str, fence: str, requests: list[dict], checkpoint_id: str,
         device: str, slow_rank: int | None, transport: str, index: Path, logs: Path):
    from moetrace.emulator import run_emulation
    from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec

    # The guard checks every load in the server as well (on the device, against the index);
    # guard_rows=all keeps the whole trace for the analysis.
    spec = hook_spec({"out": str(traces), "run_id": run_id, "checkpoint_id": checkpoint_id, "index": str(index),
                      "guard": "record", "guard_rows": "all"}, DEFAULT_TARGETS)
    # The ranks' own output (kt-kernel's start-up lines and per-layer timings, the hooks'
    # notes) goes to logs/<run_id>/rank<r>.log, not to the terminal.
    return run_emulation(ckpt, requests, tp=2, fence=fence, slow_rank=slow_rank, forward_hooks=spec, device=device,
                         transport=transport, log_dir=str(logs / run_id))


def _token0_delta(result, reference) -> float:
    return max(float((r.token0_logits.float() - ref.token0_logits.float()).abs().max())
               for r, ref in zip(result.requests, reference))


def run_pair(workdir: Path, size: PairSize, device: str = "cpu", slow_rank: int | None = 1,
             runs: tuple[tuple[str, str], ...] = RUNS, transport: str = "auto",
             progress: Progress | None = None) -> dict:
    """Unfenced and fenced runs on one schedule, analyzed; returns the pieces. ``workdir``:
    held and emptied by the caller (fresh_workdir)."""
    from moetrace.analysis import analyze
    from moetrace.emulator import reference_outputs
    from moetrace.emulator.fork_transport import resolve_transport

    progress = progress or Progress.off()
    workdir = Path(workdir)
    transport, staged_by = resolve_transport(transport, device)
    ckpt, index, checkpoint_id = _prepare(workdir, size, progress)
    requests = pair_requests(size)
    traces = workdir / "traces"
    with progress.step("computing the reference outputs from the checkpoint"):
        reference = reference_outputs(ckpt, requests, tp=2)
    out = {"checkpoint": ckpt, "index": index, "traces": traces, "logs": workdir / "logs", "runs": {},
           "transport": transport, "staged_by": staged_by}
    for run_id, fence in runs:
        t0 = time.perf_counter()
        with progress.step(f"running the emulated TP2 server {run_id} (--fence {fence}), {len(requests)} requests"):
            result = _run(ckpt, traces, run_id, fence, requests, checkpoint_id, device, slow_rank, transport, index,
                          workdir / "logs")
        seconds = time.perf_counter() - t0
        with progress.step(f"analyzing the {run_id} trace"):
            report = analyze([str(traces / run_id)], index=str(index))
        out["runs"][run_id] = {"fence": fence, "result": result, "report": report, "seconds": seconds,
                               "guard": guard_records(traces, run_id),
                               "token0_max_abs_delta": _token0_delta(result, reference),
                               "tokens_equal_reference": all(r.output_ids == ref.output_ids
                                                             for r, ref in zip(result.requests, reference))}
    return out


def guard_records(traces: Path, run_id: str) -> dict[str, dict]:
    """The in-server guard's record of each rank ({rank: manifest guard section})."""
    from moetrace.tracer.manifest import read_manifests

    return {str(r): m.get("guard") or {} for r, m in read_manifests(str(traces), run_id).items()}


def detector_proof(workdir: Path, device: str = "cpu", quick: bool = True, progress: Progress | None = None) -> dict:
    """The detector proof of `moetrace selftest`: on this device, the unfenced
    transport must be caught as E+2 on rank 1's w2 scales, and the fenced one
    must pass with full coverage, on the same injected schedule."""
    with fresh_workdir(Path(workdir) / "detector") as folder:
        pair = run_pair(folder, QUICK if quick else FULL, device, progress=progress)
    runs = pair["runs"]
    verdict = judge_detector(runs["unfenced"]["report"], runs["fenced"]["report"],
                             (runs["unfenced"]["guard"], runs["fenced"]["guard"]))
    verdict["detail"] = f"{verdict['detail']} [staged loads: {pair['staged_by']}]"
    verdict["transport"] = pair["transport"]
    return verdict


def judge_guard(unf, guard_unf: dict, guard_fen: dict) -> list[str]:
    """The in-server guard (on the run's device) must agree with the analysis: unfenced,
    its mismatch counters add up to the analysis' divergent tensors, none on rank 0;
    fenced, no mismatch, nothing unverified, full coverage on every rank."""
    problems = []
    counted = sum((g.get("tensors") or {}).get("mismatch", 0) for g in guard_unf.values())
    if counted != unf.doc["totals"]["divergent"] or not counted:
        problems.append(f"the guard counted {counted} mismatching tensors unfenced, the analysis "
                        f"{unf.doc['totals']['divergent']} divergent")
    if (guard_unf.get("0", {}).get("tensors") or {}).get("mismatch"):
        problems.append("the guard counted mismatches on rank 0 unfenced (the slow peer is rank 1)")
    for rank, g in sorted(guard_fen.items()):
        t, cov = g.get("tensors") or {}, g.get("coverage") or {}
        if t.get("mismatch") or t.get("unverified") or not cov or any(v != 1.0 for v in cov.values()):
            problems.append(f"the guard on fenced rank {rank} is not clean ({guard_sentence({rank: g})})")
    return problems


def judge_detector(unf, fen, guards: tuple[dict, dict] | None = None) -> dict:
    """The detector proof's verdict on two analyzed runs of one schedule: the unfenced
    report must name E+2 on rank 1's w2 scales first, the fenced one must be a clean,
    complete audit; ``guards``: the in-server guard's records of both runs (judge_guard)."""
    first = [e for f in unf.doc["first_divergence"] for e in f["entries"]]
    caught = unf.exit_code == ExitCode.DIVERGENT and any(
        e["verdict"] == "stale" and e.get("k") == 2 and e["tp_rank"] == 1 and e["tensor"] == "w2_weight_scale_inv"
        for e in first
    )
    totals = fen.doc["totals"]
    clean = (fen.exit_code == ExitCode.PASS and totals["missing"] == 0 and totals["divergent"] == 0
             and totals["tensors"] > 0)
    problems = []
    if not caught:
        got = "; ".join(f["sentence"] for f in unf.doc["first_divergence"]) or "no divergence"
        problems.append(f"unfenced run not caught as E+2 on rank 1's w2_weight_scale_inv (audit exit {unf.exit_code}: "
                        f"{got})")
    if not clean:
        problems.append(f"fenced run is not a clean complete audit (exit {fen.exit_code}: {totals['sentence']})")
    if guards is not None:
        problems += judge_guard(unf, *guards)
    detail = (
        f"unfenced caught: {first[0]['sentence']}; fenced: {totals['sentence']}"
        + (f"; in-server guard agrees ({guard_sentence(guards[0])})" if guards is not None else "")
        if not problems else "; ".join(problems)
    )
    return {"ok": not problems, "detail": detail, "unfenced_exit": unf.exit_code, "fenced_exit": fen.exit_code,
            "unfenced_totals": unf.doc["totals"]["sentence"], "fenced_totals": totals["sentence"]}
