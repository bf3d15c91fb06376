"""The in-server guard's cost per layer-load, as ratios to baselines measured in the same run.

One synthetic checkpoint with one Qwen3.5-122B-A10B-sized MoE layer (256 experts,
H 3072, I 1024; rank 1 of TP2 holds 1.21 GB in 1,024 tensors) and its TP2 index:

- layer:    the guard on rank 1's expected shards (what one staged load leaves in
            ctx.gpu_layer): guard = Tracer.capture with guard "record", rows for
            mismatches only (chunk digests computed and compared on the device, one
            result copy). Baselines: dst.copy_(src) of the layer (on CUDA also the pinned host
            -> device copy, the transport's own cost: the GPU target is guard <= 2% of it)
            and the capture without the guard (hook: what the server waits for; its writer
            thread drains between candidates); rounds interleaved, medians.
- emulated: staged loads of that layer in the emulated TP2 KT transport (fenced, no
            injection), rank 0's load time with no moetrace hook vs with the guard spec.
- conform:  the installed fork's own SharedFullContext.load (moetrace conform's small
            case), rank 0's load time with capture only vs capture + guard (--conform).

    python bench/bench_guard.py                 # layer + emulated, CPU
    python bench/bench_guard.py --quick         # 32 experts
    python bench/bench_guard.py --device cuda   # the GPU target (bench/gpu_selftest.sh)
    python bench/bench_guard.py --conform       # add the conform harness (needs sglang-kt)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from moetrace.jobs.timing import best_of, median, median_ratio


def prepare(work: Path, experts: int) -> tuple[Path, Path]:
    from moetrace.checkpoints.index import write_index
    from moetrace.checkpoints.index_build import build_index
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint

    ckpt = work / f"checkpoint-e{experts}"
    if not (ckpt / "config.json").exists():
        write_synthetic_checkpoint(ckpt, num_layers=1, num_experts=experts, hidden=3072, intermediate=1024,
                                   scale_dtype="float32", num_files=1)
    index = work / f"index-e{experts}-tp2.parquet"
    if not index.exists():
        write_index(build_index(ckpt, 2), index)
    return ckpt, index


def bench_layer(ckpt: Path, index: Path, device: str, repeats: int) -> dict:
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.shards import Parallel, expected_layer
    from moetrace.tracer.capture import Tracer
    from moetrace.tracer.config import TraceConfig

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    src = {k: v.to(device) for k, v in expected_layer(open_checkpoint(ckpt), 0, 1, Parallel(2)).items()}
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    nbytes = sum(v.numel() * v.element_size() for v in src.values())
    experts = list(range(next(iter(src.values())).shape[0]))
    fns = {"copy": lambda: [dst[k].copy_(v) for k, v in src.items()]}
    if device == "cuda":
        host = {k: v.cpu().pin_memory() for k, v in src.items()}
        fns["copy_h2d_pinned"] = lambda: [dst[k].copy_(v, non_blocking=True) for k, v in host.items()]
    with tempfile.TemporaryDirectory() as out:
        base = {"out": out, "rows_per_part": 1 << 20, "flush_interval_s": 3600, "queue_max_bytes": 4 << 30}
        plain = Tracer(TraceConfig.from_dict({**base, "run_id": "hook"}), 1, 2)
        config = TraceConfig.from_dict({**base, "run_id": "guard", "index": str(index), "guard": "record"})
        guarded = Tracer(config, 1, 2)
        step = iter(range(1 << 30))
        fns["hook"] = lambda: plain.capture(src, layer=0, source="staged", step=next(step), experts=experts)
        fns["guard"] = lambda: guarded.capture(src, layer=0, source="staged", step=next(step), experts=experts)
        fns["guard"]()  # warm: keys and tables on the device, kernel compilation
        fns["hook"]()
        times = {k: [] for k in fns}
        for _ in range(repeats):  # interleaved rounds; the hook's writer thread drains between candidates
            for name, fn in fns.items():
                plain.flush(timeout=600)
                times[name].append(best_of(fn, 1, sync))
        g = guarded.sink.manifest()["guard"]
        plain.close()
        guarded.close()
    assert g["tensors"]["mismatch"] == 0 and g["tensors"]["match"] == len(experts) * 4 * (repeats + 1), g["tensors"]
    secs = {k: median(v) for k, v in times.items()}
    ratios = {f"guard_vs_{k}": round(1 / median_ratio(times, "guard", k), 4) for k in times if k != "guard"}
    return {"bytes": nbytes, "tensors": len(experts) * 4, "rounds": repeats,
            "ms": {k: round(v * 1e3, 2) for k, v in secs.items()}, "ratios": ratios}


def bench_emulated(ckpt: Path, index: Path, device: str, repeats: int, rounds: int) -> dict:
    from moetrace.emulator.api import time_loads
    from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec

    off, on = [], []
    with tempfile.TemporaryDirectory() as out:
        for r in range(rounds):
            off += time_loads(str(ckpt), fences=("all",), repeats=repeats, device=device)["outer:all"]
            spec = hook_spec({"out": out, "run_id": f"guard{r}", "index": str(index), "guard": "record",
                              "sources": "staged"}, DEFAULT_TARGETS)
            on += time_loads(str(ckpt), fences=("all",), repeats=repeats, device=device,
                             forward_hooks=spec)["outer:all"]
    m_off, m_on = statistics.median(off), statistics.median(on)
    return {"load_ms_no_hook": round(m_off, 1), "load_ms_guard": round(m_on, 1), "ratio": round(m_on / m_off, 3),
            "samples_no_hook": off, "samples_guard": on}


def bench_conform(rounds: int) -> dict:
    from moetrace.jobs.conform import Case, run_conform

    off, on = [], []
    for _ in range(rounds):
        for guard, into in ((None, off), ("mismatch", on)):
            (res,) = run_conform([Case()], tp=2, guard=guard)
            into.append(res.seconds["rank0"]["load"] * 1e3)
    return {"load_ms_capture": round(statistics.median(off), 2),
            "load_ms_capture_and_guard": round(statistics.median(on), 2),
            "ratio": round(statistics.median(on) / statistics.median(off), 3), "samples_capture": off,
            "samples_capture_and_guard": on}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 experts, fewer rounds")
    ap.add_argument("--experts", type=int, default=None, help="experts of the layer (default 256; --quick 32)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds of the layer bench")
    ap.add_argument("--workdir", default=None, help="keep the checkpoint and index here (reused)")
    ap.add_argument("--no-emulated", action="store_true", help="skip the emulated transport")
    ap.add_argument("--conform", action="store_true", help="also the conform harness (the fork's own load)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    experts, repeats = (32, 2) if args.quick else (256, args.repeats)
    if args.experts:
        experts, repeats = args.experts, min(repeats, 2) if args.experts < 32 else repeats
    with tempfile.TemporaryDirectory(prefix="moetrace-bench-guard-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        ckpt, index = prepare(work, experts)
        result = {"device": args.device, "experts": experts, "layer": bench_layer(ckpt, index, args.device, repeats)}
        if not args.no_emulated:
            result["emulated"] = bench_emulated(ckpt, index, args.device, 2 if args.quick else 3,
                                                1 if args.quick else 2)
        if args.conform:
            result["conform"] = bench_conform(1 if args.quick else 3)
    if args.json:
        print(json.dumps(result))
        return
    lay = result["layer"]
    print(f"guard per layer-load ({experts} experts, H 3072, I_tp 512, {lay['bytes'] / 1e9:.2f} GB in {lay['tensors']} "
          f"tensors, {args.device}; medians of {lay['rounds']} interleaved rounds):")
    for k, v in lay["ms"].items():
        print(f"  {k:16s} {v:9.2f} ms")
    for k, v in lay["ratios"].items():
        print(f"  {k:24s} {v:8.4f}x")
    if "emulated" in result:
        e = result["emulated"]
        print(f"emulated staged load: no hook {e['load_ms_no_hook']} ms, guard {e['load_ms_guard']} ms = {e['ratio']}x")
    if "conform" in result:
        c = result["conform"]
        print(f"conform (the fork's load): capture {c['load_ms_capture']} ms, capture + guard "
              f"{c['load_ms_capture_and_guard']} ms = {c['ratio']}x")


if __name__ == "__main__":
    main()
