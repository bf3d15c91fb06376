"""`moetrace demo` and the selftest's detector proof: the whole pipeline on an
emulated TP2 KT staging server.

checkpoint (synthetic Qwen3.5 FP8) -> index -> emulated server, unfenced and
fenced, same requests, moetrace's own hooks -> analyze both -> reports, plot,
token-0 differences against a reference computed from the checkpoint. The staged
loads are the installed sglang-kt's own code where it is installed (transport
"fork", kt-kernel's writer on rank 0), else the emulator's (said in the output).

Every run starts from nothing in its work folder: the earlier run's checkpoint,
index, traces, reports and rank logs are removed first, so the same command can run
any number of times in one place and each run reads only what it wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from moetrace.errors import ExitCode, MoetraceError
from moetrace.jobs.progress import Progress

RUNS = (("unfenced", "none"), ("fenced", "all"))
# A work folder the demo made holds this file (and its lock); everything in OUTPUTS is
# the demo's own, replaced by the next run.
MARK = ".moetrace-demo"
OUTPUTS = ("checkpoint", "index.parquet", "traces", "reports", "logs")


@dataclass(frozen=True)
class DemoSize:
    layers: int = 2
    experts: int = 8
    hidden: int = 256
    intermediate: int = 256
    prompt_repeats: int = 3  # the long prompt is this many copies of one sentence


QUICK = DemoSize()
FULL = DemoSize(layers=2, experts=16, hidden=512, intermediate=512, prompt_repeats=4)


def demo_requests(size: DemoSize) -> list[dict]:
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
    empty, or one the demo made (its MARK, or nothing but OUTPUTS in it); a folder
    holding anything else is refused, as is one another demo is running in."""
    if workdir.exists() and not workdir.is_dir():
        raise MoetraceError(f"--workdir {workdir}: exists and is not a folder")
    entries = set(os.listdir(workdir)) if workdir.exists() else set()
    foreign = sorted(entries - set(OUTPUTS) - {MARK})
    if foreign and MARK not in entries:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise MoetraceError(f"--workdir {workdir}: holds {shown}, which moetrace demo did not write; give a new or "
                            "empty folder, or the work folder of an earlier demo")
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / MARK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise MoetraceError(f"--workdir {workdir}: another moetrace demo is running there") from None
        lock.seek(0)
        lock.truncate()
        lock.write("moetrace demo work folder: checkpoint, index, traces, reports and rank logs of the last run\n")
        lock.flush()
        for name in OUTPUTS:
            path = workdir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        yield workdir


def _prepare(workdir: Path, size: DemoSize, progress: Progress) -> tuple[Path, Path, str]:
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint
    from moetrace.checkpoints.index import write_index
    from moetrace.checkpoints.index_build import build_index

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


def run_pair(workdir: Path, size: DemoSize, device: str = "cpu", slow_rank: int | None = 1,
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
    requests = demo_requests(size)
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


def guard_sentence(records: dict[str, dict]) -> str:
    parts = []
    for rank, g in sorted(records.items()):
        t, loads = g.get("tensors") or {}, g.get("loads") or {}
        checked, n, total = t.get("match", 0) + t.get("mismatch", 0), loads.get("mismatch", 0), sum(loads.values())
        cov = ", ".join(f"{k} {v:.0%}" for k, v in sorted((g.get("coverage") or {}).items())) or "none"
        # loads as the record counts them: mismatching loads of all loads verified
        parts.append(f"rank {rank} {g.get('status')}: {t.get('mismatch', 0):,}/{checked:,} tensors mismatched, "
                     f"{n:,}/{total:,} load{'' if total == 1 else 's'} mismatched, coverage {cov}")
    return "; ".join(parts) or "no guard record"


def _write_reports(run_id: str, report, reports: Path, with_plot: bool) -> dict:
    """This run's reports (the work folder was emptied first: none of an earlier run is left)."""
    from moetrace.analysis import plot, render

    reports.mkdir(parents=True, exist_ok=True)
    paths = {"json": reports / f"{run_id}.json", "markdown": reports / f"{run_id}.md",
             "junit": reports / f"{run_id}.junit.xml"}
    paths["json"].write_text(render.to_json(report))
    paths["markdown"].write_text(render.to_markdown(report))
    paths["junit"].write_text(render.to_junit(report))
    if with_plot:
        paths["plot"] = reports / f"{run_id}.png"
        plot.plot(report, str(paths["plot"]))
    return {k: str(v) for k, v in paths.items()}


def run_demo(workdir: str | Path, device: str = "cpu", quick: bool = False, transport: str = "auto",
             progress: Progress | None = None) -> dict:
    from moetrace.analysis.plot import missing_plotter

    workdir = Path(workdir)
    progress = progress or Progress.off()
    t0 = time.perf_counter()
    # what the run needs, before it starts: without matplotlib the plots are skipped, said once
    no_plot = missing_plotter()
    with fresh_workdir(workdir):
        return _run_demo(workdir, device, quick, transport, progress, no_plot, t0)


def _run_demo(workdir: Path, device: str, quick: bool, transport: str, progress: Progress, no_plot: str | None,
              t0: float) -> dict:
    from moetrace.analysis.render import grouped_summaries

    pair = run_pair(workdir, QUICK if quick else FULL, device, transport=transport, progress=progress)
    summary = {"workdir": str(workdir), "checkpoint": str(pair["checkpoint"]), "index": str(pair["index"]),
               "logs": str(pair["logs"]), "transport": pair["transport"], "staged_by": pair["staged_by"],
               "plots_skipped": no_plot, "runs": {}}
    for run_id, run in pair["runs"].items():
        rep = run["report"]
        doc = rep.doc
        summary["runs"][run_id] = {
            "fence": run["fence"],
            "trace": str(pair["traces"] / run_id),
            "rank_logs": str(pair["logs"] / run_id),
            "seconds": round(run["seconds"], 1),
            "audit_exit_code": rep.exit_code,
            "totals": doc["totals"]["sentence"],
            "first_divergence": [f["sentence"] for f in doc["first_divergence"]],
            # as analyze prints them: loads that differ only in step folded into one line
            "summaries": [g["sentence"] for g in grouped_summaries(doc)],
            "token0_max_abs_logit_delta_vs_reference": run["token0_max_abs_delta"],
            "tokens_equal_reference": run["tokens_equal_reference"],
            "guard": run["guard"],
            "guard_sentence": guard_sentence(run["guard"]),
            "reports": _write_reports(run_id, rep, workdir / "reports", with_plot=no_plot is None),
        }
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    unf, fen = summary["runs"]["unfenced"], summary["runs"]["fenced"]
    summary["race_found"] = unf["audit_exit_code"] == ExitCode.DIVERGENT and any("(E+2)" in s for s in unf["first_divergence"])
    summary["fix_validated"] = fen["audit_exit_code"] == ExitCode.PASS
    return summary


def print_demo(summary: dict, echo: Callable[[str], None] = print) -> None:
    """The per-run summaries, where the outputs are, then the verdict: the last line."""
    unf, fen = summary["runs"]["unfenced"], summary["runs"]["fenced"]
    echo(f"staged loads: {summary['staged_by']}")
    echo(f"== unfenced (the fork as it is: rank 0 waits only for its own copy before refilling a slot; "
         f"{unf['seconds']} s)")
    for s in unf["first_divergence"]:
        echo(f"first divergence: {s}")
    for s in unf["summaries"][:4]:
        echo(f"  {s}")
    if len(unf["summaries"]) > 4:
        echo(f"  ... {len(unf['summaries']) - 4} more lines like these")
    echo(f"  {unf['totals']}")
    echo(f"  in-server guard: {unf['guard_sentence']}")
    echo(f"  token 0 vs reference: max |logit delta| {unf['token0_max_abs_logit_delta_vs_reference']:.3g}"
         f"{'' if unf['tokens_equal_reference'] else ', output tokens differ'}")
    echo(f"== fenced (every rank syncs its copy, then a collective fence, before a slot is reused; "
         f"{fen['seconds']} s)")
    echo(f"  {fen['totals']}")
    echo(f"  in-server guard: {fen['guard_sentence']}")
    echo(f"  token 0 vs reference: max |logit delta| {fen['token0_max_abs_logit_delta_vs_reference']:.3g}"
         f"{'' if fen['tokens_equal_reference'] else ', output tokens differ'}")
    echo("")
    if summary.get("plots_skipped"):
        echo(f"plots:   skipped ({summary['plots_skipped']})")
    else:
        echo(f"plots:   {unf['reports']['plot']}  {fen['reports']['plot']}")
    echo(f"reports: {Path(unf['reports']['markdown']).parent}/ (json, md, junit per run); traces: "
         f"{Path(unf['trace']).parent}/; rank logs (kt-kernel's and the servers' own output): "
         f"{Path(unf['rank_logs']).parent}/")
    race = "found" if summary["race_found"] else "NOT found"
    fix = "validated" if summary["fix_validated"] else "NOT validated"
    echo(f"race {race} unfenced; fix {fix} fenced ({summary['seconds']} s)")


# ------------------------------------------------------------------ selftest


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
    clean = fen.exit_code == ExitCode.PASS and totals["missing"] == 0 and totals["divergent"] == 0 and totals["tensors"] > 0
    problems = []
    if not caught:
        got = "; ".join(f["sentence"] for f in unf.doc["first_divergence"]) or "no divergence"
        problems.append(f"unfenced run not caught as E+2 on rank 1's w2_weight_scale_inv (audit exit {unf.exit_code}: {got})")
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


def to_json(summary: dict) -> str:
    return json.dumps(summary, indent=2, default=str)
