"""The reader fence's own cost: staged-load time per layer, fenced vs unfenced.

Times ``SharedFullContext.load`` of one MoE layer in the emulated TP KT
staging transport (rank 0's wall time, as the fork logs "prepare weight"),
with ``fence="none"`` (the fork as is) and ``fence="all"`` (the seed PR's
fences), the two modes interleaved in one run so machine drift hits both.
No slow-peer injection: natural timing. Default size: one Qwen3.5-122B-A10B
layer at TP2 (256 experts, hidden 3072, I_tp 512: 1.2 GB per rank per load);
``--quick`` a small layer.

    python bench/bench_fence.py --quick
    python bench/bench_fence.py --repeats 5 --json
    python bench/bench_fence.py --device cuda      # copy stream + events + pinned slots

On CPU the "device" copies are memcpys by a thread competing with the writer
for memory bandwidth and cores, so the ratio is a CPU figure; on a GPU the
copies are DMA and the fence's cost is the exposed synchronization latency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from moetrace.emulator.api import time_loads
from moetrace.emulator.config import ModelDims

FULL = ModelDims(num_layers=1, moe_layers=(0,), num_experts=256, hidden=3072, intermediate=1024, top_k=8)
QUICK = ModelDims(num_layers=1, moe_layers=(0,), num_experts=64, hidden=1024, intermediate=512, top_k=8)


def per_rank_bytes(d: ModelDims, tp: int) -> int:
    i_tp = d.i_tp(tp)
    weights = d.num_experts * (2 * i_tp * d.hidden + d.hidden * i_tp)
    scales = 4 * d.num_experts * (2 * -(-i_tp // 128) * -(-d.hidden // 128) + -(-d.hidden // 128) * -(-i_tp // 128))
    return weights + scales


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 experts, hidden 1024, I_tp 256 instead of the 122B layer")
    ap.add_argument("--repeats", type=int, default=3, help="loads per fence mode (default 3)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    dims = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    times = time_loads(dims, tp=args.tp, fences=("none", "all"), repeats=args.repeats, device=args.device)
    med = {f: statistics.median(v) for f, v in times.items()}
    nbytes = per_rank_bytes(dims, args.tp)
    out = {
        "layer": {"experts": dims.num_experts, "hidden": dims.hidden, "i_tp": dims.i_tp(args.tp), "tp": args.tp,
                  "bytes_per_rank": nbytes, "tensors_per_load": 4 * dims.num_experts},
        "device": args.device,
        "repeats": args.repeats,
        "load_ms": times,
        "median_ms": med,
        "rank_GBps": {f: round(nbytes / (m / 1000) / 1e9, 2) for f, m in med.items()},
        "fenced_over_unfenced": round(med["all"] / med["none"], 3),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    L = out["layer"]
    print(f"layer: {L['experts']} experts, hidden {L['hidden']}, I_tp {L['i_tp']}, TP{L['tp']}: "
          f"{nbytes / 1e9:.2f} GB per rank per load, {L['tensors_per_load']} tensors; device {args.device}")
    for f in ("none", "all"):
        runs = ", ".join(f"{v:.0f}" for v in times[f])
        print(f"  fence={f:<4}  median {med[f]:8.1f} ms  ({runs} ms)  {out['rank_GBps'][f]} GB/s per rank")
    print(f"  fenced / unfenced = {out['fenced_over_unfenced']:.3f}   ({out['seconds']} s total)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
