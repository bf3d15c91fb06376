#!/usr/bin/env bash
# One command for a session that is lent a GPU machine: proofs + GPU benchmarks,
# everything collected under one folder, a summary table at the end.
#
#   bash bench/gpu_selftest.sh [OUT_DIR]        (default: $OUT if set, else ./gpu-results)
#
# Runs with the machine's own python3 and torch (CUDA build). moetrace is used
# from this checkout without installing it (a symlink named moetrace on
# PYTHONPATH). Missing pure-Python packages are installed from ./.whl when that
# folder exists (carried wheels: see docs/selftest.md), else from the index.
# DRY_RUN=1 prints the steps and runs the CPU variants (what CI tests).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$here/gpu-results}}
mkdir -p "$out"
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
[ "${DRY_RUN:-0}" = 1 ] && device=cpu

site=$(mktemp -d)
ln -s "$here" "$site/moetrace"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

missing=$("$py" - <<'PY'
import importlib.util
need = ["numpy", "torch", "safetensors", "pyarrow", "pandas", "click", "matplotlib", "xxhash"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
  echo "installing: $missing" | tee "$out/install.log"
  if [ -d "$here/.whl" ]; then
    "$py" -m pip install -q --no-index --no-deps --target "$site/deps" "$here"/.whl/*.whl >>"$out/install.log" 2>&1
    export PYTHONPATH="$PYTHONPATH:$site/deps"
  else
    "$py" -m pip install -q $missing >>"$out/install.log" 2>&1
  fi
fi

quick=""
[ "${QUICK:-0}" = 1 ] && quick="--quick"
run() {  # name, command...
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" >"$out/$name.out" 2>"$out/$name.err"
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$out/steps.txt"
}
: >"$out/steps.txt"
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$out/env.txt"
# SELFTEST_ONLY=a,b: only those proofs (the test suite's dry run leaves the detector to the
# demo pair it already runs; see tests/test_selftest.py).
only=""
for part in ${SELFTEST_ONLY//,/ }; do only="$only --only $part"; done
run selftest "$py" -m moetrace.cli selftest --device "$device" $quick $only --json
run bench_fingerprint "$py" "$here/bench/bench_fingerprint.py" --device "$device" --json $quick
run bench_capture "$py" "$here/bench/bench_capture.py" --device "$device" $quick
# `moetrace index --device cuda`: pinned buffers to the kernel; its rows must equal the CPU index's.
index_experts=32
[ "${DRY_RUN:-0}" = 1 ] && index_experts=4
run index_device "$py" "$here/bench/index_device_check.py" --device "$device" --experts $index_experts
run bench_fence "$py" "$here/bench/bench_fence.py" --device "$device" $quick
# The guard on one full Qwen3.5-122B layer-load (256 experts; 2 in a dry run): target <= 2% of the pinned H2D copy.
guard_size=""
[ "${DRY_RUN:-0}" = 1 ] && guard_size="--experts 2"
run bench_guard "$py" "$here/bench/bench_guard.py" --device "$device" --no-emulated --json $guard_size

"$py" - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("\n| check | result |\n| --- | --- |")
try:
    st = json.loads((out / "selftest.out").read_text())
    print(f"| selftest | exit {st['exit_code']}: {st['verdict']} |")
    for p in st["proofs"]:
        mark = ('INFO' if p.get('kind') == 'measurement' else 'PASS') if p['ok'] else 'FAIL' if p['ok'] is False else 'SKIP'
        print(f"| {p['name']} | {mark}: {p['detail']} |")
except Exception as err:
    print(f"| selftest | no JSON ({err}) |")
try:
    fp = json.loads((out / "bench_fingerprint.out").read_text())
    for k, v in fp["GBps"].items():
        print(f"| {k} | {v} GB/s |")
    for k, v in fp["ratios"].items():
        print(f"| {k} | {v}x |")
    r = fp["ratios"].get("fingerprint_triton_cuda_vs_copy_d2d")
    verdict = "no Triton on this machine" if r is None else f"{r}x: {'MET' if r >= 0.5 else 'NOT MET'}"
    print(f"| GPU target: fused Triton fingerprint >= 0.5x a device-to-device copy (fp_version {fp.get('fp_version')}) | {verdict} |")
except Exception as err:
    print(f"| bench_fingerprint | no JSON ({err}) |")
try:
    g = json.loads((out / "bench_guard.out").read_text())
    lay = g["layer"]
    print(f"| guard per layer-load ({g['experts']} experts, {lay['bytes'] / 1e9:.2f} GB) | "
          + ", ".join(f"{k} {v} ms" for k, v in lay["ms"].items()) + " |")
    r = lay["ratios"].get("guard_vs_copy_h2d_pinned")
    verdict = (f"no CUDA: {lay['ratios'].get('guard_vs_copy')}x a device copy" if r is None
               else f"{r:.2%} of the pinned H2D copy: {'MET' if r <= 0.02 else 'NOT MET'}")
    print(f"| GPU target: guard <= 2% of a 122B layer-load | {verdict} |")
except Exception as err:
    print(f"| bench_guard | no JSON ({err}) |")
try:
    ix = json.loads((out / "index_device.out").read_text())
    same = ix.get("device_index_equals_cpu")
    print(f"| index on {ix['device']} ({ix['experts']} experts, TP2, {ix['rows']} rows) | rows equal the CPU index: "
          f"{'n/a (CPU run)' if same is None else 'YES' if same else 'NO'} |")
except Exception as err:
    print(f"| index_device | no JSON ({err}) |")
for name in ("bench_capture", "bench_fence"):
    tail = (out / f"{name}.out").read_text().strip().splitlines()[-3:] if (out / f"{name}.out").exists() else ["missing"]
    print(f"| {name} | {' / '.join(tail)} |")
PY
