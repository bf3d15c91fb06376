"""Wall time of `make test`'s pytest run, against the same suite with torch's default
thread count in every process (what the suite ran with before it pinned one thread),
measured in one run on this machine.

    python bench/bench_test_suite.py              # both variants, interleaved rounds
    python bench/bench_test_suite.py --rounds 2   # more rounds (each ~1.5-3 min on 2 cores)
    python bench/bench_test_suite.py --json

Run it on an otherwise idle machine: the suite itself keeps both cores busy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_suite(threads: str | None) -> dict:
    """One pytest run as `make test` runs it; threads: OMP_NUM_THREADS for every process
    (None: the suite's own setting, one thread)."""
    env = dict(os.environ, MOETRACE_REQUIRE_FORK="1")
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads  # tests/conftest.py keeps a value it finds
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    passed = re.search(r"(\d+) passed", tail)
    return {"wall_s": round(wall, 1), "returncode": proc.returncode, "passed": int(passed.group(1)) if passed else 0,
            "summary": tail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of both variants")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    cores = str(os.cpu_count() or 1)
    runs: dict[str, list[dict]] = {"one_thread": [], "default_threads": []}
    for _ in range(args.rounds):
        runs["default_threads"].append(run_suite(cores))
        runs["one_thread"].append(run_suite(None))
    med = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
    result = {"cores": int(cores), "rounds": args.rounds, "runs": runs, "median_wall_s": med,
              "ratio_one_thread_vs_default": round(med["one_thread"] / med["default_threads"], 3),
              "target_s": 120, "target_met": med["one_thread"] <= 120}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for k, v in runs.items():
        print(f"{k:16s} " + ", ".join(f"{r['wall_s']} s ({r['summary']})" for r in v))
    print(f"one torch thread per process: {med['one_thread']} s = {result['ratio_one_thread_vs_default']}x the "
          f"default thread count ({med['default_threads']} s); target <= 120 s: "
          f"{'MET' if result['target_met'] else 'NOT MET'}")


if __name__ == "__main__":
    main()
