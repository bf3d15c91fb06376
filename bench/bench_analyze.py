"""Benchmark `moetrace analyze` end to end on a synthetic Qwen3.5-122B-shaped TP2 trace.

Generates an index (2 ranks x 48 layers x 256 experts x 4 tensors, random
fingerprints) and a trace of --rows rows (98,304 rows per step) with a few
corruptions, then measures, each in a fresh subprocess:

  floor_full   pyarrow.dataset(...).to_table() of every column of the same files
  floor_cols   the same, only the columns the analysis reads
  analyze      moetrace.analysis.analyze() + text and JSON rendering

and reports seconds, peak RSS and the ratios analyze/floor.

  python bench/bench_analyze.py                 # 10M rows (about 3 GB of Parquet with --chunk-fps all)
  python bench/bench_analyze.py --rows 1000000  # quick run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
mode, trace, index = sys.argv[1], sys.argv[2], sys.argv[3]
if mode.startswith("floor"):
    import pyarrow.dataset as ds
    from moetrace.analysis.trace import TRACE_COLUMNS
    t1 = time.perf_counter()
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(trace) for f in fs if f.endswith(".parquet"))
    tbl = ds.dataset(files, format="parquet").to_table(columns=None if mode == "floor_full" else TRACE_COLUMNS)
    rows = tbl.num_rows
    extra = {"bytes_in_memory": tbl.nbytes}
else:
    from moetrace.analysis.report import analyze
    from moetrace.analysis.render import to_json, to_text
    t1 = time.perf_counter()
    rep = analyze([trace], index=index)
    text = to_text(rep)
    js = to_json(rep)
    rows = rep.doc["totals"]["rows_read"]
    extra = {"status": rep.doc["status"], "first_divergence": [f["sentence"] for f in rep.doc["first_divergence"]],
             "totals": rep.doc["totals"]["sentence"], "summaries": [s["sentence"] for s in rep.doc["summaries"]][:6],
             "json_bytes": len(js)}
t2 = time.perf_counter()
print(json.dumps({"mode": mode, "rows": rows, "seconds": t2 - t1, "process_seconds": t2 - t0,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **extra}))
"""


def run_child(mode: str, trace: str, index: str) -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env.setdefault("PYTHONPATH", os.path.dirname(root))
    out = subprocess.run([sys.executable, "-c", "import os\n" + CHILD, mode, trace, index], capture_output=True,
                         text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000, help="trace rows to generate (default 10M)")
    ap.add_argument("--out", default=None, help="work folder (default: a temporary folder, removed after)")
    ap.add_argument("--chunk-fps", choices=["all", "mismatch"], default="all",
                    help="rows carrying chunk digests (tracer default: all)")
    ap.add_argument("--rows-per-part", type=int, default=250_000)
    ap.add_argument("--reuse", action="store_true", help="reuse a trace already generated in --out")
    ap.add_argument("--repeat", type=int, default=1, help="measure each mode N times, keep the fastest")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()

    from synthetic_trace import write_bench  # beside this script

    work = args.out or tempfile.mkdtemp(prefix="moetrace-bench-")
    meta_path = os.path.join(work, "bench.json")
    try:
        if args.reuse and os.path.exists(meta_path):
            meta = json.load(open(meta_path))
        else:
            t = time.perf_counter()
            meta = write_bench(work, args.rows, rows_per_part=args.rows_per_part, chunk_digests=args.chunk_fps)
            meta["generate_seconds"] = time.perf_counter() - t
            meta["chunk_digests"] = args.chunk_fps
            json.dump(meta, open(meta_path, "w"))
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(meta["trace"]) for f in fs)
        results = {}
        for mode in ("floor_full", "analyze", "floor_cols"):
            best = None
            for _ in range(args.repeat):
                r = run_child(mode, meta["trace"], meta["index"])
                if best is None or r["seconds"] < best["seconds"]:
                    best = r
            results[mode] = best
        a, f, fc = results["analyze"], results["floor_full"], results["floor_cols"]
        summary = {
            "rows": a["rows"], "trace_bytes": size, "chunk_digests": meta.get("chunk_digests"),
            "generate_seconds": round(meta.get("generate_seconds", 0), 1),
            "analyze_seconds": round(a["seconds"], 2), "analyze_process_seconds": round(a["process_seconds"], 2),
            "analyze_peak_rss_mb": round(a["peak_rss_mb"]),
            "floor_full_seconds": round(f["seconds"], 2), "floor_full_peak_rss_mb": round(f["peak_rss_mb"]),
            "floor_cols_seconds": round(fc["seconds"], 2), "floor_cols_peak_rss_mb": round(fc["peak_rss_mb"]),
            "ratio_vs_floor_full": round(a["seconds"] / f["seconds"], 2),
            "ratio_vs_floor_cols": round(a["seconds"] / fc["seconds"], 2),
            "status": a["status"], "totals": a["totals"], "first_divergence": a["first_divergence"],
            "summaries": a["summaries"],
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        }
        if args.json:
            print(json.dumps(summary, indent=1))
        else:
            print(f"trace: {summary['rows']:,} rows, {size / 1e9:.2f} GB Parquet "
                  f"(chunk_digests={summary['chunk_digests']}), {summary['cpus']} CPUs")
            print(f"{'':14}{'seconds':>9}{'peak RSS MB':>13}")
            for k, r in (("floor_full", f), ("floor_cols", fc), ("analyze", a)):
                print(f"{k:14}{r['seconds']:9.2f}{r['peak_rss_mb']:13.0f}")
            print(f"ratio analyze / floor_full: {summary['ratio_vs_floor_full']:.2f}x; "
                  f"analyze / floor_cols: {summary['ratio_vs_floor_cols']:.2f}x")
            print(f"analyze process wall time incl. imports: {a['process_seconds']:.2f} s")
            print(f"verdict: {a['totals']}")
            for s in a["first_divergence"]:
                print(f"first divergence: {s}")
            for s in a["summaries"]:
                print(f"  {s}")
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
