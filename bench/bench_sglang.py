"""Capture overhead in the real SGLang server: request latency with moetrace's forward hooks
against the same server without them, in one run, as a user runs them (processes; nothing
imported from SGLang here).

SGLang 0.5.23's CPU engine at TP2 (`python -m sglang.launch_server --device cpu --tp 2`,
torch-native paths; the import stand-ins of tests/support/sglang_cpu on its PYTHONPATH,
as the tests run it). Each round starts, in turn, the plain server and the traced one
(``moetrace launch --out TMP -- python -m sglang.launch_server ...``: the default hook
config, every MoE layer's resident experts read and fingerprinted after every forward),
waits for /health, sends --warmup requests, then --requests timed ones (one at a time,
/v1/completions, temperature 0, --max-tokens tokens), and stops it (SIGTERM to its process
group; launch closes the traces first). Prints the median latency of each and their ratio,
per round and over all rounds, the CPU time the server's processes spent per request
(user + system from /proc, which the machine's other load barely moves) and its ratio,
with the CPU model and the load average.

    python bench/bench_sglang.py                          # the tests' tiny Qwen3-MoE, TP2
    python bench/bench_sglang.py --rounds 3 --requests 30
    python bench/bench_sglang.py --venv /path/to/venv     # where SGLang and moetrace are installed

Needs the SGLang venv (make sglang-venv) and, for the model, transformers here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench_vllm import free_port, measure, summarize

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support.sglang_server import SERVER_ENV, SERVER_FLAGS, STANDINS  # noqa: E402


def serve(kind: str, venv: Path, model: str, out: Path, tag: str, args) -> dict:
    port = free_port()
    server = [str(venv / "bin" / "python"), "-m", "sglang.launch_server", "--model-path", model, *SERVER_FLAGS,
              "--port", str(port)]
    cmd = server if kind == "plain" else \
        [str(venv / "bin" / "moetrace"), "launch", "--out", str(out), "--run-id", tag, "--", *server]
    env = {**os.environ, **SERVER_ENV, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(STANDINS)}
    return measure(cmd, env, port, out, tag, args, traced=kind == "traced")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=str(ROOT / ".venv-sglang"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    venv = Path(args.venv)
    with tempfile.TemporaryDirectory(prefix="moetrace-bench-sglang-") as tmp:
        out = Path(tmp)
        from support.vllm_model import write_model

        model = str(write_model(out / "model", "bench-sglang", intermediate=64))
        load = [os.getloadavg()[0]]
        rounds = []
        for r in range(args.rounds):
            rounds.append({kind: serve(kind, venv, model, out, f"{kind}-{r}", args) for kind in ("plain", "traced")})
            load.append(os.getloadavg()[0])
        doc = summarize(rounds, "plain", load, "tests' tiny Qwen3-MoE (support.vllm_model, I 64: 2 MoE layers, "
                        "8 experts)", args)
        print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
