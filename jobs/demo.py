"""`moetrace demo` and the selftest's detector proof: the whole pipeline on an
emulated TP2 KT staging server.

checkpoint (synthetic Qwen3.5 FP8) -> index -> emulated server, unfenced and
fenced, same requests, moetrace's own hooks -> analyze both -> reports, plot,
token-0 differences against a reference computed from the checkpoint. The staged
loads are the installed sglang-kt's own code where it is installed (transport
"fork", kt-kernel's writer on rank 0), else the emulator's (said in the output).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

RUNS = (("unfenced", "none"), ("fenced", "all"))


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


def _prepare(workdir: Path, size: DemoSize, echo: Callable[[str], None]) -> tuple[Path, Path, str]:
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint
    from moetrace.checkpoints.index import write_index
    from moetrace.checkpoints.index_build import build_index

    ckpt = workdir / "checkpoint"
    if not (ckpt / "config.json").exists():
        write_synthetic_checkpoint(ckpt, family="qwen3_5_moe", fmt="fp8_block", num_layers=size.layers,
                                   num_experts=size.experts, hidden=size.hidden, intermediate=size.intermediate,
                                   scale_dtype="bfloat16", num_files=2)
    checkpoint_id = open_checkpoint(ckpt).identity
    echo(f"checkpoint: {ckpt} (synthetic Qwen3.5 FP8: {size.layers} MoE layers x {size.experts} experts, "
         f"H {size.hidden}, I {size.intermediate}; id {checkpoint_id})")
    index = write_index(build_index(ckpt, 2), workdir / "index.parquet")
    echo(f"index: {index} (expected TP2 shards, fingerprinted)")
    return ckpt, index, checkpoint_id


def _run(ckpt: Path, traces: Path, run_id: str, fence: str, requests: list[dict], checkpoint_id: str,
         device: str, slow_rank: int | None, transport: str, index: Path):
    from moetrace.emulator import run_emulation
    from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec

    # The guard checks every load in the server as well (on the device, against the index);
    # guard_rows=all keeps the whole trace for the analysis.
    spec = hook_spec({"out": str(traces), "run_id": run_id, "checkpoint_id": checkpoint_id, "index": str(index),
                      "guard": "record", "guard_rows": "all"}, DEFAULT_TARGETS)
    return run_emulation(ckpt, requests, tp=2, fence=fence, slow_rank=slow_rank, forward_hooks=spec, device=device,
                         transport=transport)


def _token0_delta(result, reference) -> float:
    return max(float((r.token0_logits.float() - ref.token0_logits.float()).abs().max())
               for r, ref in zip(result.requests, reference))


def run_pair(workdir: Path, size: DemoSize, device: str = "cpu", slow_rank: int | None = 1,
             echo: Callable[[str], None] = lambda s: None, runs: tuple[tuple[str, str], ...] = RUNS,
             transport: str = "auto") -> dict:
    """Unfenced and fenced runs on one schedule, analyzed; returns the pieces."""
    from moetrace.analysis import analyze
    from moetrace.emulator import reference_outputs
    from moetrace.emulator.fork_transport import resolve_transport

    workdir.mkdir(parents=True, exist_ok=True)
    transport, staged_by = resolve_transport(transport, device)
    echo(f"staged loads: {staged_by}")
    ckpt, index, checkpoint_id = _prepare(workdir, size, echo)
    requests = demo_requests(size)
    traces = workdir / "traces"
    reference = reference_outputs(ckpt, requests, tp=2)
    out = {"checkpoint": ckpt, "index": index, "traces": traces, "runs": {}, "transport": transport,
           "staged_by": staged_by}
    for run_id, fence in runs:
        t0 = time.perf_counter()
        result = _run(ckpt, traces, run_id, fence, requests, checkpoint_id, device, slow_rank, transport, index)
        seconds = time.perf_counter() - t0
        report = analyze([str(traces / run_id)], index=str(index))
        out["runs"][run_id] = {"fence": fence, "result": result, "report": report, "seconds": seconds,
                               "guard": guard_records(traces, run_id),
                               "token0_max_abs_delta": _token0_delta(result, reference),
                               "tokens_equal_reference": all(r.output_ids == ref.output_ids
                                                             for r, ref in zip(result.requests, reference))}
        echo(f"ran the emulated TP2 server {run_id} (--fence {fence}): {len(result.loads)} staged layer-loads, "
             f"{seconds:.1f} s")
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


def _write_reports(run_id: str, report, reports: Path) -> dict:
    from moetrace.analysis import plot, render

    reports.mkdir(parents=True, exist_ok=True)
    paths = {"json": reports / f"{run_id}.json", "markdown": reports / f"{run_id}.md",
             "junit": reports / f"{run_id}.junit.xml", "plot": reports / f"{run_id}.png"}
    paths["json"].write_text(render.to_json(report))
    paths["markdown"].write_text(render.to_markdown(report))
    paths["junit"].write_text(render.to_junit(report))
    plot.plot(report, str(paths["plot"]))
    return {k: str(v) for k, v in paths.items()}


def run_demo(workdir: str | Path, device: str = "cpu", quick: bool = False,
             echo: Callable[[str], None] = print, transport: str = "auto") -> dict:
    workdir = Path(workdir)
    t0 = time.perf_counter()
    pair = run_pair(workdir, QUICK if quick else FULL, device, echo=echo, transport=transport)
    summary = {"workdir": str(workdir), "checkpoint": str(pair["checkpoint"]), "index": str(pair["index"]),
               "transport": pair["transport"], "staged_by": pair["staged_by"], "runs": {}}
    for run_id, run in pair["runs"].items():
        rep = run["report"]
        doc = rep.doc
        summary["runs"][run_id] = {
            "fence": run["fence"],
            "trace": str(pair["traces"] / run_id),
            "audit_exit_code": rep.exit_code,
            "totals": doc["totals"]["sentence"],
            "first_divergence": [f["sentence"] for f in doc["first_divergence"]],
            "summaries": [s["sentence"] for s in doc["summaries"]],
            "token0_max_abs_logit_delta_vs_reference": run["token0_max_abs_delta"],
            "tokens_equal_reference": run["tokens_equal_reference"],
            "guard": run["guard"],
            "guard_sentence": guard_sentence(run["guard"]),
            "reports": _write_reports(run_id, rep, workdir / "reports"),
        }
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    unf, fen = summary["runs"]["unfenced"], summary["runs"]["fenced"]
    summary["race_found"] = unf["audit_exit_code"] == 1 and any("(E+2)" in s for s in unf["first_divergence"])
    summary["fix_validated"] = fen["audit_exit_code"] == 0
    return summary


def print_demo(summary: dict, echo: Callable[[str], None] = print) -> None:
    unf, fen = summary["runs"]["unfenced"], summary["runs"]["fenced"]
    echo("")
    echo(f"staged loads: {summary['staged_by']}")
    echo("== unfenced (the fork as it is: rank 0 waits only for its own copy before refilling a slot)")
    for s in unf["first_divergence"]:
        echo(f"first divergence: {s}")
    for s in unf["summaries"][:4]:
        echo(f"  {s}")
    if len(unf["summaries"]) > 4:
        echo(f"  ... {len(unf['summaries']) - 4} more loads like these")
    echo(f"  {unf['totals']}")
    echo(f"  in-server guard: {unf['guard_sentence']}")
    echo(f"  token 0 vs reference: max |logit delta| {unf['token0_max_abs_logit_delta_vs_reference']:.3g}"
         f"{'' if unf['tokens_equal_reference'] else ', output tokens differ'}")
    echo("== fenced (every rank syncs its copy, then a collective fence, before a slot is reused)")
    echo(f"  {fen['totals']}")
    echo(f"  in-server guard: {fen['guard_sentence']}")
    echo(f"  token 0 vs reference: max |logit delta| {fen['token0_max_abs_logit_delta_vs_reference']:.3g}"
         f"{'' if fen['tokens_equal_reference'] else ', output tokens differ'}")
    echo("")
    race = "found" if summary["race_found"] else "NOT found"
    fix = "validated" if summary["fix_validated"] else "NOT validated"
    echo(f"race {race} unfenced; fix {fix} fenced ({summary['seconds']} s)")
    echo(f"plots:   {unf['reports']['plot']}  {fen['reports']['plot']}")
    echo(f"reports: {Path(unf['reports']['markdown']).parent}/ (json, md, junit per run); traces: "
         f"{Path(unf['trace']).parent}/")


# ------------------------------------------------------------------ selftest


def detector_proof(workdir: Path, device: str = "cpu", quick: bool = True) -> dict:
    """The detector proof of `moetrace selftest`: on this device, the unfenced
    transport must be caught as E+2 on rank 1's w2 scales, and the fenced one
    must pass with full coverage, on the same injected schedule."""
    pair = run_pair(Path(workdir) / "detector", QUICK if quick else FULL, device)
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
    caught = unf.exit_code == 1 and any(
        e["verdict"] == "stale" and e.get("k") == 2 and e["tp_rank"] == 1 and e["tensor"] == "w2_weight_scale_inv"
        for e in first
    )
    totals = fen.doc["totals"]
    clean = fen.exit_code == 0 and totals["missing"] == 0 and totals["divergent"] == 0 and totals["tensors"] > 0
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
