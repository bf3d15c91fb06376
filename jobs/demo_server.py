"""The demo's second act: one fault, named, inside the real SGLang server on this machine.

A complete tiny Qwen3-MoE (``make-checkpoint``'s writer, BF16: what SGLang's CPU engine
loads), its TP2 index, then ``audit --launch`` of ``python -m sglang.launch_server --device
cpu --tp 2`` with moetrace's fault hook registered before its capture hook: TP rank 1's
``w2_weight`` of experts 0 and 2 in layer 0 exchange their bytes (what the staging race
leaves, E+2), written through ``param.data`` as a weight loader writes. The act passes when
the audit names exactly that fault (jobs.selftest_server.judge_faults).

The server runs from the Python given (``--sglang-python``: a venv with SGLang 0.5.23's CPU
path, ``make sglang-venv``), with SGLang's CPU-engine settings and ``--server-pythonpath``
(on a CPU-only machine, the import stand-ins that ``make demo`` passes). Without that
Python the act is skipped in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import time
from pathlib import Path
from typing import Callable

from moetrace.errors import ExitCode, MoetraceError

# SGLang's CPU engine, one core per TP rank; TorchDynamo off (its one compile costs ~10 s)
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1", "TORCHDYNAMO_DISABLE": "1"}
CPU_FLAGS = ("--device cpu --tp 2 --host 127.0.0.1 --attention-backend torch_native --sampling-backend pytorch "
             "--disable-cuda-graph --max-total-tokens 4096 --max-running-requests 4 --chunked-prefill-size 512 "
             "--mem-fraction-static 0.5 --skip-server-warmup")
FAULT = {"fault": "swap", "rank": 1, "layer": 0, "tensor": "w2_weight", "experts": [0, 2], "at_forward": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing(sglang_python: str | None) -> str | None:
    """Why the second act cannot run here, or None."""
    if not sglang_python:
        return "no SGLang environment given (make demo passes --sglang-python .venv-sglang/bin/python)"
    if not os.access(sglang_python, os.X_OK):
        return f"{sglang_python} is not here (make sglang-venv builds it)"
    return None


@contextlib.contextmanager
def _server_env(sglang_python: str, server_pythonpath: str | None):
    """The launched server's environment: its venv first on PATH, SGLang's CPU settings."""
    saved = dict(os.environ)
    os.environ.update(CPU_ENV)
    os.environ["PATH"] = f"{Path(sglang_python).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if server_pythonpath:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (server_pythonpath, os.environ.get("PYTHONPATH")) if p)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_server_act(workdir: Path, sglang_python: str, server_pythonpath: str | None,
                   say: Callable[[str], None]) -> dict:
    """The act's summary: the fault, the audit's first divergence and summaries, ok. The
    server's own output goes to LOGS/server-act.log (workdir/logs, beside the first act's)."""
    from moetrace.analysis.render import grouped_summaries
    from moetrace.checkpoints.index_build import make_index
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint
    from moetrace.jobs.audit import AnalysisOptions, LaunchOptions, ReportFiles, run_audit
    from moetrace.jobs.selftest_server import fault_command, judge_faults
    from moetrace.jobs.traffic import Traffic

    t0 = time.perf_counter()
    act, logs = workdir / "server-act", workdir / "logs"
    model = write_synthetic_checkpoint(act / "model", family="qwen3_moe", fmt="bf16", num_files=1)
    index = act / "index.parquet"
    make_index(str(model), str(index), 2, use_cache=False)
    cmd = shlex.split(f"python -m sglang.launch_server --model-path {model} {CPU_FLAGS} --port {free_port()}")
    report = act / "fault.json"
    opts = AnalysisOptions(index=str(index), as_json=True, reports=ReportFiles(json_out=str(report)),
                           max_rows=100_000)
    log_path = logs / "server-act.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    error = None
    with _server_env(sglang_python, server_pythonpath), open(log_path, "w") as log:
        launch = LaunchOptions(command=shlex.join(fault_command(cmd, [FAULT])), out=str(act / "traces"),
                               run_id="server-fault", traffic=Traffic(requests=2, prompt_tokens=60, replays=1),
                               replace=True, server_log=log)
        try:
            code = run_audit(opts, launch, lambda m: None, say, warn=say)
        except MoetraceError as err:
            code, error = ExitCode.INCOMPLETE, str(err)
    doc = json.loads(report.read_text()) if report.exists() else None
    judged = judge_faults(doc if doc and doc.get("status") != "unusable" else None, [FAULT])
    return {"model": str(model), "trace": str(act / "traces" / "server-fault"), "report": str(report),
            "fault": FAULT, "audit_exit_code": int(code), "error": error, "ok": judged.ok is True,
            "detail": judged.detail if error is None else f"{judged.detail} ({error})",
            "first_divergence": [f["sentence"] for f in (doc or {}).get("first_divergence") or []],
            "summaries": [g["sentence"] for g in grouped_summaries(doc)] if doc else [], "log": str(log_path),
            "seconds": round(time.perf_counter() - t0, 1)}
