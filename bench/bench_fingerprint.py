"""Fingerprint throughput against XXH3-128 (the CPU ceiling) and sha256 on CPU,
and against a device-to-device copy on CUDA, on the same buffer in the same run.

Every round runs each candidate once in turn; ratios are medians over rounds
(the machines are shared, see docs/benchmarks.md).

    python bench/bench_fingerprint.py                 # 256 MiB, 5 rounds
    python bench/bench_fingerprint.py --quick         # 32 MiB, 3 rounds
    python bench/bench_fingerprint.py --device cuda   # + Triton kernel and torch fallback on the GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch

from moetrace import fingerprint as F
from moetrace.jobs.timing import interleaved, median, median_ratio


def cpu_candidates(x: torch.Tensor, raw: bytes) -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def on_threads(n):
        def run():
            torch.set_num_threads(n)
            F.fingerprint(x, "torch")
        return run

    fns = {"fingerprint_1thread": on_threads(1), "fingerprint_all_cores": on_threads(cores),
           "sha256": lambda: hashlib.sha256(raw).digest()}
    try:
        import xxhash

        fns["xxh3_128"] = lambda: xxhash.xxh3_128(raw).digest()
    except ImportError:
        pass
    return fns


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
    raw = x.numpy().tobytes()
    threads = torch.get_num_threads()
    F.fingerprint(x[: 1 << 20])  # warm: keys, the exactness probe
    times = interleaved(cpu_candidates(x, raw), repeats)
    torch.set_num_threads(threads)
    ratios = {}
    if "xxh3_128" in times:
        ratios.update({f"{k}_vs_xxh3": median_ratio(times, k, "xxh3_128") for k in times if k.startswith("fingerprint")})
    ratios.update({f"{k}_vs_sha256": median_ratio(times, k, "sha256") for k in times if k.startswith("fingerprint")})
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available")
        xc, dst = x.cuda(), torch.empty(n, dtype=torch.uint8, device="cuda")
        want = F.fingerprint(x, "torch")
        fns = {"copy_d2d": lambda: dst.copy_(xc), "fingerprint_torch_cuda": lambda: F.fingerprint(xc, "torch")}
        if F.triton_available():
            fns["fingerprint_triton_cuda"] = lambda: F.fingerprint(xc, "triton")
        for name, fn in fns.items():
            fn()  # compile / warm
        for m in [k.split("_")[1] for k in fns if k.startswith("fingerprint")]:
            assert F.fingerprint(xc, m) == want, f"CUDA ({m}) and CPU fingerprints differ"
        gpu = interleaved(fns, repeats, torch.cuda.synchronize)
        times.update(gpu)
        ratios.update({f"{k}_vs_copy_d2d": median_ratio(gpu, k, "copy_d2d") for k in gpu if k.startswith("fingerprint")})
    gbps = {k: n / median(v) / 1e9 for k, v in times.items()}
    result = {"bytes": n, "rounds": repeats, "fp_version": F.FP_VERSION,
              "GBps": {k: round(v, 3) for k, v in gbps.items()}, "ratios": {k: round(v, 3) for k, v in ratios.items()}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"buffer {mib} MiB, medians of {repeats} interleaved rounds")
    for k, v in gbps.items():
        print(f"  {k:28s} {v:7.3f} GB/s")
    for k, v in ratios.items():
        print(f"  {k:40s} {v:6.2f}x")


if __name__ == "__main__":
    main()
