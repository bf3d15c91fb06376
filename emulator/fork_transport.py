"""transport="fork": the emulated server stages its layers through the installed
fork's own ``SharedFullContext`` (compiled from sglang-kt's file, under the
simulated CUDA runtime), with kt-kernel's writer on rank 0 when it runs here.

The emulator keeps its model, engine, HTTP front and hooks; only the staged
load is the fork's. The slow peer is the schedule of ``slow_peer.SlowPeer``
restricted to ``slow_rank``'s copies of ``slow_tensor``; ``fence="all"`` is
the seed PR's fence patched into the class. CPU only (the CUDA runtime is
simulated). demo and selftest ask for "auto": the fork where it is installed,
else the emulator's own staging, and they say which ran.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetrace.errors import MoetraceError

TRANSPORTS = ("emulator", "fork", "auto")


def resolve_transport(requested: str, device: str, fork_path: str | None = None) -> tuple[str, str]:
    """("fork" | "emulator", what stages the layers, in words) for a requested transport."""
    from moetrace.conform.fork import ForkError, find_fork

    own = "the emulator's own SharedFullContext"
    if requested not in TRANSPORTS:
        raise MoetraceError(f"transport must be one of {', '.join(TRANSPORTS)}, got {requested!r}")
    if requested == "emulator":
        return "emulator", own
    if device != "cpu":
        if requested == "fork":
            raise MoetraceError("transport fork runs on CPU only: the fork's CUDA calls go to a simulated runtime")
        return "emulator", f"{own} (fallback: on {device} the fork's code cannot run, its CUDA runtime is simulated)"
    try:
        src = find_fork(fork_path)
    except ForkError as err:
        if requested == "fork":
            raise
        return "emulator", f"{own} (fallback: {err})"
    return "fork", f"sglang-kt {src.version}'s own SharedFullContext under moetrace's simulated CUDA runtime"


class ForkContext:
    """The fork's context as the emulator's KTEPWrapperMethod and snapshots use it:
    ``load`` (through the class, so moetrace's capture sees it), ``gpu_layer``,
    ``load_count``, ``last_load_ms``, ``fence``."""

    def __init__(self, ctx, schedule, fence: str):
        self.ctx, self.schedule, self.fence = ctx, schedule, fence
        self.load_count = 0
        self.last_load_ms = 0.0

    @property
    def gpu_layer(self):
        return self.ctx.gpu_layer

    def load(self, layer_idx, wrapper, original_layer=None, gpu_experts_mask=None, logical_to_gpu_index=None):
        self.schedule.begin_load()
        self.load_count += 1
        t0 = time.perf_counter()
        with torch.no_grad():  # SGLang's scheduler loop runs forward passes under no_grad
            self.ctx.load(layer_idx=layer_idx, wrapper=wrapper, original_layer=original_layer,
                          gpu_experts_mask=gpu_experts_mask, logical_to_gpu_index=logical_to_gpu_index)
        self.last_load_ms = (time.perf_counter() - t0) * 1000.0


@dataclass
class ForkTransport:
    ctx: ForkContext
    wrappers: dict  # layer -> rank 0's writer (empty elsewhere)
    writer: str  # what writes rank 0's host slots, in words
    all_reduce: object  # the model's TP all-reduce, through the schedule
    schedule: object
    runtime: object
    control: object = None

    def close(self) -> None:
        self.schedule.close()
        self.runtime.close()
        if self.control is not None:
            self.control.close()


def _control(prefix: str, rank: int, world: int):
    """The slow-peer control block: rank 0 creates it, the peers attach, then the name goes."""
    from moetrace.conform.slow_peer import Control

    ctl = Control(f"{prefix}_sp", world, create=True) if rank == 0 else None
    dist.barrier()
    if rank != 0:
        ctl = Control(f"{prefix}_sp", world)
    dist.barrier()
    if rank == 0:
        ctl.shm.unlink()
    return ctl


def build_fork_transport(cfg, prefix: str, rank: int, world: int, gpu_layer, weights, layers: list[int],
                         mask: torch.Tensor | None) -> ForkTransport:
    """Collective: every rank compiles the fork's class, builds its context around
    ``gpu_layer`` (the fork's own host-slot setup) and rank 0 its writers."""
    from moetrace.conform import env as fork_env
    from moetrace.conform import fence, sim_cuda, slow_peer
    from moetrace.conform import rank as fork_rank
    from moetrace.conform.fork import compile_fork, find_fork, find_kt_kernel
    from moetrace.conform.requirements import derive

    # kt-kernel prints from C++ (also at exit): to stderr, so the rank never writes the
    # command's stdout (demo --json).
    sys.stdout.flush()
    os.dup2(2, 1)
    kt_path, _ = find_kt_kernel()
    if kt_path and kt_path not in sys.path:
        sys.path.append(kt_path)
    fork_env.block_sglang_imports()
    src = find_fork(cfg.fork_path)
    runtime = sim_cuda.SimRuntime(rank, cfg.op_timeout_s)
    control = None
    if cfg.slow_rank is not None and world > 1:
        control = _control(prefix, rank, world)
        schedule = slow_peer.SlowPeer(control, rank, world, runtime, cfg.op_timeout_s,
                                      slow_ranks={cfg.slow_rank}, tensors={cfg.slow_tensor})
    else:
        schedule = slow_peer.NoSchedule(runtime)
    provided, modules, _ = fork_env.fork_namespace(runtime, schedule)
    def fence_fp8(node, ns):  # the fork's FP8 block staging method, as its load dispatches it
        return fence.patch_fence(node, [derive(node).dispatch["fp8_block"]], ns)

    compiled = compile_fork(src, provided, modules, patch=fence_fp8 if cfg.fence == "all" else None)
    ctx = fork_rank.build_context(compiled, gpu_layer)
    schedule.attach_slots(ctx.cpu_buffers)
    wrappers, writer = {}, "none (only rank 0 writes)"
    n = weights.dims.num_experts
    mask = mask if mask is not None else torch.zeros(n, dtype=torch.bool)
    if rank == 0:
        for L in layers:
            w, writer, _ = fork_rank.rank0_writer(
                cfg.writer, cfg.weights.checkpoint, "fp8_block", L, n, weights.dims.hidden, weights.dims.intermediate,
                mask, lambda L=L: [weights.layer_shards(L, r) for r in range(world)], ctx.weight_names)
            wrappers[L] = schedule.observe_writer(w)
    dist_mod = modules["torch.distributed"]
    return ForkTransport(ForkContext(ctx, schedule, cfg.fence), wrappers, writer,
                         lambda t: dist_mod.all_reduce(t), schedule, runtime, control)
