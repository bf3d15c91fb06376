"""Runs that happen once per test session, whichever pytest-xdist worker asks first.

Jobs (the demo pair, the GPU script's dry run, conform's cases, the real vLLM and SGLang servers,
one server at a time) are commands started in the background as
soon as collection shows that a selected test needs one, so they run beside the cheap
tests instead of holding a worker; their fixtures wait for the result. ``once`` runs a
function in the asking process under a file lock, for module-scoped servers.

    python -m support.session_jobs NAME FOLDER RESULT   (what start() runs)

A job writes RESULT (JSON) whole when it is done: a file that exists is a finished job.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]  # the repository (the moetrace package)


def _demo(folder: Path) -> dict:
    """`moetrace demo --quick --json`: the emulated unfenced/fenced pair on one injected schedule."""
    before = sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []
    proc = subprocess.run([sys.executable, "-m", "moetrace.cli", "demo", "--quick", "--json", "--workdir", str(folder)],
                          capture_output=True, text=True, timeout=600)
    summary = json.loads(proc.stdout) if proc.returncode in (0, 1) and proc.stdout.strip() else None
    return {"returncode": proc.returncode, "summary": summary, "workdir": str(folder), "stderr": proc.stderr,
            "shm_before": before}


def _gpu_dry_run(folder: Path) -> dict:
    """`bash bench/gpu_selftest.sh` with DRY_RUN=1 QUICK=1; its selftest step without the
    detector, whose pair is the demo's (tests/test_selftest.py)."""
    env = dict(os.environ, DRY_RUN="1", QUICK="1", PYTHON=sys.executable, SELFTEST_ONLY="fingerprint,throughput")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_selftest.sh"), str(folder)], capture_output=True,
                          text=True, timeout=900, env=env)
    return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "out": str(folder)}


def _conform(folder: Path) -> dict:
    """Every real `moetrace conform` case of tests/test_conform.py (its run_cases)."""
    from test_conform import run_cases

    return run_cases(folder)


def _vllm(folder: Path) -> dict:
    """The real vLLM CPU server at TP2, one `moetrace audit --launch` per configuration
    (support.vllm_server)."""
    from support.vllm_server import run_all

    return run_all(folder)


def _sglang(folder: Path) -> dict:
    """The real SGLang CPU server at TP2: selftest --server, a launch across a weight update,
    a killed rank (support.sglang_server)."""
    from support.sglang_server import run_all

    return run_all(folder)


JOBS: dict[str, Callable[[Path], dict]] = {"demo": _demo, "gpu-dry-run": _gpu_dry_run, "conform": _conform,
                                           "vllm": _vllm, "sglang": _sglang}
# The real servers each bind one core per TP rank: one at a time, so neither starves the other
# (side by side, a whole suite took the same 758-776 s on a 2-core EPYC, each launch slower).
SERVER_JOBS = ("vllm", "sglang")


def _paths(root: Path, name: str) -> tuple[Path, Path, Path]:
    return root / name, root / f"{name}.json", root / f"{name}.started"


def start(root: Path, name: str) -> None:
    """Start job ``name`` under ``root`` unless some process of this session already did."""
    folder, result, started = _paths(root, name)
    with open(root / "session-jobs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if started.exists():
            return
        folder.mkdir(exist_ok=True)
        with open(root / f"{name}.log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "support.session_jobs", name, str(folder), str(result)],
                                    stdout=log, stderr=subprocess.STDOUT, cwd=str(Path(__file__).parents[1]))
        started.write_text(str(proc.pid))


def result(root: Path, name: str, timeout: float = 1800.0) -> dict:
    """Job ``name``'s result, waiting for it (started here if nobody did)."""
    start(root, name)
    _, done, started = _paths(root, name)
    pid = int(started.read_text())
    deadline = time.monotonic() + timeout
    while not done.exists():
        if not _alive(pid) and not done.exists():
            log = (root / f"{name}.log").read_text()[-3000:]
            raise RuntimeError(f"session job {name} (pid {pid}) ended without a result:\n{log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"session job {name} (pid {pid}) did not finish within {timeout:g} s")
        time.sleep(0.1)
    return json.loads(done.read_text())


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # our own child: reap it once it exited
        return waited == 0
    except ChildProcessError:  # another worker's child: alive unless gone or a zombie
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state != "Z"


def once(root: Path, name: str, make: Callable[[Path], dict]) -> dict:
    """make(folder) -> JSON-able dict, run once under ``root``: the first caller runs it
    under a file lock, the others read its result."""
    done = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder = root / name
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(make(folder)))
    return json.loads(done.read_text())


def main(name: str, folder: str, result_path: str) -> None:
    if name in SERVER_JOBS:
        with open(Path(folder).parent / "real-servers.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            doc = JOBS[name](Path(folder))
    else:
        doc = JOBS[name](Path(folder))
    tmp = Path(result_path + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, result_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
