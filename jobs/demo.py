"""`moetrace demo`: the whole pipeline on an emulated TP2 KT staging server (jobs.pair).

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

import json
import time
from pathlib import Path
from typing import Callable

from moetrace.analysis.sentences import guard_sentence
from moetrace.errors import ExitCode
from moetrace.jobs.pair import FULL, QUICK, fresh_workdir, run_pair
from moetrace.jobs.progress import Progress


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
             progress: Progress | None = None, sglang_python: str | None = None,
             server_pythonpath: str | None = None) -> dict:
    from moetrace.analysis.plot import missing_plotter

    workdir = Path(workdir)
    progress = progress or Progress.off()
    t0 = time.perf_counter()
    # what the run needs, before it starts: without matplotlib the plots are skipped, said once
    no_plot = missing_plotter()
    with fresh_workdir(workdir):
        summary = _run_demo(workdir, device, quick, transport, progress, no_plot, t0)
        summary["server_act"] = _server_act(workdir, sglang_python, server_pythonpath, progress)
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        return summary


def _server_act(workdir: Path, sglang_python: str | None, server_pythonpath: str | None, progress: Progress) -> dict:
    """The second act (jobs.demo_server), or why it was skipped."""
    from moetrace.jobs import demo_server

    why = demo_server.missing(sglang_python)
    if why is not None:
        return {"skipped": why}
    with progress.step("second act: the real SGLang server on this CPU, one fault injected"):
        return demo_server.run_server_act(workdir, sglang_python, server_pythonpath, lambda m: None)


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
    summary["race_found"] = (unf["audit_exit_code"] == ExitCode.DIVERGENT
                             and any("(E+2)" in s for s in unf["first_divergence"]))
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
    act = summary.get("server_act") or {}
    if act.get("skipped"):
        echo(f"second act (the real SGLang server) skipped: {act['skipped']}")
    elif act:
        echo(f"== second act: the real SGLang server on this CPU (TP2), TP rank 1's w2_weight of experts 0 and 2 "
             f"swapped through param.data before moetrace reads it ({act['seconds']} s)")
        for s in act["first_divergence"][:1]:
            echo(f"first divergence: {s}")
        for s in act["summaries"][:2]:
            echo(f"  {s}")
        echo(f"  {'named exactly' if act['ok'] else 'NOT named as injected'}: {act['detail']}")
        echo(f"  trace: {act['trace']}; the server's own output: {act['log']}")
    race = "found" if summary["race_found"] else "NOT found"
    fix = "validated" if summary["fix_validated"] else "NOT validated"
    named = "" if not act or act.get("skipped") else (
        "; fault named in the real server" if act["ok"] else "; fault NOT named in the real server")
    echo(f"race {race} unfenced; fix {fix} fenced{named} ({summary['seconds']} s)")


def to_json(summary: dict) -> str:
    return json.dumps(summary, indent=2, default=str)
