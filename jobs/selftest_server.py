"""`moetrace selftest --server CMD`: prove the detector inside the user's own server.

Two launches of CMD through the audit job (jobs.audit), each with the same traffic:

1. with moetrace's fault hook (hooks.faults) registered before the capture hook: the
   planned faults (``plan_faults``: two experts swapped on one rank, a scale (or, without
   scale tensors, a weight) zeroed, another rank's shard, and a late swap written through
   ``param.data`` after some forwards) must be named by the audit, exactly: every divergent
   row is one a fault explains, with the verdict it explains, and every row a fault
   explains is divergent;
2. clean: the audit must pass with full coverage.

Exit 0 only when both hold; 1 when a fault was missed or misnamed, something else
diverged, or the clean run diverged; 2 when a run could not be judged (the server did
not serve, the trace is incomplete, the reference does not fit).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.shards import Parallel, local_experts, rank_coords, tensor_names
from moetrace.errors import ExitCode, MoetraceError
from moetrace.servers.command import build_command, expected_tp, flag_value, model_path_of_command
from moetrace.servers.vllm_command import invokes_vllm

FAULT_HOOK = "moetrace.hooks.faults:make_fault_hook"
EP_FLAGS = ("--ep", "--ep-size", "--expert-parallel-size")
LATE_FORWARD = 2  # the late swap lands after this many clean captured forwards of its layer


@dataclass
class RunResult:
    """One launch: its audit exit code and report (None when the audit could not run)."""

    name: str
    code: int
    report: dict | None
    error: str | None = None
    run_dir: str | None = None


@dataclass
class Judgement:
    ok: bool | None  # None: could not be judged
    detail: str
    missed: list = field(default_factory=list)  # rows a fault explains that did not diverge as it should
    unexplained: list = field(default_factory=list)  # divergent rows no fault explains


def checkpoint_of(cmd: list[str], checkpoint: str | None) -> str:
    path = checkpoint or model_path_of_command(cmd)
    if not path:
        raise MoetraceError("selftest --server: the command names no model folder; give --checkpoint CKPT")
    return path


def plan_faults(checkpoint: str, tp_size: int, ep_size: int = 1, other_rank: bool = True) -> list[dict]:
    """The faults of the proof, placed on distinct (rank, layer, tensor, expert) of this
    model: refused by name when the model is too small to hold them apart."""
    with open_checkpoint(checkpoint) as ckpt:
        spec = ckpt.spec
    par = Parallel(tp_size, ep_size)
    if tp_size % ep_size:
        raise MoetraceError(f"selftest --server: --tp {tp_size} is not divisible by --ep {ep_size}")
    layers = list(spec.moe_layers)
    if not layers:
        raise MoetraceError(f"selftest --server: {checkpoint} has no MoE layer")
    names = tensor_names(spec)
    last = tp_size - 1
    held = {r: list(local_experts(spec, par, rank_coords(r, par)[1])) for r in (0, last)}
    if min(len(v) for v in held.values()) < 4:
        raise MoetraceError(f"selftest --server: each rank must hold at least 4 experts of a layer to keep the faults "
                            f"apart ({spec.num_experts} experts over --ep {ep_size})")
    first, final = layers[0], layers[-1]
    scale = next((n for n in names if n.startswith("w2_") and n != "w2_weight"), None)
    e0, e1 = held[0], held[last]
    faults = [
        {"fault": "swap", "rank": last, "layer": first, "tensor": "w2_weight", "experts": [e1[0], e1[2]],
         "at_forward": 0},
        {"fault": "zero", "rank": 0, "layer": first, "tensor": scale or "w13_weight", "experts": [e0[1]],
         "at_forward": 0},
        {"fault": "swap", "rank": last, "layer": final, "tensor": "w13_weight", "experts": [e1[1], e1[3]],
         "at_forward": LATE_FORWARD},
    ]
    coords = {r: rank_coords(r, par) for r in range(tp_size)}
    peer = next((r for r in range(tp_size) if coords[r][1] == coords[0][1] and coords[r][0] != coords[0][0]), None)
    if peer is not None and other_rank:  # another MoE TP rank holds other shards of the same experts
        faults.append({"fault": "other_rank", "rank": 0, "layer": final, "tensor": "w13_weight", "experts": [e0[3]],
                       "from_moe_tp_rank": coords[peer][0], "checkpoint": str(checkpoint), "at_forward": 0})
    return faults


def fault_command(cmd: list[str], faults: list[dict]) -> list[str]:
    """cmd with the fault hook in its --forward-hooks (moetrace's capture hook goes after it)."""
    spec = [{"name": "moetrace-faults", "target_modules": ["model.layers.*.mlp.experts",
                                                           "model.language_model.layers.*.mlp.experts"],
             "hook_factory": FAULT_HOOK, "config": {"faults": faults}}]
    return build_command(cmd, spec, [])


def explained(faults: list[dict], steps: dict[tuple[str, int], list[int]]) -> dict[tuple, tuple]:
    """(rank, layer, tensor, expert, step) -> (verdict, k or the found moe_tp_rank) of every
    row a fault changes. steps: the resident steps captured per (rank label, layer)."""
    out = {}
    for f in faults:
        if f["fault"] == "kill":
            continue
        rank, layer = str(f["rank"]), int(f["layer"])
        hit = sorted(steps.get((rank, layer), []))[int(f["at_forward"]):]
        if f["fault"] == "swap":
            a, b = f["experts"]
            what = {a: ("stale", b - a), b: ("stale", a - b)}
        elif f["fault"] == "zero":
            what = {f["experts"][0]: ("zeros", 0)}
        else:
            what = {f["experts"][0]: ("wrong_rank", int(f["from_moe_tp_rank"]))}
        for step in hit:
            for expert, verdict in what.items():
                out[(rank, layer, f["tensor"], int(expert), step)] = verdict
    return out


def judge_faults(report: dict | None, faults: list[dict]) -> Judgement:
    """Whether the fault run's audit names exactly the planned faults."""
    if report is None:
        return Judgement(None, "the fault run's audit wrote no report")
    if report.get("incomplete"):
        return Judgement(None, "the fault run is incomplete: " + "; ".join(report["incomplete"])[:500])
    if report.get("divergent_rows_truncated"):
        return Judgement(None, "the fault run's report lists only part of its divergent rows")
    steps: dict[tuple[str, int], list[int]] = {}
    for load in report.get("loads") or []:
        if load.get("source") == "resident" and load.get("model", "target") == "target":
            steps.setdefault((str(load["rank"]), int(load["layer"])), []).append(int(load["step"]))
    want = explained(faults, steps)
    got = {}
    for r in report.get("divergent_rows") or []:
        key = (str(r["rank"]), int(r["layer"]), r["tensor"], int(r["expert"]), int(r["step"]))
        how = (r.get("found") or {}).get("moe_tp_rank") if r["verdict"] == "wrong_rank" else r.get("k") or 0
        got[key] = (r["verdict"], how)
    missed = sorted(k for k, v in want.items() if got.get(k) != v)
    unexplained = sorted(k for k in got if k not in want)
    if not want:
        return Judgement(None, "no captured step was reached by a fault (too little traffic?)")
    if missed or unexplained:
        detail = f"{len(missed)} faulty rows not named as planned, {len(unexplained)} divergent rows no fault explains"
        return Judgement(False, detail, [list(k) for k in missed[:20]], [list(k) for k in unexplained[:20]])
    kinds = ", ".join(sorted({f["fault"] for f in faults}))
    return Judgement(True, f"every planned fault named exactly ({kinds}: {len(want):,} rows), nothing else divergent")


def judge_clean(run: RunResult) -> Judgement:
    if run.report is None or run.code == ExitCode.INCOMPLETE:
        why = run.error or "; ".join((run.report or {}).get("incomplete") or []) or "incomplete"
        return Judgement(None, f"the clean run could not be judged: {why}"[:500])
    if run.code == ExitCode.DIVERGENT:
        first = (run.report.get("first_divergence") or [{}])[0].get("sentence", "")
        return Judgement(False, f"the clean run diverged: {first}")
    totals = run.report.get("totals") or {}
    return Judgement(True, f"the clean run passed: {totals.get('sentence', '')}")


def verdict(fault: Judgement, clean: Judgement) -> ExitCode:
    if fault.ok is False or clean.ok is False:
        return ExitCode.DIVERGENT
    if fault.ok is None or clean.ok is None:
        return ExitCode.INCOMPLETE
    return ExitCode.PASS


def run_server_selftest(command: str, workdir: Path, index: str | None, checkpoint: str | None, traffic,
                        launch_options: dict, say: Callable[[str], None]) -> tuple[ExitCode, dict]:
    """The two launches and their judgement: (exit code, the JSON document). SGLang gets the
    fault hook in its --forward-hooks; vLLM through $MOETRACE_FAULTS, which moetrace's plugin
    reads (no other rank's shard there: its kernel repacks what it holds)."""
    from moetrace.hooks.faults import FAULTS_ENV
    from moetrace.jobs.audit import AnalysisOptions, LaunchOptions, ReportFiles, run_audit

    cmd = shlex.split(command)
    ckpt = checkpoint_of(cmd, checkpoint)
    tp = expected_tp(cmd) or 1
    ep_raw = flag_value(cmd, EP_FLAGS)
    vllm = invokes_vllm(cmd)
    faults = plan_faults(ckpt, tp, int(ep_raw) if ep_raw and ep_raw.isdigit() else 1, other_rank=not vllm)
    runs = {}
    for name, launch_cmd in (("fault", cmd if vllm else fault_command(cmd, faults)), ("clean", cmd)):
        say(f"selftest --server: {name} run" + (f" ({len(faults)} faults)" if name == "fault" else ""))
        report_path = workdir / f"{name}.json"
        opts = AnalysisOptions(index=index, checkpoint=None if index else ckpt, as_json=True,
                               reports=ReportFiles(json_out=str(report_path)), max_rows=1_000_000)
        launch = LaunchOptions(command=shlex.join(launch_cmd), out=str(workdir / "traces"), run_id=f"selftest-{name}",
                               traffic=traffic, replace=True, **launch_options)
        env = {FAULTS_ENV: json.dumps(faults)} if vllm and name == "fault" else {}
        with _environment(env):
            try:
                code, error = run_audit(opts, launch, lambda m: None, say, warn=say), None
            except MoetraceError as err:
                code, error = ExitCode.INCOMPLETE, str(err)
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        if report is not None and report.get("status") == "unusable":
            report = None
        runs[name] = RunResult(name, int(code), report, error, str(workdir / "traces" / f"selftest-{name}"))
    fault, clean = judge_faults(runs["fault"].report, faults), judge_clean(runs["clean"])
    if runs["fault"].report is None and runs["fault"].error:
        fault.detail += f" ({runs['fault'].error})"[:500]
    code = verdict(fault, clean)
    doc = {"command": command, "checkpoint": ckpt, "server": "vllm" if vllm else "sglang", "faults": faults,
           "verdict": int(code), "words": code.words,
           "fault_run": {"audit_exit_code": runs["fault"].code, "ok": fault.ok, "detail": fault.detail,
                         "missed": fault.missed, "unexplained": fault.unexplained, "run_dir": runs["fault"].run_dir,
                         "report": str(workdir / "fault.json")},
           "clean_run": {"audit_exit_code": runs["clean"].code, "ok": clean.ok, "detail": clean.detail,
                         "run_dir": runs["clean"].run_dir, "report": str(workdir / "clean.json")}}
    return code, doc


@contextlib.contextmanager
def _environment(extra: dict):
    """os.environ with `extra` for the launch (the server inherits it), then as it was."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
