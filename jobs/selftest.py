"""`moetrace selftest`: prove, on the machine at hand, that the harness would
have caught the staging race.

Three proofs and a measurement, each a plain function returning a Proof:
1. fingerprint agreement: the device path equals the CPU path bit for bit, and
   single-bit flips and chunk swaps change the digest;
2. detector: the emulated TP2 KT staging transport on this device is caught
   unfenced (E+2 verdict on rank 1's w2 scales) and passes fenced with full
   coverage, on the same injected schedule;
3. throughput ratios measured in this run: a measurement, reported as [INFO], never a
   pass (it has no floor that would hold on every machine), a failure only if it crashed.
Exit 0 when every proof holds, 1 when one failed, 2 when it could not run.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from moetrace import fingerprint as F
from moetrace.errors import ExitCode
from moetrace.jobs import pair
from moetrace.jobs.progress import Progress
from moetrace.jobs.timing import best_of
from moetrace.schema import dtype_name


@dataclass
class Proof:
    name: str
    ok: bool | None  # None: could not run; a measurement: True when it ran
    detail: str
    seconds: float = 0.0
    data: dict = field(default_factory=dict)
    kind: str = "proof"  # or "measurement": reported, never a pass

    @property
    def mark(self) -> str:
        if self.ok and self.kind == "measurement":
            return "INFO"
        return {True: "PASS", False: "FAIL", None: "SKIP"}[self.ok]

    def line(self) -> str:
        return f"[{self.mark}] {self.name:12s} {self.detail} ({self.seconds:.1f} s)"


class CannotRun(Exception):
    """The proof could not run here (no CUDA, not enough memory...)."""


def _timed(name: str, fn: Callable[[], tuple[bool, str, dict]]) -> Proof:
    t0 = time.perf_counter()
    try:
        ok, detail, data = fn()
    except CannotRun as err:
        return Proof(name, None, str(err), time.perf_counter() - t0)
    except Exception as err:  # a crash inside a proof is a failed proof, with its reason
        tb = traceback.format_exception_only(type(err), err)[-1].strip()
        return Proof(name, False, f"crashed: {tb}", time.perf_counter() - t0)
    return Proof(name, ok, detail, time.perf_counter() - t0, data)


def check_device(device: str) -> torch.device:
    if device == "cuda":
        if not torch.cuda.is_available():
            raise CannotRun("--device cuda: torch sees no CUDA device on this machine")
        return torch.device("cuda")
    return torch.device("cpu")


# ----------------------------------------------------------- 1. fingerprints


def _agreement_cases(quick: bool) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    c = F.CHUNK_BYTES
    sizes = [1, 7, 13, c // 4 - 1, c // 4, c // 4 + 3, 3 * c // 4 + 5]
    if not quick:
        sizes += [5 * c // 4 + 1, 2 * c]
    cases = []
    for dtype in (torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.float16, torch.uint8):
        for n in sizes:
            base = torch.randint(0, 256, (n * 4,), dtype=torch.uint8, generator=g)
            t = base.view(dtype)[:n]
            cases.append((f"{dtype_name(dtype)}[{n}]", t))
        mat = torch.randint(0, 256, (37, 129 * dtype.itemsize), dtype=torch.uint8, generator=g).view(dtype)
        cases.append((f"{dtype_name(dtype)}[37,129].T (non-contiguous)", mat.t()))
        cases.append((f"{dtype_name(dtype)}[37,129][:, 3:100] (strided)", mat[:, 3:100]))
    return cases


def device_methods(dev: torch.device) -> list[str]:
    """The fingerprint paths this device runs: its default first (Triton on CUDA
    where installed, xxhash on the CPU), then the torch fallback."""
    first = F.default_method(dev)
    return [first] + [m for m in ("torch",) if m != first]


def prove_fingerprint(device: str, quick: bool,
                      on_device: Callable[[torch.Tensor], F.Fingerprint] | None = None) -> Proof:
    """``on_device(t)``: the device path under proof (default: every path `device` runs)."""

    def run():
        dev = check_device(device)
        methods = ["injected"] if on_device else device_methods(dev)
        paths = {"injected": on_device} if on_device else {
            m: (lambda t, m=m: F.fingerprint(t.to(dev), m)) for m in methods}
        mismatches, checked = [], 0
        for label, t in _agreement_cases(quick):
            cpu = F.fingerprint(t, "xxhash")
            for method, device_fp in paths.items():
                checked += 1
                if cpu != device_fp(t):
                    mismatches.append(f"{label} ({method})")
        # rows of a [E, ...] parameter, as the capture hook fingerprints them
        w = torch.randint(0, 256, (8, 96, 1000), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        w = w.view(torch.float8_e4m3fn)
        want = F.fingerprint_rows(w, "xxhash")
        for method in methods if not on_device else []:
            checked += 1
            if F.fingerprint_rows(w.to(dev), method) != want:
                mismatches.append(f"fingerprint_rows float8_e4m3fn[8,96,1000] ({method})")
        checked += 1  # the chunk digests the guard compares on the device = the host's
        on_dev = F.row_chunk_digests(F.row_bytes(w.to(dev))).cpu().numpy()
        if not np.array_equal(on_dev, F.row_chunk_digests(F.row_bytes(w), "xxhash").numpy()):
            mismatches.append("the guard's chunk digests of fingerprint_rows on the device")
        sensitivity = _sensitivity(dev)
        ok = not mismatches and not sensitivity
        where = f"{'CUDA' if dev.type == 'cuda' else 'CPU'} {'+'.join(methods)}"
        detail = (
            f"fp_version {F.FP_VERSION}, {checked} cases: {where} digests equal the CPU reference bit for bit; "
            "bit flips and chunk swaps change them"
            if ok
            else "; ".join(filter(None, [f"{where} != CPU for {', '.join(mismatches[:5])}" if mismatches else "",
                                         sensitivity]))
        )
        return ok, detail, {"cases": checked, "mismatches": mismatches, "methods": methods, "fp_version": F.FP_VERSION}

    return _timed("fingerprint", run)


def _sensitivity(dev: torch.device) -> str:
    x = torch.randint(0, 256, (3 * F.CHUNK_BYTES + 11,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    base = F.fingerprint(x.to(dev))
    for pos in (0, 7, F.CHUNK_BYTES - 1, F.CHUNK_BYTES + 3, x.numel() - 1):
        for bit in (0, 7):
            y = x.clone()
            y[pos] ^= 1 << bit
            if F.fingerprint(y.to(dev)) == base:
                return f"flip of bit {bit} at byte {pos} not seen"
    c = F.CHUNK_BYTES
    swapped = torch.cat([x[c : 2 * c], x[:c], x[2 * c :]])
    if F.fingerprint(swapped.to(dev)) == base:
        return "swapped chunks not seen"
    return ""


# ----------------------------------------------------------- 3. throughput


def measure_throughput(device: str, quick: bool) -> Proof:
    def run():
        dev = check_device(device)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        mib = 32 if quick else 256
        n = mib << 20
        x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).to(dev)
        dst = torch.empty_like(x)
        reps = 2 if quick else 3
        t_copy = best_of(lambda: dst.copy_(x), reps, sync)
        t_fp = best_of(lambda: F.fingerprint(x), reps, sync)
        # on the CPU only its own path (xxhash) is timed: the torch path there is a test vehicle (~0.02 GB/s)
        timed = device_methods(dev) if dev.type == "cuda" else [F.default_method(dev)]
        t_paths = {m: best_of(lambda m=m: F.fingerprint(x, m), reps, sync) for m in timed}
        t_sha = best_of(lambda: hashlib.sha256(x.cpu().numpy().tobytes()).digest(), reps, sync)
        data = {
            "bytes": n,
            "fingerprint_GBps": n / t_fp / 1e9,
            "copy_GBps": n / t_copy / 1e9,
            "sha256_host_GBps": n / t_sha / 1e9,
            "fingerprint_vs_copy": t_copy / t_fp,
            "fingerprint_vs_sha256_host": t_sha / t_fp,
            **{f"fingerprint_{m}_vs_copy": t_copy / t for m, t in t_paths.items()},
        }
        data.update(_capture_cost(dev, quick, sync))
        detail = (
            f"fingerprint {data['fingerprint_GBps']:.2f} GB/s = {data['fingerprint_vs_copy']:.2f}x a same-device copy, "
            f"{data['fingerprint_vs_sha256_host']:.2f}x copy-to-host+sha256; capture of one "
            f"{data['capture_layer']} layer-load costs {data['capture_vs_load_copies']:.2f}x its copies"
        )
        return True, detail, {k: round(v, 4) if isinstance(v, float) else v for k, v in data.items()}

    proof = _timed("throughput", run)
    proof.kind = "measurement"
    return proof


def _capture_cost(dev: torch.device, quick: bool, sync) -> dict:
    """Capture cost of one layer-load (all experts' four tensors) vs the load's own copies."""
    e, h, i_tp = (32, 1024, 256) if quick else (256, 3072, 512)
    g = torch.Generator().manual_seed(3)
    shapes = {"w13_weight": (e, 2 * i_tp, h), "w13_weight_scale_inv": (e, 2 * i_tp // 128, h // 128),
              "w2_weight": (e, h, i_tp), "w2_weight_scale_inv": (e, h // 128, i_tp // 128)}
    src, dst = {}, {}
    for name, shape in shapes.items():
        if "scale" in name:
            src[name] = torch.rand(shape, generator=g).to(dev)
        else:
            src[name] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn).to(dev)
        dst[name] = torch.empty_like(src[name])

    def copies():
        for name in shapes:
            dst[name].copy_(src[name])

    def capture():
        # as the capture hook runs it: chunk digests on the device, tensor digests on the host
        chunks = [F.row_chunk_digests(F.row_bytes(t)) for t in src.values()]
        for t, c in zip(src.values(), chunks):
            F.finalize(c, F.row_bytes(t).shape[1])

    reps = 2 if quick else 3
    t_copy = best_of(copies, reps, sync)
    t_cap = best_of(capture, reps, sync)
    label = f"E={e} H={h} I_tp={i_tp}"
    return {"capture_layer": label, "capture_vs_load_copies": t_cap / t_copy,
            "layer_bytes": sum(t.numel() * t.element_size() for t in src.values())}


# ----------------------------------------------------------- 2. detector


def prove_detector(device: str, quick: bool, workdir: Path, progress: Progress | None = None) -> Proof:
    def run():
        check_device(device)
        res = pair.detector_proof(workdir, device=device, quick=quick, progress=progress)
        return res["ok"], res["detail"], res

    return _timed("detector", run)


# ----------------------------------------------------------- driver


PARTS = ("fingerprint", "detector", "throughput")
LABELS = {"fingerprint": "fingerprint paths against the CPU reference",
          "detector": "the detector on the emulated unfenced/fenced pair",
          "throughput": "measuring fingerprint and capture throughput"}


def run_selftest(device: str = "cpu", quick: bool = False, workdir: str | None = None,
                 only: tuple[str, ...] = PARTS, on_proof: Callable[[Proof], None] | None = None,
                 progress: Progress | None = None) -> tuple[int, list[Proof]]:
    """Run the parts in order; ``on_proof(p)`` as each one ends (the CLI prints it then),
    ``progress``: a live line while each runs."""
    progress = progress or Progress.off()
    proofs: list[Proof] = []
    with tempfile.TemporaryDirectory(prefix="moetrace-selftest-") as tmp:
        root = Path(workdir) if workdir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for part in (p for p in PARTS if p in only):
            with progress.step(f"selftest: {LABELS[part]}"):
                if part == "fingerprint":
                    proof = prove_fingerprint(device, quick)
                elif part == "detector":
                    proof = prove_detector(device, quick, root, progress)
                else:
                    proof = measure_throughput(device, quick)
            proofs.append(proof)
            if on_proof is not None:
                on_proof(proof)
    if any(p.ok is False for p in proofs):
        return ExitCode.DIVERGENT, proofs  # a proof failed
    if any(p.ok is None for p in proofs):
        return ExitCode.INCOMPLETE, proofs  # a proof could not run here
    return ExitCode.PASS, proofs


def verdict_line(code: int, proofs: list[Proof], device: str) -> str:
    if code == ExitCode.PASS:
        measured = [p.name for p in proofs if p.kind == "measurement"]
        return f"selftest PASSED on {device}: every proof holds" + (f" ({', '.join(measured)}: measured, not judged)"
                                                                     if measured else "")
    if code == ExitCode.DIVERGENT:
        failed = ", ".join(p.name for p in proofs if p.ok is False)
        return f"selftest FAILED on {device}: {failed}"
    blocked = "; ".join(f"{p.name}: {p.detail}" for p in proofs if p.ok is None)
    return f"selftest could not run on {device}: {blocked}"


def as_json(code: int, proofs: list[Proof], device: str) -> dict:
    return {
        "selftest_version": 1,
        "device": device,
        "device_name": (torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available()
                        else os.uname().machine),
        "torch": torch.__version__,
        "exit_code": int(code),
        "verdict": verdict_line(code, proofs, device),
        "proofs": [asdict(p) for p in proofs],
    }
