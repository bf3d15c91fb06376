"""`moetrace index` as a user runs it (the process, start to exit) against a warm read of
the same files, in the same run: `cat` of the files to /dev/null (a process too), and also
the fastest one-thread read found here (a reused 1 MiB buffer, in the bench's process).
The checkpoint is written back to disk (sync) before anything is timed.

Default: three Qwen3.5-122B-sized MoE layers (256 experts, H 3072, I 1024, FP8 with BF16
block scales: 7.4 GB, two files per layer) at TP2 and TP1, rounds interleaved (read,
index), medians reported. Each index run is the first of its checkpoint (the index
cache holds none of it; the config's answer is cached, as after any earlier run with this
config.json: the first one reads it through transformers, printed apart). Prints the CPU
model and flags, where the index's time goes (start-up and imports, the workers' CPU
seconds reading and hashing contiguous pieces and reading, gathering and hashing column
cuts; the Parquet write), the peak memory of the process and its workers, the ceiling
(one process per core reading and hashing every byte, nothing else: with pread and
through a mapping), and the process wall of `moetrace --help`, `hook-spec` and a
cache-hit `index` (target <= 0.3 s).

    python bench/bench_index.py                  # 3 layers (7.4 GB written to /tmp once), TP2 and TP1, 3 rounds
    python bench/bench_index.py --quick          # 1 layer of 32 experts, 2 rounds
    python bench/bench_index.py --workdir /data  # the checkpoint there (deleted at the end unless --keep)

Targets: index process >= 1.0x a warm read (TP2 and TP1); peak memory <= 1 GB beyond the
page cache; cache-hit index and --help <= 0.3 s. The checkpoint's values are random
bytes (a digest does not care); its names, dtypes, shapes and config are Qwen3.5's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from moetrace.checkpoints.synthetic_config import synthetic_config
from moetrace.jobs.timing import cpu_description, median

PREFIX = "model.language_model"


def write_checkpoint(root: Path, layers: int, experts: int, hidden: int, inter: int, files_per_layer: int = 2) -> int:
    """A Qwen3.5 FP8-block checkpoint of random bytes, written a tensor at a time (little
    memory); returns its bytes."""
    root.mkdir(parents=True)
    cfg = synthetic_config("qwen3_5_moe", "fp8_block", layers, experts, hidden, inter, 0, ("fp8", (128, 128)), 0)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    per_file = -(-experts // files_per_layer)
    for layer in range(layers):
        for f in range(files_per_layer):
            name = f"model-{layer:02d}-{f:02d}.safetensors"
            header, offset, tensors = {}, 0, []
            for e in range(f * per_file, min((f + 1) * per_file, experts)):
                for proj, (out, inp) in shapes.items():
                    stem = f"{PREFIX}.layers.{layer}.mlp.experts.{e}.{proj}_proj"
                    for key, dtype, shape, item in (("weight", "F8_E4M3", (out, inp), 1),
                                                    ("weight_scale_inv", "BF16", (-(-out // 128), -(-inp // 128)), 2)):
                        n = math.prod(shape) * item
                        header[f"{stem}.{key}"] = {"dtype": dtype, "shape": list(shape),
                                                   "data_offsets": [offset, offset + n]}
                        tensors.append(n)
                        weight_map[f"{stem}.{key}"] = name
                        offset += n
            header["__metadata__"] = {"format": "pt"}
            raw = json.dumps(header).encode()
            raw += b" " * (-len(raw) % 8)
            with open(root / name, "wb") as fh:
                fh.write(len(raw).to_bytes(8, "little") + raw)
                for n in tensors:
                    fh.write(rng.bytes(n))
            total += offset
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def read_with_cat(root: Path) -> tuple[float, float, int]:
    """The baseline: `cat` of the checkpoint's files to /dev/null, as a user reads them (a
    process). Returns (wall seconds, CPU seconds, bytes)."""
    files = sorted(root.glob("*.safetensors"))
    t0 = time.perf_counter()
    proc = subprocess.Popen(["cat", *map(str, files)], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("cat of the checkpoint's files failed")
    return wall, usage.ru_utime + usage.ru_stime, sum(f.stat().st_size for f in files)


def read_fastest(root: Path) -> float:
    """The fastest one-thread read found here: every file read into one reused 1 MiB buffer
    (stays in cache; `cat` copies 128 KiB at a time and writes each to /dev/null). Seconds."""
    view = memoryview(bytearray(1 << 20))
    t0 = time.perf_counter()
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.perf_counter() - t0


def _moetrace() -> list[str]:
    script = Path(sys.executable).with_name("moetrace")
    return [str(script)] if script.exists() else [sys.executable, "-m", "moetrace.cli"]


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return out


def _rss_kib(pid: int) -> tuple[int, int]:
    """(RssAnon, VmRSS) of one process in KiB: its own memory, and with the file pages it maps."""
    anon = rss = 0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
    except OSError:
        pass
    return anon, rss


def run_process(cmd: list[str], env: dict) -> dict:
    """Wall from start to exit, CPU seconds (with its workers), and the peak over the run
    of the process tree's anonymous and total resident memory (sampled every 5 ms)."""
    peak = {"anon": 0, "rss": 0}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    done = threading.Event()

    def sample():
        while not done.is_set():
            mem = [_rss_kib(p) for p in _tree(proc.pid)]
            peak["anon"] = max(peak["anon"], sum(a for a, _ in mem))
            peak["rss"] = max(peak["rss"], sum(r for _, r in mem))
            done.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err.strip()}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_anon_mib": peak["anon"] / 1024,
            "peak_rss_mib": peak["rss"] / 1024, "stdout": out}


def bench_tp(root: Path, tp: int, rounds: int, env: dict, out: Path) -> dict:
    cache = Path(env["MOETRACE_CACHE"]) / "index"
    reads, read_cpu, fastest, runs = [], [], [], []
    for _ in range(rounds):
        wall, cpu, nbytes = read_with_cat(root)
        reads.append(wall)
        read_cpu.append(cpu)
        fastest.append(read_fastest(root))
        shutil.rmtree(cache, ignore_errors=True)  # the checkpoint's first index
        runs.append(run_process(_moetrace() + ["index", str(root), "--tp", str(tp), "-o", str(out), "--json"], env))
    summary = [json.loads(r["stdout"]) for r in runs]
    assert not any(s["reused_cache"] for s in summary)
    walls = [r["wall_s"] for r in runs]
    pick = sorted(range(rounds), key=lambda i: walls[i])[rounds // 2]  # the median run's breakdown
    timings, s = summary[pick]["timings"], summary[pick]
    return {
        "tp": tp, "checkpoint_bytes": nbytes, "rows": s["rows"], "rounds": rounds,
        "read_s": round(median(reads), 3), "index_s": round(median(walls), 3),
        "read_GBps": round(nbytes / median(reads) / 1e9, 2), "index_GBps": round(nbytes / median(walls) / 1e9, 2),
        "index_vs_read": round(median([r / w for r, w in zip(reads, walls)]), 3),
        "index_vs_read_rounds": [round(r / w, 3) for r, w in zip(reads, walls)],
        "fastest_read_s": round(median(fastest), 3),
        "index_vs_fastest_read": round(median([r / w for r, w in zip(fastest, walls)]), 3),
        "cores_busy": round(runs[pick]["cpu_s"] / walls[pick], 2),
        "read_cpu_s": round(median(read_cpu), 3), "index_cpu_s": round(median([r["cpu_s"] for r in runs]), 3),
        "startup_imports_exit_s": round(walls[pick] - s["seconds"], 3),
        "timings": timings,
        "peak_anon_mib": round(max(r["peak_anon_mib"] for r in runs)),
        "peak_rss_mib": round(max(r["peak_rss_mib"] for r in runs)),
    }


def _hash_files(files: list[Path], how: str) -> None:
    """Every 64 KiB chunk of the files hashed, read with pread into a reused 1 MiB buffer or
    through a read-only mapping."""
    import mmap

    import xxhash

    chunk, digest = 64 << 10, xxhash.xxh3_128_digest
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            if how == "mapped":
                m = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
                mv = memoryview(m)
                for i in range(0, len(m), chunk):
                    digest(mv[i:i + chunk])
                mv.release()
                m.close()
                continue
            offset = 0
            while n := os.preadv(fd, [view], offset):
                for i in range(0, n, chunk):
                    digest(view[i:min(i + chunk, n)])
                offset += n
        finally:
            os.close(fd)


def bench_ceiling(root: Path, rounds: int) -> dict:
    """What one process per core reaches reading and hashing every byte of the files (no
    plans, no column cuts, no start-up), against the read in the same round: the most any
    index process could reach on this machine, each way of reading."""
    files = sorted(root.glob("*.safetensors"))
    cores = len(os.sched_getaffinity(0))
    ratios = {"pread": [], "mapped": []}
    for _ in range(rounds):
        for how in ratios:
            read = read_with_cat(root)[0]
            t0 = time.perf_counter()
            pids = []
            for w in range(cores):
                pid = os.fork()
                if pid == 0:
                    try:
                        _hash_files(files[w::cores], how)
                    finally:
                        os._exit(0)
                pids.append(pid)
            for pid in pids:
                os.waitpid(pid, 0)
            ratios[how].append(read / (time.perf_counter() - t0))
    return {"processes": cores, **{f"{k}_vs_read": round(median(v), 3) for k, v in ratios.items()},
            **{f"{k}_vs_read_rounds": [round(x, 2) for x in v] for k, v in ratios.items()}}


def bench_light(root: Path, env: dict, tmp: Path, repeats: int) -> dict:
    """Process walls of the commands that should start at once (median of `repeats`)."""
    out = tmp / "hit.parquet"
    cmds = {
        "help": _moetrace() + ["--help"],
        "hook_spec": _moetrace() + ["hook-spec", "--out", str(tmp / "traces")],
        "index_cache_hit": _moetrace() + ["index", str(root), "--tp", "2", "-o", str(out), "--json"],
    }
    walls = {k: [] for k in cmds}
    for _ in range(repeats):
        for k, cmd in cmds.items():
            walls[k].append(run_process(cmd, env)["wall_s"])
    assert json.loads(run_process(cmds["index_cache_hit"], env)["stdout"])["reused_cache"]
    imports = [run_process([sys.executable, "-c", "import moetrace.cli, moetrace.commands.index, "
                            "moetrace.checkpoints.index_build"], env)["wall_s"] for _ in range(repeats)]
    return {**{f"{k}_s": round(median(v), 3) for k, v in walls.items()},
            "python_and_index_imports_s": round(median(imports), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--tp", default="2,1", help="TP sizes to index at, in order (default 2,1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 layer of 32 experts, 2 rounds")
    ap.add_argument("--workdir", default=None, help="where the checkpoint goes (default: a temp dir in /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (with --workdir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    layers, experts = (1, 32) if args.quick else (args.layers, args.experts)
    rounds = 2 if args.quick else args.rounds
    tmp = Path(tempfile.mkdtemp(prefix="moetrace-bench-index-", dir=args.workdir))
    try:
        root = tmp / f"qwen35-{layers}l-{experts}e-h{args.hidden}-i{args.intermediate}"
        t0 = time.perf_counter()
        nbytes = write_checkpoint(root, layers, experts, args.hidden, args.intermediate)
        t_write = time.perf_counter() - t0
        os.sync()  # written back before anything is timed: the kernel's flusher would share the cores
        env = {**os.environ, "MOETRACE_CACHE": str(tmp / "cache"), "PYTHONUNBUFFERED": "1"}
        # As installed: pip compiles a package's bytecode at install; with PYTHONDONTWRITEBYTECODE
        # set (as on these machines) every process would compile moetrace's ~250 modules again.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        first = run_process(_moetrace() + ["index", str(root), "--tp", "2", "-o", str(tmp / "first.parquet"),
                                           "--json"], env)  # reads the config through transformers, once
        read_with_cat(root)
        result = {"cpu": cpu_description(), "layers": layers, "experts": experts, "hidden": args.hidden,
                  "intermediate": args.intermediate, "checkpoint_bytes": nbytes, "write_s": round(t_write, 1),
                  "first_run_with_transformers_s": round(first["wall_s"], 3),
                  "tp": [bench_tp(root, int(tp), rounds, env, tmp / f"tp{tp}.parquet") for tp in args.tp.split(",")]}
        result["ceiling"] = bench_ceiling(root, rounds)
        result["light"] = bench_light(root, env, tmp, 5)
        result["load_average"] = os.getloadavg()
    finally:
        if not (args.keep and args.workdir):
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return
    print(result["cpu"])
    print(f"checkpoint: {layers} layer(s) x {experts} experts, H {args.hidden}, I {args.intermediate}, FP8 + BF16 "
          f"block scales, {nbytes / 1e9:.2f} GB (written in {t_write:.0f} s); "
          f"load average {result['load_average'][0]:.1f}")
    for r in result["tp"]:
        t = r["timings"]
        print(f"TP{r['tp']}: cat of the files {r['read_s']:.2f} s ({r['read_GBps']:.1f} GB/s); moetrace index "
              f"process {r['index_s']:.2f} s ({r['index_GBps']:.1f} GB/s) = {r['index_vs_read']:.2f}x the read "
              f"(rounds {r['index_vs_read_rounds']}), {r['index_vs_fastest_read']:.2f}x the fastest one-thread read "
              f"({r['fastest_read_s']:.2f} s); {r['cores_busy']:.2f} cores busy; CPU seconds: cat "
              f"{r['read_cpu_s']:.2f}, index {r['index_cpu_s']:.2f} (with its workers)")
        print(f"  where it goes: start-up, imports, exit {r['startup_imports_exit_s']:.2f} s; build "
              f"{t['build_s']:.2f} s on {t['workers']} worker(s), their CPU seconds: contiguous pieces read and "
              f"hashed {t.get('in_place_s', 0):.2f}, column cuts read, gathered and hashed "
              f"{t.get('column_cuts_s', 0):.2f}; Parquet write and copy {t['write_s']:.2f} s")
        print(f"  peak memory of the process and its workers: {r['peak_anon_mib']} MiB own (anonymous), "
              f"{r['peak_rss_mib']} MiB resident (with any file pages mapped)")
    c = result["ceiling"]
    print(f"ceiling: {c['processes']} processes reading and hashing every byte (no plans, no cuts, no start-up): "
          f"with pread {c['pread_vs_read']:.2f}x the read (rounds {c['pread_vs_read_rounds']}), through a mapping "
          f"{c['mapped_vs_read']:.2f}x (rounds {c['mapped_vs_read_rounds']})")
    light = result["light"]
    print(f"process wall: moetrace --help {light['help_s']:.3f} s, hook-spec {light['hook_spec_s']:.3f} s, index "
          f"from the cache {light['index_cache_hit_s']:.3f} s (python + the index's imports alone "
          f"{light['python_and_index_imports_s']:.3f} s); first index of this config.json (transformers) "
          f"{result['first_run_with_transformers_s']:.2f} s")


if __name__ == "__main__":
    main()
