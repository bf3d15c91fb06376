"""Capture overhead in the real vLLM server: request latency with moetrace's plugin against
the same server without it, both in eager mode (--enforce-eager), in one run, as a user
runs them (processes; nothing imported from vLLM here).

Each round starts, in turn, the plain server (``python -m vllm.entrypoints.openai.api_server
... --enforce-eager``) and the traced one (``moetrace launch --out TMP -- python -m vllm...``:
the plugin captures every MoE layer at the load boundary and after every forward, the
default hook config), waits for /health, sends --warmup requests, then --requests timed
ones (one at a time, /v1/completions, temperature 0, --max-tokens tokens), and stops it
(SIGTERM to its process group; launch closes the traces first). Prints the median latency
of each and their ratio (target: traced <= 1.1x plain), per round and over all rounds, with
the CPU model and the load average (the machine may be shared: compare runs at low load),
and the CPU time the server's processes spent per timed request (user + system from /proc,
which the machine's other load barely moves) and its ratio.

    python bench/bench_vllm.py                          # the tests' tiny Qwen3-MoE, TP2
    python bench/bench_vllm.py --model M --rounds 3     # a checkpoint of yours
    python bench/bench_vllm.py --venv /path/to/venv     # where vLLM and moetrace are installed

Needs the vLLM venv (make vllm-venv) and, for the default model, transformers here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from moetrace.jobs.timing import cpu_description, median
from moetrace.jobs.traffic import prompt

ROOT = Path(__file__).resolve().parents[1]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
FLAGS = ["--tensor-parallel-size", "2", "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "1024", "--host", "127.0.0.1"]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                ppid = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    return kids


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) the live processes under `root` have used: the server's
    API process, engine core and workers (a measure the machine's other load barely moves)."""
    kids, todo, total = _children(), [root], 0
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, i: int, max_tokens: int) -> float:
    body = json.dumps({"prompt": prompt(i, 16), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(f"{url}/v1/completions", data=body.encode(), headers=headers)
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()
    return time.perf_counter() - t0


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before {url}/health answered")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/health did not answer within {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to the whole group (the launcher first closes the traces), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def serve(kind: str, venv: Path, model: str, out: Path, tag: str, args) -> dict:
    port = free_port()
    server = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model, *FLAGS,
              "--port", str(port)]
    cmd = server + ["--enforce-eager"] if kind == "eager" else \
        [str(venv / "bin" / "moetrace"), "launch", "--out", str(out), "--run-id", tag, "--", *server]
    env = {**os.environ, **ENV, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MOETRACE_VLLM_CONFIG", None)
    return measure(cmd, env, port, out, tag, args, traced=kind == "traced")


def measure(cmd: list[str], env: dict, port: int, out: Path, tag: str, args, traced: bool) -> dict:
    """Start `cmd` (a server, or `moetrace launch -- server`), wait for /health, send the
    warm-up then the timed requests, stop it; latencies, the server's CPU time per request,
    and (traced) what its trace says."""
    url = f"http://127.0.0.1:{port}"
    with open(out / f"{tag}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            healthy = wait_healthy(url, proc)
            for i in range(args.warmup):
                request(url, 10_000 + i, args.max_tokens)
            cpu0 = tree_cpu_s(proc.pid)
            lat = [request(url, i, args.max_tokens) for i in range(args.requests)]
            cpu = tree_cpu_s(proc.pid) - cpu0
        finally:
            stop(proc)
    res = {"healthy_s": round(healthy, 1), "median_ms": round(1000 * median(lat), 2),
           "cpu_ms_per_request": round(1000 * cpu / args.requests, 1),
           "latencies_ms": [round(1000 * x, 2) for x in lat]}
    if traced:
        run = json.loads((out / tag / "_run.json").read_text())
        res.update(complete=run["complete"], rows=sum(int(r.get("rows_written") or 0) for r in run["ranks"]),
                   problems=run["problems"])
    return res


def summarize(rounds: list[dict], base: str, load: list[float], model: str, args) -> dict:
    """The rounds' latencies and CPU per request, `base` (the server without moetrace's hook)
    against "traced", medians over every request and the ratios."""
    kinds = (base, "traced")
    all_lat = {k: [x for rd in rounds for x in rd[k]["latencies_ms"]] for k in kinds}
    doc = {
        "cpu": cpu_description(), "load_average_1min": [round(x, 2) for x in load], "model": model,
        "requests": args.requests, "max_tokens": args.max_tokens,
        "per_round": [{f"{base}_ms": rd[base]["median_ms"], "traced_ms": rd["traced"]["median_ms"],
                       "ratio": round(rd["traced"]["median_ms"] / rd[base]["median_ms"], 3),
                       "cpu_ms_per_request": [rd[k]["cpu_ms_per_request"] for k in kinds],
                       "traced_complete": rd["traced"]["complete"], "traced_rows": rd["traced"]["rows"],
                       "healthy_s": [rd[k]["healthy_s"] for k in kinds]} for rd in rounds],
        f"{base}_median_ms": round(median(all_lat[base]), 2),
        "traced_median_ms": round(median(all_lat["traced"]), 2),
    }
    doc["ratio"] = round(doc["traced_median_ms"] / doc[f"{base}_median_ms"], 3)
    cpu = {k: sum(rd[k]["cpu_ms_per_request"] for rd in rounds) / len(rounds) for k in kinds}
    doc["cpu_ms_per_request"] = {k: round(v, 1) for k, v in cpu.items()}
    doc["cpu_ratio"] = round(cpu["traced"] / cpu[base], 3)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--model", default=None, help="default: the tests' tiny Qwen3-MoE, written to a temp folder")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    venv = Path(args.venv)
    with tempfile.TemporaryDirectory(prefix="moetrace-bench-vllm-") as tmp:
        out = Path(tmp)
        model = args.model
        if model is None:
            sys.path.insert(0, str(ROOT / "tests"))
            from support.vllm_model import write_model

            model = str(write_model(out / "model"))
        load = [os.getloadavg()[0]]
        rounds = []
        for r in range(args.rounds):
            rounds.append({kind: serve(kind, venv, model, out, f"{kind}-{r}", args) for kind in ("eager", "traced")})
            load.append(os.getloadavg()[0])
        doc = summarize(rounds, "eager", load, model if args.model else "tests' tiny Qwen3-MoE (support.vllm_model)",
                        args)
        doc["target"] = "traced <= 1.1x eager"
        print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
