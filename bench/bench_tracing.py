"""Tracing overhead in the emulated KT staging transport: staged-load time of one
MoE layer with moetrace's capture on vs off, at Qwen3.5-122B layer size.

Capture on = moetrace's own --forward-hooks spec installed in every rank (its
KT wrapper fingerprints all experts of ctx.gpu_layer when load returns).
Both sides run the fenced transport, no slow-peer injection, in separate
server runs alternated off/on so machine drift hits both.

    python bench/bench_tracing.py            # 256 experts, H 3072, I_tp 512 (1.2 GB per rank per load)
    python bench/bench_tracing.py --quick    # 64 experts, H 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from moetrace.emulator.api import time_loads
from moetrace.emulator.config import ModelDims
from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec

FULL = ModelDims(num_layers=1, moe_layers=(0,), num_experts=256, hidden=3072, intermediate=1024, top_k=8)
QUICK = ModelDims(num_layers=1, moe_layers=(0,), num_experts=64, hidden=1024, intermediate=512, top_k=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="loads per server run")
    ap.add_argument("--rounds", type=int, default=2, help="off/on server-run pairs")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dims = QUICK if args.quick else FULL
    off, on = [], []
    with tempfile.TemporaryDirectory(prefix="moetrace-bench-tracing-") as tmp:
        for r in range(args.rounds):
            off += time_loads(dims, fences=("all",), repeats=args.repeats, device=args.device)["outer:all"]
            spec = hook_spec({"out": tmp, "run_id": f"bench{r}", "sources": "staged"}, DEFAULT_TARGETS)
            on += time_loads(dims, fences=("all",), repeats=args.repeats, device=args.device,
                             forward_hooks=spec)["outer:all"]
    # the first load of each server run warms caches and allocations: report medians
    m_off, m_on = statistics.median(off), statistics.median(on)
    result = {"experts": dims.num_experts, "hidden": dims.hidden, "i_tp": dims.intermediate // 2,
              "device": args.device, "load_ms_capture_off": round(m_off, 1), "load_ms_capture_on": round(m_on, 1),
              "ratio_on_vs_off": round(m_on / m_off, 3), "samples_off": off, "samples_on": on}
    if args.json:
        print(json.dumps(result))
        return
    print(f"staged load of one layer ({dims.num_experts} experts, H {dims.hidden}, I_tp {dims.intermediate // 2}, "
          f"TP2, fenced, {args.device}), median of {len(off)} loads each:")
    print(f"  capture off  {m_off:8.1f} ms")
    print(f"  capture on   {m_on:8.1f} ms")
    print(f"  ratio on/off {m_on / m_off:8.2f}x")


if __name__ == "__main__":
    main()
