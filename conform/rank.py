"""One TP rank of `moetrace conform`: the installed fork's SharedFullContext,
driven as KTEPWrapperMethod._build_full_context drives it, on CPU.

Per case: compile the class (optionally with the seed PR's fence patched in),
build a context around a FusedMoE-shaped layer without ``_build_layers`` (that
needs SGLang's quant methods), let the fork's own code detect the format and
create its POSIX shared-memory host slots, give rank 0 its writer (kt-kernel's
when it imports, else moetrace's), wrap ``load`` with moetrace's KT capture
(the real hook factory), call ``load`` under ``no_grad`` like SGLang's
scheduler, and close the trace.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moetrace.conform.kt_wrapper import KT_METHODS, kt_wrapper
from moetrace.conform.writer import staged_shards

FORK_FORMATS = {"fp8": "fp8_block", "fp8_channel": "fp8_channel", "bf16": "bf16", "mxfp4": "mxfp4", "mxfp8": "mxfp8"}


@dataclass(frozen=True)
class RankCase:
    """One load to run, as every rank receives it."""

    run_id: str
    fmt: str
    schedule: str  # "slow-peer" | "none"
    fence_methods: tuple[str, ...]  # --patch-fence: the staging methods to fence (empty: as installed)
    writer: str  # "kt-kernel" | "moetrace"
    checkpoint: str
    checkpoint_id: str
    traces: str
    layer: int
    experts: int
    hidden: int
    intermediate: int
    gpu_experts: tuple[int, ...]  # the resident mask handed to load (FP8 ignores it; BF16 copies them first)
    fork_file: str
    fork_version: str
    index: str | None = None  # the guard verifies every load against it on the rank's device (None: off)
    guard_rows: str = "all"  # "all": the whole trace for the analysis; "mismatch": production's rows
    writer_note: str = ""  # why moetrace's writer stands in (said in the writer's words)
    group_size: int | None = None  # int4: the checkpoint's group size (the quant params the fork resolves)


@dataclass(frozen=True)
class RankJob:
    tp: int
    store: str  # torch.distributed FileStore path
    control: str | None  # shared-memory name of the slow-peer Control block
    results: str  # folder for rank<r>.json and rank<r>.log
    kt_path: str | None  # folder appended to sys.path for kt_kernel
    kt_version: str | None
    timeout_s: float
    cases: tuple[RankCase, ...] = ()


@dataclass
class CaseFacts:
    run_id: str
    writer: str  # what wrote rank 0's host slots, in words
    writer_kind: str  # "kt-kernel" | "moetrace" | "none" (rank > 0)
    fork_format: str
    patched: list[str]
    placeholders: list[str]
    affinity: list
    seconds: dict = field(default_factory=dict)
    marlin: dict | None = None  # int4: what ran after staging (conform.marlin): the repack's calls, the permute's file


class StagedLayer(torch.nn.Module):
    """The layer SharedFullContext stages into: FusedMoE's param names, this
    rank's shapes (from the expected shards), zeros; ranks like FusedMoE's."""

    def __init__(self, shapes: dict, tp: int, rank: int, num_experts: int, layer_id: int):
        super().__init__()
        for name, (shape, dtype) in shapes.items():
            setattr(self, name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
        self.num_experts = self.num_local_experts = self.num_gpu_experts = num_experts
        self.layer_id = layer_id
        self.moe_tp_size, self.moe_tp_rank, self.moe_ep_size, self.moe_ep_rank = tp, rank, 1, 0


class QuantMethodStandIn:
    """ctx.gpu_method: on the paths conform runs the fork reads only its class name, and
    for INT4 the quant params CompressedTensorsWNA16MoE keeps (_resolve_int4_quant_params)."""

    def __init__(self, group_size: int | None = None):
        if group_size is not None:  # a symmetric W4A16 group scheme without activation order
            self.num_bits, self.packed_factor, self.group_size, self.actorder = 4, 8, group_size, None
            self.strategy = "group"


def build_context(compiled, layer: torch.nn.Module, group_size: int | None = None):
    """The fork's own ``__init__`` around `layer`, with ``_build_layers`` (which needs
    SGLang's quant methods and create_weights) replaced: it installs the layer, runs the
    fork's own format detection and keeps what 0.7.x's keeps; the rest of ``__init__``
    (original params, host-slot setup, whatever the release does) is the fork's."""

    from moetrace.conform.requirements import detection_calls

    cls, detect = compiled.cls, detection_calls(compiled.cls_node)

    def _build_layers(self, layer_, init_args, global_num_experts, moe_runner_config):
        self._global_num_experts = global_num_experts
        self.gpu_layer = layer_
        self.gpu_method = QuantMethodStandIn(group_size)
        for name in detect:  # what the fork's _build_layers runs once create_weights made the params
            getattr(self, name)()
        for attr in ("is_mxfp4_quant", "is_mxfp8_quant", "is_fp8_quant", "is_fp8_channel_quant", "is_bf16_quant"):
            if hasattr(self, attr):  # 0.7.x's _build_layers freezes both spellings
                setattr(self, f"_{attr}", getattr(self, attr))
        names = getattr(self, "weight_names", None) or ()
        self._raw_weight_shapes = {n: (tuple(getattr(layer_, n).shape), getattr(layer_, n).dtype,
                                       getattr(layer_, n).device) for n in names if hasattr(layer_, n)}

    cls._build_layers = _build_layers  # a fresh class per compile: nothing else sees this
    return cls(layer=layer, init_args=(), global_num_experts=layer.num_experts, moe_runner_config=None)


def fork_format(ctx) -> str:
    on = [f for f in FORK_FORMATS if getattr(ctx, f"_is_{f}_quant", False)]
    return FORK_FORMATS[on[0]] if len(on) == 1 else ("int4" if not on else "+".join(on))


def writer_name(kt_version: str | None, fmt: str) -> str:
    return f"kt-kernel {kt_version or '?'}'s {KT_METHODS.get(fmt, fmt)} writer"


def set_phase(job: "RankJob", rank: int, what: str, fmt: str = "") -> None:
    """Name the native code rank 0 is running (kt-kernel's writer for `fmt`) in
    results/rank0.phase, so a death by a signal is blamed on it, not on the fork
    (jobs/conform.py)."""
    if rank == 0:
        (Path(job.results) / "rank0.phase").write_text(json.dumps({"what": what, "fmt": fmt}))


def rank0_writer(want: str, checkpoint: str, fmt: str, layer: int, experts: int, hidden: int, intermediate: int,
                 mask: torch.Tensor, all_shards, names):
    """(writer, words, kind): kt-kernel's when asked for and it runs here, else moetrace's
    (all_shards() gives every rank's shards of the layer)."""
    why = ""
    if want == "kt-kernel":
        w, words = kt_wrapper(checkpoint, fmt, layer, experts, hidden, intermediate, mask)
        if w is not None:
            return w, words, "kt-kernel"
        why = f" because {words}"
    return moetrace_writer(all_shards(), names), f"moetrace's emulator writer{why}", "moetrace"


def moetrace_writer(shards: list[dict], names):
    from moetrace.conform.writer import KTWrapperStandIn, NativeWriter

    return KTWrapperStandIn(-1, NativeWriter(60.0), shards, names)


def run_case(case: RankCase, job: RankJob, rank: int, runtime, control, kt_cache: dict,
             contexts: list) -> CaseFacts:
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.shards import Parallel, expected_layer
    from moetrace.conform import env as fork_env
    from moetrace.conform import fence, fork, slow_peer
    from moetrace.hooks.sglang_hook import make_hook

    world, t = job.tp, {"start": time.perf_counter()}
    schedule = (slow_peer.SlowPeer(control, rank, world, runtime, job.timeout_s) if case.schedule == "slow-peer"
                else slow_peer.NoSchedule(runtime))
    provided, modules, env = fork_env.fork_namespace(runtime, schedule)
    src = fork.InstalledFork(Path(case.fork_file), case.fork_version, "")
    repack = permute_from = None
    if case.fmt == "int4":  # SGLang's own scale permute, the repack as a recorded identity (conform.marlin)
        from moetrace.conform import marlin

        permute_from, repack = marlin.permute_source(src.path, src.version), marlin.RepackIdentity()
        provided.update(marlin.provided(runtime, repack, marlin.compile_permute(permute_from), src.path))
    methods = list(case.fence_methods)
    compiled = fork.compile_fork(src, provided, modules,
                                   patch=(lambda node, ns: fence.patch_fence(node, methods, ns)) if methods else None)
    t["compile"] = time.perf_counter()

    ckpt = open_checkpoint(case.checkpoint)
    mine = expected_layer(ckpt, case.layer, rank, Parallel(world))
    layer = StagedLayer({n: (tuple(v.shape), v.dtype) for n, v in mine.items()}, world, rank, case.experts, case.layer)
    if repack is not None:
        from moetrace.hooks.layout_facts import MARLIN_REPACK_ATTR

        setattr(layer, MARLIN_REPACK_ATTR, "identity")  # the capture and the layout rules read it
    mask = torch.zeros(case.experts, dtype=torch.bool)
    mask[list(case.gpu_experts)] = True
    l2g = torch.full((case.experts,), -1, dtype=torch.int64)
    l2g[mask] = torch.arange(int(mask.sum()))
    resident = StagedLayer({n: ((int(mask.sum()), *v.shape[1:]), v.dtype) for n, v in mine.items()}, world, rank,
                           int(mask.sum()), case.layer)  # what SGLang's loader put on the GPU for those experts
    with torch.no_grad():
        for n, v in mine.items():
            getattr(resident, n).copy_(v[mask])
    guard = {"index": case.index, "guard": "record", "guard_rows": case.guard_rows} if case.index else {}
    make_hook({"out": case.traces, "run_id": case.run_id, "checkpoint_id": case.checkpoint_id, "tp_rank": rank,
               "tp_size": world, "kt": "auto", "cpu_threads": False, **guard})
    ctx = build_context(compiled, layer, case.group_size)
    fmt = fork_format(ctx)
    if fmt != case.fmt:
        raise fork.ForkError(f"the fork's _detect_quant_type_from_created_weights sees {fmt} for a "
                                    f"{case.fmt} layer: its format detection changed")
    schedule.attach_slots(ctx.cpu_buffers)
    wrapper, writer, kind = None, "none (only rank 0 writes)", "none"
    if rank == 0:
        key = (case.checkpoint, case.writer)
        if key not in kt_cache:  # one writer per checkpoint and process (kt-kernel's loads every expert)
            if case.writer == "kt-kernel":
                set_phase(job, rank, writer_name(job.kt_version, case.fmt), case.fmt)
            kt_cache[key] = rank0_writer(
                case.writer, case.checkpoint, case.fmt, case.layer, case.experts, case.hidden, case.intermediate, mask,
                lambda: staged_shards(case.fmt, [mine] + [expected_layer(ckpt, case.layer, r, Parallel(world))
                                                          for r in range(1, world)]),
                ctx.weight_names)
        w, writer, kind = kt_cache[key]
        if kind == "moetrace" and case.writer_note:
            writer = f"moetrace's emulator writer because {case.writer_note}"
        set_phase(job, rank, writer_name(job.kt_version, case.fmt) if kind == "kt-kernel" else "", case.fmt)
        wrapper = schedule.observe_writer(w)
    t["setup"] = time.perf_counter()
    dist.barrier()
    schedule.begin_load()
    with torch.no_grad():  # SGLang's scheduler loop runs forward passes under no_grad (DynamicGradMode)
        ctx.load(layer_idx=case.layer, wrapper=wrapper, original_layer=resident, gpu_experts_mask=mask,
                 logical_to_gpu_index=l2g)
    t["load"] = time.perf_counter()
    set_phase(job, rank, "")
    modules["torch.distributed"].barrier()  # through the schedule: what is still held completes now
    # Kept alive, not closed: the fork's close() (also run by its __del__) calls gc.collect(),
    # ~0.3 s per case here; it unlinked the shared-memory names right after setup, so the
    # mappings go with the process (os._exit).
    contexts.append(ctx)
    schedule.close()
    t["done"] = time.perf_counter()
    names = list(t)
    seconds = {b: round(t[b] - t[a], 3) for a, b in zip(names, names[1:])}
    marlin_facts = None if repack is None else {
        "judged": marlin.JUDGED,
        "repack": {"stand_in": "identity", **repack.summary()},
        "permute": {"path": str(permute_from.path), "from": permute_from.origin}}
    return CaseFacts(case.run_id, writer, kind, fmt, compiled.patched, compiled.placeholders,
                     env["sched_setaffinity"], seconds, marlin_facts)


def cpu_isa() -> set[str]:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def signal_words(code: int, phase: str, isa: set[str] | None = None) -> tuple[str, str]:
    """(error kind, sentence) for a rank 0 that died by signal -code; `phase`: the native
    code it was running (results/rank0.phase), "" for the fork's own."""
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return "crash", f"rank 0 died by signal {-code}"
    words = (signal.strsignal(sig) or sig.name).lower()
    if not phase:
        return "crash", f"rank 0 died by {sig.name} ({words}) in the fork's code"
    if sig != signal.SIGILL:
        return "writer", f"{phase} died by {sig.name}: {words}"
    isa = cpu_isa() if isa is None else isa
    needs = ("AVX-512" if "avx512f" not in isa else "AMX" if "amx_tile" not in isa
             else "an instruction this CPU lacks")
    have = "AVX2" if "avx512f" not in isa else "AVX-512" if "amx_tile" not in isa else "AVX-512 and AMX"
    return "writer", f"{phase} needs {needs}: {words} (SIGILL; this CPU has {have})"


def _fork_frame(err: BaseException, fork_files: set) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename in fork_files]
    return f" (at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""


def _watch_parent(parent: int) -> None:
    """Exit when the conform command is gone (a killed parent leaves no one to stop us)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def rank_main(rank: int, job: RankJob) -> None:
    """Spawned per rank; writes results/rank<r>.json and exits 0, or 3 on error."""
    started = time.perf_counter()
    out = {"rank": rank, "cases": [], "error": None, "error_kind": None}
    log = os.open(Path(job.results) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)  # kt-kernel prints from C++: keep the command's own output clean
    os.dup2(log, 2)
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), name="conform-watchdog", daemon=True).start()
    try:
        if job.kt_path and job.kt_path not in sys.path:
            sys.path.append(job.kt_path)
        from moetrace.conform import env as fork_env
        from moetrace.conform import sim_cuda, slow_peer

        fork_env.block_sglang_imports()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{job.store}", rank=rank, world_size=job.tp,
                                timeout=timedelta(seconds=job.timeout_s))
        runtime = sim_cuda.SimRuntime(rank, job.timeout_s)
        control = slow_peer.Control(job.control, job.tp) if job.control else None
        cache: dict = {}
        contexts: list = []
        out["startup_s"] = round(time.perf_counter() - started, 3)
        for case in job.cases:
            out["cases"].append(asdict(run_case(case, job, rank, runtime, control, cache, contexts)))
        from moetrace.hooks.sglang_hook import close_all

        t = time.perf_counter()
        if not close_all("conform done"):  # every case's trace at once: one writer tick, not one per case
            raise RuntimeError("a trace did not close cleanly (see the rank log)")
        out["close_s"] = round(time.perf_counter() - t, 3)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as err:
        from moetrace.conform.fork import ForkError
        from moetrace.errors import MoetraceError

        kind = ("layout" if isinstance(err, ForkError) else "refused" if isinstance(err, MoetraceError) else
                "timeout" if type(err).__name__ == "SimTimeout" else
                "peer" if "Connection closed by peer" in str(err) or "Connection reset" in str(err) else "crash")
        frame = _fork_frame(err, {c.fork_file for c in job.cases})
        out["error"] = f"{type(err).__name__}: {' '.join(str(err).split())}{frame}"
        out["error_kind"] = kind
        out["traceback"] = traceback.format_exc()
    path = Path(job.results) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, path)
    sys.stdout.flush()
    os._exit(0 if out["error"] is None else 3)
