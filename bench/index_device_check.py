"""`moetrace index --device DEVICE` against `--device cpu` on one small synthetic checkpoint:
the rows must be equal (the torch path on the GPU, pinned buffers to the fused kernel, against
the CPU path that hashes the files in place). Prints one JSON line; exit 1 when they differ.

    python bench/index_device_check.py --device cuda     (bench/gpu_selftest.sh runs it)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", type=int, default=32)
    args = ap.parse_args()
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory(prefix="moetrace-index-device-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        moetrace = [sys.executable, "-m", "moetrace.cli"]
        subprocess.run(moetrace + ["make-checkpoint", "--family", "qwen3_5_moe", "--format", "fp8_block",
                                   "--experts", str(args.experts), "--hidden", "1024", "--intermediate", "512",
                                   "-o", str(ckpt)], check=True, capture_output=True)
        tables = {}
        for device in ("cpu", args.device):
            out = Path(tmp) / f"{device}.parquet"
            subprocess.run(moetrace + ["index", str(ckpt), "--tp", "2", "--device", device, "--no-cache", "-o",
                                       str(out)], check=True, capture_output=True)
            tables[device] = pq.ParquetFile(out).read()
        cols = ["model", "moe_tp_rank", "layer", "expert", "tensor", "digest", "chunk_digests"]
        same = all(tables["cpu"].column(c).equals(tables[args.device].column(c)) for c in cols)
        print(json.dumps({"device": args.device, "experts": args.experts, "rows": tables["cpu"].num_rows,
                          "device_index_equals_cpu": same if args.device != "cpu" else None}))
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
