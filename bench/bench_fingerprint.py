"""Fingerprint throughput on CPU against sha256 (the weight checkers' method)
and XXH3-128 (the CPU ceiling), on the same buffer in the same run.

    python bench/bench_fingerprint.py            # 256 MiB buffer
    python bench/bench_fingerprint.py --quick    # 32 MiB
    python bench/bench_fingerprint.py --device cuda   # + torch path on the GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from moetrace.jobs.timing import best_of
from moetrace import fingerprint as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="32 MiB, 2 repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    mib, repeats = (32, 2) if args.quick else (args.mib, args.repeats)
    n = mib << 20
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    raw = x.numpy().tobytes()
    times = {
        "sha256": best_of(lambda: hashlib.sha256(raw).digest(), repeats),
        "fingerprint_1thread": best_of(lambda: F.fingerprint(x, "numpy", threads=False), repeats),
        "fingerprint_all_cores": best_of(lambda: F.fingerprint(x, "numpy", threads=True), repeats),
        "fingerprint_torch_cpu": best_of(lambda: F.fingerprint(x, "torch"), max(1, repeats - 1)),
    }
    try:
        import xxhash

        times["xxh3_128"] = best_of(lambda: xxhash.xxh3_128(raw).digest(), repeats)
    except ImportError:
        pass
    if args.device == "cuda":
        xc = x.cuda()
        torch.cuda.synchronize()
        times["fingerprint_torch_cuda"] = best_of(lambda: F.fingerprint(xc, "torch"), repeats)
        assert F.fingerprint(xc) == F.fingerprint(x), "CUDA and CPU fingerprints differ"
    gbps = {k: n / v / 1e9 for k, v in times.items()}
    ratios = {f"{k}_vs_sha256": gbps[k] / gbps["sha256"] for k in gbps if k.startswith("fingerprint")}
    if "xxh3_128" in gbps:
        ratios.update({f"{k}_vs_xxh3": gbps[k] / gbps["xxh3_128"] for k in gbps if k.startswith("fingerprint")})
    result = {"bytes": n, "cores": F._workers(), "GBps": {k: round(v, 3) for k, v in gbps.items()},
              "ratios": {k: round(v, 3) for k, v in ratios.items()}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"buffer {mib} MiB, {F._workers()} cores, best of {repeats}")
    for k, v in gbps.items():
        print(f"  {k:24s} {v:7.3f} GB/s")
    for k, v in ratios.items():
        print(f"  {k:36s} {v:6.2f}x")


if __name__ == "__main__":
    main()
