"""Fingerprint throughput against whole-buffer XXH3-128 (the CPU ceiling: the same hash
in one call) and sha256 on CPU, and against a device-to-device copy on CUDA, on the same
buffer in the same run. Prints the CPU model and its SIMD flags.

Every round runs each candidate once in turn; ratios are medians over rounds
(the machines are shared, see docs/benchmarks.md). Target: the fingerprint
on one thread >= 0.8x whole-buffer xxh3_128.

    python bench/bench_fingerprint.py                 # 256 MiB, 5 rounds
    python bench/bench_fingerprint.py --quick         # 32 MiB, 3 rounds
    python bench/bench_fingerprint.py --device cuda   # + Triton kernel and torch fallback on the GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import xxhash

from moetrace import fingerprint as F
from moetrace.jobs.timing import cpu_description, interleaved, median, median_ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="32 MiB, 3 rounds")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    mib, repeats = (32, 3) if args.quick else (args.mib, args.repeats)
    n = mib << 20
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    view = memoryview(x.numpy())  # the same bytes, no copy: every candidate reads the same memory
    fns = {"fingerprint_1thread": lambda: F.fingerprint(x),
           "xxh3_128_whole_buffer": lambda: xxhash.xxh3_128_digest(view),
           "sha256": lambda: hashlib.sha256(view).digest()}
    for fn in fns.values():
        fn()  # warm: page faults, first calls
    times = interleaved(fns, repeats)
    ratios = {"fingerprint_1thread_vs_xxh3_128": median_ratio(times, "fingerprint_1thread", "xxh3_128_whole_buffer"),
              "fingerprint_1thread_vs_sha256": median_ratio(times, "fingerprint_1thread", "sha256")}
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available")
        xc, dst = x.cuda(), torch.empty(n, dtype=torch.uint8, device="cuda")
        want = F.fingerprint(x)
        gpu = {"copy_d2d": lambda: dst.copy_(xc), "fingerprint_torch_cuda": lambda: F.fingerprint(xc, "torch")}
        if F.triton_available():
            gpu["fingerprint_triton_cuda"] = lambda: F.fingerprint(xc, "triton")
        for fn in gpu.values():
            fn()  # compile / warm
        for m in [k.split("_")[1] for k in gpu if k.startswith("fingerprint")]:
            assert F.fingerprint(xc, m) == want, f"CUDA ({m}) and CPU fingerprints differ"
        gt = interleaved(gpu, repeats, torch.cuda.synchronize)
        times.update(gt)
        ratios.update({f"{k}_vs_copy_d2d": median_ratio(gt, k, "copy_d2d") for k in gt if k.startswith("fingerprint")})
    gbps = {k: n / median(v) / 1e9 for k, v in times.items()}
    result = {"cpu": cpu_description(), "bytes": n, "rounds": repeats, "fp_version": F.FP_VERSION,
              "xxhash": xxhash.VERSION, "GBps": {k: round(v, 3) for k, v in gbps.items()},
              "ratios": {k: round(v, 3) for k, v in ratios.items()}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['cpu']}; python-xxhash {xxhash.VERSION}")
    print(f"buffer {mib} MiB, medians of {repeats} interleaved rounds")
    for k, v in gbps.items():
        print(f"  {k:28s} {v:7.3f} GB/s")
    for k, v in ratios.items():
        print(f"  {k:40s} {v:6.2f}x")


if __name__ == "__main__":
    main()
