"""`moetrace index` end to end on one Qwen3.5-122B-sized MoE layer, TP2, against
reading the same safetensors files once (page cache warm for both).

    python bench/bench_index.py            # 256 experts, hidden 3072, I 1024 (~2.4 GB of FP8)
    python bench/bench_index.py --quick    # 32 experts
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from moetrace.checkpoints.synthetic import write_synthetic_checkpoint
from moetrace.checkpoints import index as ix
from moetrace.checkpoints import index_build as ixb


def read_files_once(root: Path) -> int:
    total = 0
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(16 << 20):
                total += len(chunk)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="32 experts")
    ap.add_argument("--workdir", default=None, help="keep the checkpoint here (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    experts = 32 if args.quick else args.experts
    with tempfile.TemporaryDirectory(prefix="moetrace-bench-index-") as tmp:
        root = Path(args.workdir or tmp) / f"qwen35-{experts}e"
        t0 = time.perf_counter()
        if not (root / "config.json").exists():
            write_synthetic_checkpoint(root, family="qwen3_5_moe", fmt="fp8_block", num_layers=1,
                                       num_experts=experts, hidden=args.hidden, intermediate=args.intermediate,
                                       scale_dtype="bfloat16", num_files=4)
        t_write = time.perf_counter() - t0
        read_files_once(root)  # warm the page cache: both sides then read from memory
        t0 = time.perf_counter()
        nbytes = read_files_once(root)
        t_read = time.perf_counter() - t0
        stats = ixb.IndexStats()
        t0 = time.perf_counter()
        table = ixb.build_index(root, args.tp, stats=stats)
        t_index = time.perf_counter() - t0
    busy = stats.seconds_read + stats.seconds_fingerprint
    result = {
        "experts": experts, "hidden": args.hidden, "intermediate": args.intermediate, "tp": args.tp,
        "checkpoint_bytes": nbytes, "rows": table.num_rows,
        "read_once_s": round(t_read, 3), "index_s": round(t_index, 3),
        "read_once_GBps": round(nbytes / t_read / 1e9, 3), "index_GBps": round(nbytes / t_index / 1e9, 3),
        "index_vs_read_once": round(t_index / t_read, 2),
        "share_slice_reads": round(stats.seconds_read / busy, 3) if busy else None,
        "share_fingerprint": round(stats.seconds_fingerprint / busy, 3) if busy else None,
        "synthetic_write_s": round(t_write, 1),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"checkpoint: {experts} experts, H {args.hidden}, I {args.intermediate}, {nbytes / 1e9:.2f} GB; index at TP{args.tp}")
    print(f"  read the files once      {t_read:7.2f} s  {result['read_once_GBps']:6.2f} GB/s")
    print(f"  moetrace index           {t_index:7.2f} s  {result['index_GBps']:6.2f} GB/s")
    print(f"  ratio index / read-once  {result['index_vs_read_once']:7.2f}x")
    print(f"  where index time goes    slice reads {result['share_slice_reads']:.0%}, fingerprinting {result['share_fingerprint']:.0%} (thread-seconds)")


if __name__ == "__main__":
    main()
