"""What the index's safety checks cost, each against a baseline from the same run.

1. A verified cache hit (safetensors headers hashed into the key; a random sample of
   SAMPLE_EXPERTS shards cut again and SAMPLE_CHUNKS chunks per tensor re-hashed;
   the cached file read through the checked reader) against building the index
   (the cache miss) and against the unverified hit it replaces (key + metadata).
2. The checks of every index read (checkpoints.index_checks) on a Qwen3.5-122B-shaped
   TP2 index (2 x 48 layers x 256 experts x 4 tensors, random chunk digests) against
   reading the same file with pyarrow alone.

    python bench/bench_index_cache.py            # 4 MoE layers x 64 experts, H 1024, I 512 (~400 MB)
    python bench/bench_index_cache.py --quick    # 16 experts
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from moetrace.checkpoints import index_build as ixb
from moetrace.checkpoints.index import index_metadata, read_index
from moetrace.checkpoints.index_cache import SAMPLE_CHUNKS, SAMPLE_EXPERTS
from moetrace.checkpoints.synthetic import write_synthetic_checkpoint
from moetrace.jobs.timing import median

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_trace import bench_index  # noqa: E402


def cpu() -> str:
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni") if f in flags]
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(isa) or 'no AVX2'}"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    experts = 16 if args.quick else 64
    print(f"CPU: {cpu()}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MOETRACE_CACHE"] = os.path.join(tmp, "cache")
        ckpt = write_synthetic_checkpoint(Path(tmp) / "c", num_layers=4, num_experts=experts, hidden=1024,
                                          intermediate=512, num_files=4)
        miss, hit, old = [], [], []
        for _ in range(args.rounds):
            for f in Path(os.environ["MOETRACE_CACHE"]).glob("index/*.parquet"):
                f.unlink()
            miss.append(timed(lambda: ixb.cached_index(ckpt, 2)))
            path, reused = ixb.cached_index(ckpt, 2)
            assert reused
            hit.append(timed(lambda: ixb.cached_index(ckpt, 2)))
            opts = ixb.IndexOptions(2, layers=tuple(range(4)))
            old.append(timed(lambda: (ixb.cache_key(ckpt, opts), index_metadata(path))))
        rows = pq.ParquetFile(path).metadata.num_rows
        print(f"checkpoint: 4 MoE layers x {experts} experts, H 1024, I 512, FP8 block, TP2: {rows} rows")
        print(f"cache miss (build + write):         {median(miss) * 1e3:8.1f} ms")
        print(f"verified hit ({SAMPLE_EXPERTS} shards, {SAMPLE_CHUNKS} chunks/tensor): {median(hit) * 1e3:8.1f} ms "
              f"= {median(hit) / median(miss):.3f}x the miss, {median(hit) / median(old):.2f}x the unverified hit")
        print(f"unverified hit (key + metadata):    {median(old) * 1e3:8.1f} ms")

        big = os.path.join(tmp, "big.parquet")
        bench_index(big)
        raw, checked = [], []
        for _ in range(args.rounds):
            raw.append(timed(lambda: pq.read_table(big)))
            checked.append(timed(lambda: read_index(big)))
        print(f"Qwen3.5-122B-shaped TP2 index ({pq.ParquetFile(big).metadata.num_rows:,} rows): "
              f"pq.read_table {median(raw) * 1e3:.0f} ms, read_index with every check {median(checked) * 1e3:.0f} ms "
              f"= {median(checked) / median(raw):.1f}x")


if __name__ == "__main__":
    main()
