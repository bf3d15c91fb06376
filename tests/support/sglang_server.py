"""The real SGLang 0.5.23 server on CPU at TP2, run as a user runs moetrace against it (tests only).

Its environment is the venv ``make test`` builds beside .venv (``.venv-sglang`` from
requirements-sglang.txt, SGLang 0.5.23 and moetrace installed into it; elsewhere:
``$MOETRACE_SGLANG_VENV``), plus the two import stand-ins of tests/support/sglang_cpu/ on
the server's PYTHONPATH (read its README.md). The session job ``sglang``
(support.session_jobs) writes tiny complete models (support.vllm_model: transformers' own
classes, a tokenizer trained here), builds their TP2 indexes (moetrace's builder), then
runs one server per configuration, one after the other:

- ``selftest``: ``moetrace selftest --server CMD``: a launch with moetrace's faults
  (two experts swapped, a weight zeroed, another rank's shard, a late swap through
  ``param.data``) that the audit must name exactly, then a clean launch that must pass;
- ``update``: ``moetrace launch`` of a Qwen3.5-MoE (make-checkpoint's) with the guard and SGLang's
  ``--enable-metrics``: traffic,
  ``/metrics`` scraped in the text and OpenMetrics formats, ``/update_weights_from_disk`` to
  a second checkpoint, traffic again, then SIGTERM to ``launch``: every rank closes its
  trace; the trace is audited against each checkpoint's index;
- ``killed``: ``audit --launch`` whose TP rank 1 is killed (SIGKILL) after a few forwards.

Without the venv the job records why, and the tests fail when
``MOETRACE_REQUIRE_SGLANG_SERVER=1`` (make test sets it), else skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from support.real_servers import ROOT, ServerVenv, free_port

TESTS = ROOT / "tests"
STANDINS = TESTS / "support" / "sglang_cpu"
REQUIRE_ENV = "MOETRACE_REQUIRE_SGLANG_SERVER"
VENV_ENV = "MOETRACE_SGLANG_VENV"
# SGLang's CPU engine, one core per TP rank; TORCHDYNAMO_DISABLE: the scheduler's one
# torch.compile (vocab_parallel_embedding) costs ~10 s and once produced AVX-512 code on an
# AVX-512 host capped at AVX2 (docs/capture.md, "Tested against the real server").
SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1", "TORCHDYNAMO_DISABLE": "1"}
SERVER_FLAGS = ["--device", "cpu", "--tp", "2", "--host", "127.0.0.1", "--attention-backend", "torch_native",
                "--sampling-backend", "pytorch", "--disable-cuda-graph", "--max-total-tokens", "4096",
                "--max-running-requests", "4", "--chunked-prefill-size", "512", "--mem-fraction-static", "0.5",
                "--skip-server-warmup"]
# moe_intermediate_size 48: I_tp 24, which SGLang's CPU FusedMoE pads to 32 (the padded
# layout is exercised).
PADDED = dict(intermediate=48)
TRAFFIC = ["--requests", "2", "--prompt-tokens", "60", "--replays", "1", "--ready-timeout", "600"]
KILL_AFTER = 3  # forwards of layer 0 on TP rank 1 before it is killed
# The update run serves Qwen3.5-MoE (the mission's family: Qwen3_5MoeForConditionalGeneration,
# experts under model.language_model, Gated DeltaNet layers): its hybrid cache needs the radix
# cache off on this path, and its CPU ops are the test stand-ins of tests/support/sglang_cpu.
QWEN35 = dict(family="qwen3_5_moe", fmt="bf16", num_files=1)
QWEN35_FLAGS = ("--disable-radix-cache",)


SERVER = ServerVenv(".venv-sglang", VENV_ENV, REQUIRE_ENV, "sglang-venv")


def venv() -> Path:
    return SERVER.path()


def missing() -> str | None:
    """Why the environment cannot run here, or None."""
    return SERVER.missing()


def require(result: dict) -> dict:
    return SERVER.require(result)


def env(**more) -> dict:
    """The server's environment: its venv first on PATH, the stand-ins and tests/ importable."""
    path = [str(STANDINS), str(TESTS)]
    return {**os.environ, **SERVER_ENV, **more, "PATH": f"{venv() / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(path + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                  if p and p not in path])}


def server_command(model: Path, port: int, *extra: str) -> list[str]:
    return ["python", "-m", "sglang.launch_server", "--model-path", str(model), *SERVER_FLAGS, "--port", str(port),
            *extra]


def _moetrace(*args: str, timeout: float = 900, **more) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv() / "bin" / "moetrace"), *args], capture_output=True, text=True, timeout=timeout,
                          env=env(**more), stdin=subprocess.DEVNULL, cwd=str(TESTS))


def _result(proc: subprocess.CompletedProcess, t0: float, **more) -> dict:
    return {"returncode": proc.returncode, "seconds": round(time.monotonic() - t0, 1), "stdout": proc.stdout[-20000:],
            "stderr": proc.stderr[-20000:], **more,
            # moetrace's own lines (the server's output, on stderr too, would push them out of the tail)
            "moetrace_lines": [line for line in proc.stderr.splitlines() if line.startswith("moetrace")]}


def selftest(folder: Path, model: Path, index: Path) -> dict:
    """`moetrace selftest --server CMD` against the real server, as a user runs it."""
    t0 = time.monotonic()
    cmd = " ".join(server_command(model, free_port()))
    proc = _moetrace("selftest", "--server", cmd, "--index", str(index), "--workdir", str(folder / "selftest"),
                     "--requests", "2", "--prompt-tokens", "60", "--replays", "1", "--json")
    doc = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None
    return _result(proc, t0, doc=doc)


def killed(folder: Path, model: Path, index: Path) -> dict:
    """`audit --launch` whose TP rank 1 dies by SIGKILL after KILL_AFTER forwards."""
    t0 = time.monotonic()
    faults = [{"name": "kill", "target_modules": ["model.layers.*.mlp.experts"],
               "hook_factory": "moetrace.hooks.faults:make_fault_hook",
               "config": {"faults": [{"fault": "kill", "rank": 1, "at_forward": KILL_AFTER}]}}]
    cmd = server_command(model, free_port(), "--forward-hooks", json.dumps(faults))
    report = folder / "killed.json"
    proc = _moetrace("audit", "--launch", " ".join(_quote(a) for a in cmd), "--index", str(index), "--out",
                     str(folder / "traces"), "--run-id", "killed", *TRAFFIC, "--json-out", str(report))
    return _result(proc, t0, report=json.loads(report.read_text()) if report.exists() else None,
                   run_dir=str(folder / "traces" / "killed"))


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _http(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def _wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"moetrace launch exited with {proc.returncode} before the server was healthy")
        try:
            if _http(base + "/health", timeout=5)[0] == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base} not healthy after {timeout} s")


def _complete(base: str, i: int) -> int:
    from moetrace.jobs.traffic import prompt

    return _http(base + "/v1/completions", {"prompt": prompt(i, 40), "max_tokens": 4, "temperature": 0})[0]


def update(folder: Path, model_a: Path, model_b: Path, index_a: Path, updates: Path) -> dict:
    """`moetrace launch` with the guard and --enable-metrics; traffic, /metrics in both
    formats, /update_weights_from_disk to model B, traffic, /metrics, then SIGTERM."""
    t0 = time.monotonic()
    port = free_port()
    cmd = [str(venv() / "bin" / "moetrace"), "launch", "--out", str(folder / "traces"), "--run-id", "update",
           "--index", str(index_a), "--guard", "record", "--guard-rows", "all", "--update-index-dir", str(updates),
           "--", *server_command(model_a, port, "--enable-metrics", *QWEN35_FLAGS)]
    log = open(folder / "update.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), stdin=subprocess.DEVNULL,
                            cwd=str(TESTS))
    base = f"http://127.0.0.1:{port}"
    out: dict = {"steps": []}
    try:
        out["seconds_to_healthy"] = round(_wait_healthy(base, proc), 1)
        out["before"] = [_complete(base, i) for i in range(2)]
        out["metrics_text"] = _http(base + "/metrics", headers={"Accept": "text/plain"})[1]
        out["metrics_openmetrics"] = _http(
            base + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"})[1]
        out["update"] = _http(base + "/update_weights_from_disk", {"model_path": str(model_b)})
        out["after"] = [_complete(base, i) for i in range(2, 4)]
        out["metrics_after"] = _http(base + "/metrics", headers={"Accept": "text/plain"})[1]
    except Exception as err:  # recorded; the tests say what is missing
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out["launch_exit"] = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out["launch_exit"] = proc.wait()
        log.close()
    out["log"] = (folder / "update.log").read_text()[-20000:]
    out["run_dir"] = str(folder / "traces" / "update")
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def audit_trace(run_dir: str, index: Path, name: str, folder: Path) -> dict:
    """`moetrace audit RUN --index I` of a finished trace (in .venv: no server)."""
    report = folder / f"{name}.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "moetrace.cli", "audit", run_dir, "--index", str(index),
                           "--json-out", str(report)], capture_output=True, text=True, timeout=600)
    return _result(proc, t0, report=json.loads(report.read_text()) if report.exists() else None)


def run_all(folder: Path) -> dict:
    """The session job: the models, their indexes, then every configuration in turn."""
    why = missing()
    if why:
        return {"missing": why}
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint
    from support.traces import CheckpointModel
    from support.vllm_model import write_model

    t0 = time.monotonic()
    padded = write_model(folder / "model-padded", "sglang-padded", **PADDED)
    model_a = write_synthetic_checkpoint(folder / "model-a", seed=1, **QWEN35)
    model_b = write_synthetic_checkpoint(folder / "model-b", seed=2, **QWEN35)
    indexes = {}
    updates = folder / "update-indexes"
    updates.mkdir()
    for name, model, path in (("padded", padded, folder / "index-padded.parquet"),
                              ("a", model_a, folder / "index-a.parquet"), ("b", model_b, updates / "index-b.parquet")):
        CheckpointModel(model, tp_size=2).write_index(str(path))  # moetrace index's own builder, in this process
        indexes[name] = str(path)
    out = {"models": {"padded": str(padded), "a": str(model_a), "b": str(model_b)}, "indexes": indexes, "runs": {}}
    out["runs"]["selftest"] = selftest(folder, padded, Path(indexes["padded"]))
    out["runs"]["update"] = upd = update(folder, model_a, model_b, Path(indexes["a"]), updates)
    out["runs"]["audit_a"] = audit_trace(upd["run_dir"], Path(indexes["a"]), "audit-a", folder)
    out["runs"]["audit_b"] = audit_trace(upd["run_dir"], Path(indexes["b"]), "audit-b", folder)
    out["runs"]["killed"] = killed(folder, padded, Path(indexes["padded"]))
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["leftover"] = leftover_processes(folder)
    return out


def leftover_processes(folder: Path) -> list[int]:
    """Processes still alive in the session of any server the runs started."""
    from moetrace.servers.process_group import session_members

    left = []
    for run_file in folder.rglob("_run.json"):
        try:
            pid = json.loads(run_file.read_text())["server_pid"]
        except (OSError, KeyError, ValueError):
            continue
        left += session_members(int(pid)) if pid else []
    return left


if __name__ == "__main__":  # by hand: python -m support.sglang_server FOLDER (from tests/): FOLDER/result.json
    doc = run_all(Path(sys.argv[1]))
    (Path(sys.argv[1]) / "result.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1)[:3000])
