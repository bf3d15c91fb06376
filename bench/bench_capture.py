"""Capture cost per layer-load, as a ratio to one plain copy of the same tensors.

One Qwen3.5-122B-A10B-sized MoE layer as one TP2 rank holds it (256 experts,
H 3072, I_tp 512): w13 [256,1024,3072] fp8, w13 scale [256,8,24] fp32,
w2 [256,3072,512] fp8, w2 scale [256,24,4] fp32 (1.2 GB). Measured in the same
run, rounds interleaved (each candidate once per round), medians of --repeats rounds:

- copy:        dst.copy_(src) for the four tensors (what the transport costs;
               on CUDA also the pinned host -> device copy KT does);
- hook:        Tracer.capture of the four tensors: the part the server waits
               for (chunk digests on the tensors' device, small D2H copy);
- end_to_end:  hook + the writer thread's tensor digests and Parquet write.

Target: the hook on CPU <= 1.5x the copy. Prints the CPU model.

    python bench/bench_capture.py                 # full layer on CPU
    python bench/bench_capture.py --quick         # 32 experts, 2 repeats
    python bench/bench_capture.py --device cuda   # tensors on the GPU
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from moetrace.jobs.timing import cpu_description, interleaved, median, median_ratio
from moetrace.tracer.capture import Tracer
from moetrace.tracer.config import TraceConfig


def layer_tensors(experts: int, hidden: int, inter_tp: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    blk = lambda n: -(-n // 128)  # noqa: E731

    def fp8(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn).to(device)

    return {
        "w13_weight": fp8(experts, 2 * inter_tp, hidden),
        "w13_weight_scale_inv": torch.rand(experts, 2 * blk(inter_tp), blk(hidden), generator=g).to(device),
        "w2_weight": fp8(experts, hidden, inter_tp),
        "w2_weight_scale_inv": torch.rand(experts, blk(hidden), blk(inter_tp), generator=g).to(device),
    }




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--inter-tp", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="32 experts, 2 rounds")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    experts, repeats = (32, 2) if args.quick else (args.experts, args.repeats)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    src = layer_tensors(experts, args.hidden, args.inter_tp, args.device)
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    nbytes = sum(v.numel() * v.element_size() for v in src.values())

    def copy():
        for k, v in src.items():
            dst[k].copy_(v)

    fns = {"copy": copy}
    if args.device == "cuda":
        host = {k: v.cpu().pin_memory() for k, v in src.items()}

        def h2d():
            for k, v in host.items():
                dst[k].copy_(v, non_blocking=True)

        fns["copy_h2d_pinned"] = h2d

    with tempfile.TemporaryDirectory() as out:
        cfg = TraceConfig.from_dict({"out": out, "run_id": "bench", "rows_per_part": 1 << 20, "flush_interval_s": 3600,
                                     "queue_max_bytes": 4 << 30})
        tracer = Tracer(cfg, 0, 2)
        step = iter(range(1 << 30))
        ids = list(range(experts))

        def hook():
            tracer.capture(src, layer=0, source="staged", step=next(step), experts=ids)

        def end_to_end():
            hook()
            assert tracer.flush(timeout=600)

        fns["hook"], fns["end_to_end"] = hook, end_to_end
        end_to_end()  # warm: keys on the device, the exactness probe, kernel compilation
        times = interleaved(fns, repeats, sync)
        m = tracer.sink.manifest()
        tracer.close()
        assert m["rows_dropped"] == 0 and m["hook_errors"] == 0 and m["sink_errors"] == 0, m

    secs = {k: median(v) for k, v in times.items()}
    result = {
        "cpu": cpu_description(),
        "device": args.device,
        "layer": {"experts": experts, "hidden": args.hidden, "inter_tp": args.inter_tp, "bytes": nbytes,
                  "tensors": experts * 4},
        "rounds": repeats,
        "seconds": {k: round(v, 4) for k, v in secs.items()},
        "GB_per_s": {k: round(nbytes / v / 1e9, 2) for k, v in secs.items()},
        "ratio_to_copy": {k: round(1 / median_ratio(times, k, "copy"), 2) for k in times if k != "copy"},
        "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(result["cpu"])
    print(f"layer: {experts} experts x 4 tensors, {nbytes / 1e9:.3f} GB on {args.device} "
          f"(medians of {repeats} interleaved rounds)")
    for k, v in secs.items():
        ratio = "" if k == "copy" else f"  = {result['ratio_to_copy'][k]:.2f} x copy"
        print(f"  {k:16s} {v * 1e3:9.1f} ms  {nbytes / v / 1e9:7.2f} GB/s{ratio}")


if __name__ == "__main__":
    main()
