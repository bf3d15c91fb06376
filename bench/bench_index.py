"""`moetrace index` end to end against reading the same safetensors files once
(page cache warm for both), at TP2.

Default: one Qwen3.5-122B-sized MoE layer (256 experts, H 3072, I 1024, FP8
with BF16 block scales, ~2.5 GB), rounds interleaved, medians reported.
--model: a whole synthetic 48-layer model (256 experts per layer, H and I
scaled down so it fits a small machine's page cache) indexed as one run
through the index cache, then the same call again: the cache hit.

    python bench/bench_index.py               # one layer, 3 rounds
    python bench/bench_index.py --quick       # 32 experts
    python bench/bench_index.py --model       # 48 layers, H 512, I 256 (~4.9 GB)
    python bench/bench_index.py --device cuda # on the GPU (pinned buffers, the kernel); checks
                                              # its rows equal the CPU index's

Target: the index >= 0.67x a warm read of the same files. Prints the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from moetrace.checkpoints import index_build as ixb
from moetrace.checkpoints.synthetic import write_synthetic_checkpoint
from moetrace.jobs.timing import cpu_description, median


def read_files_once(root: Path) -> int:
    total = 0
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(16 << 20):
                total += len(chunk)
    return total


def replicate_layers(one_layer: Path, root: Path, layers: int) -> None:
    """A `layers`-layer checkpoint from a 1-layer synthetic one, written one layer
    file at a time (the synthetic writer holds a whole model in memory: too much
    for 48 layers on a 24 GiB machine). Every layer holds layer 0's bytes under its
    own names: the same work for the index, digests repeat across layers."""
    from safetensors.torch import load_file, save_file

    root.mkdir(parents=True)
    index = json.loads((one_layer / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    weight_map, marker = {}, ".layers.0."
    for layer in range(layers):
        for i, fname in enumerate(files):
            tensors = load_file(str(one_layer / fname))
            keep = tensors if layer == 0 else {
                k.replace(marker, f".layers.{layer}."): v for k, v in tensors.items()
                if marker in k and not k.startswith(("model.visual", "mtp"))}
            out = f"model-L{layer:02d}-{i:02d}.safetensors"
            save_file(keep, str(root / out), metadata={"format": "pt"})
            weight_map.update({k: out for k in keep})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((one_layer / "config.json").read_text())
    (config.get("text_config") or config)["num_hidden_layers"] = layers
    (root / "config.json").write_text(json.dumps(config, indent=2))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def bench_layer(root: Path, tp: int, rounds: int, device: str = "cpu") -> dict:
    read_files_once(root)  # warm the page cache: both sides then read from memory
    reads, builds, busy_cores, stats = [], [], [], ixb.IndexStats()
    for _ in range(rounds):
        t_read, nbytes = timed(lambda: read_files_once(root))
        stats = ixb.IndexStats()
        c0 = cpu_seconds()
        t_index, table = timed(lambda: ixb.build_index(root, tp, device=device, stats=stats))
        busy_cores.append((cpu_seconds() - c0) / t_index)  # reads and hashing overlapping: up to the core count
        reads.append(t_read)
        builds.append(t_index)
    busy = stats.seconds_read + stats.seconds_fingerprint
    t_read, t_index = median(reads), median(builds)
    same = None if device == "cpu" else ixb.build_index(root, tp).equals(table)  # digests identical to the CPU's
    return {
        "device": device, "device_index_equals_cpu": same,
        "checkpoint_bytes": nbytes, "rows": table.num_rows, "rounds": rounds,
        "read_once_s": round(t_read, 3), "index_s": round(t_index, 3),
        "read_once_GBps": round(nbytes / t_read / 1e9, 3), "index_GBps": round(nbytes / t_index / 1e9, 3),
        "index_throughput_vs_read_once": round(median([r / b for r, b in zip(reads, builds)]), 3),
        "index_cores_busy": round(median(busy_cores), 2),
        "share_slice_reads": round(stats.seconds_read / busy, 3) if busy else None,
        "share_fingerprint": round(stats.seconds_fingerprint / busy, 3) if busy else None,
    }


def bench_model(root: Path, tp: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="moetrace-bench-cache-") as cache:
        os.environ["MOETRACE_CACHE"] = cache
        read_files_once(root)
        t_read, nbytes = timed(lambda: read_files_once(root))
        t_build, (_, reused_first) = timed(lambda: ixb.cached_index(root, tp))
        t_hit, (path, reused) = timed(lambda: ixb.cached_index(root, tp))
        assert not reused_first and reused, "the second call must be a cache hit"
        index_bytes = path.stat().st_size
    return {
        "checkpoint_bytes": nbytes, "read_once_s": round(t_read, 2), "index_s": round(t_build, 2),
        "read_once_GBps": round(nbytes / t_read / 1e9, 3), "index_GBps": round(nbytes / t_build / 1e9, 3),
        "index_throughput_vs_read_once": round(t_read / t_build, 3),
        "cache_hit_s": round(t_hit, 3), "index_file_bytes": index_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=None, help="default 3072 (--model: 1024)")
    ap.add_argument("--intermediate", type=int, default=None, help="default 1024 (--model: 256)")
    ap.add_argument("--layers", type=int, default=None, help="default 1 (--model: 48)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="32 experts, 2 rounds")
    ap.add_argument("--model", action="store_true", help="a whole 48-layer model through the cache, then the cache hit")
    ap.add_argument("--workdir", default=None, help="keep the checkpoint here (default: a temp dir)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    experts = 32 if args.quick else args.experts
    hidden = args.hidden or (512 if args.model else 3072)
    inter = args.intermediate or (256 if args.model else 1024)
    layers = args.layers or (48 if args.model else 1)
    rounds = 2 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="moetrace-bench-index-") as tmp:
        root = Path(args.workdir or tmp) / f"qwen35-{layers}l-{experts}e-h{hidden}-i{inter}"
        t_write = 0.0
        if not (root / "config.json").exists():
            one = root.with_name(root.name + "-layer0") if layers > 1 else root
            t_write, _ = timed(lambda: write_synthetic_checkpoint(
                one, family="qwen3_5_moe", fmt="fp8_block", num_layers=1, num_experts=experts, hidden=hidden,
                intermediate=inter, scale_dtype="bfloat16", num_files=4))
            if layers > 1:
                t_rep, _ = timed(lambda: replicate_layers(one, root, layers))
                t_write += t_rep
        result = bench_model(root, args.tp) if args.model else bench_layer(root, args.tp, rounds, args.device)
    result = {"cpu": cpu_description(), "layers": layers, "experts": experts, "hidden": hidden, "intermediate": inter,
              "tp": args.tp, **result, "synthetic_write_s": round(t_write, 1)}
    if args.json:
        print(json.dumps(result))
        return
    print(result["cpu"])
    print(f"checkpoint: {layers} layer(s), {experts} experts, H {hidden}, I {inter}, "
          f"{result['checkpoint_bytes'] / 1e9:.2f} GB; index at TP{args.tp}")
    print(f"  read the files once      {result['read_once_s']:7.2f} s  {result['read_once_GBps']:6.2f} GB/s")
    print(f"  moetrace index           {result['index_s']:7.2f} s  {result['index_GBps']:6.2f} GB/s")
    print(f"  index throughput / read  {result['index_throughput_vs_read_once']:7.2f}x")
    if args.model:
        print(f"  cache hit (same call)    {result['cache_hit_s']:7.3f} s")
    else:
        print(f"  where index time goes    slice reads {result['share_slice_reads']:.0%}, "
              f"fingerprinting {result['share_fingerprint']:.0%} (thread-seconds); "
              f"{result['index_cores_busy']:.2f} cores busy (CPU seconds / wall)")
        if result["device_index_equals_cpu"] is not None:
            print(f"  {args.device} index rows equal the CPU index: {result['device_index_equals_cpu']}")


if __name__ == "__main__":
    main()
