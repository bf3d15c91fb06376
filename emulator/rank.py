"""One emulated TP rank: a spawned process (``rank_main``).

Start-up: torch.distributed (gloo; NCCL on CUDA with a GPU per rank), weights
from the weights, host slots (rank 0 creates, peers attach), the model with
its KT wrapper method and the one SharedFullContext, then ``--forward-hooks``
(after the model is ready, as SGLang does). Then one of three jobs:

- ``batch``: run a fixed request list, report results (run_emulation);
- ``serve``: rank 0 serves HTTP and forwards each request to the peers;
- ``bench``: time staged loads of one layer, alternating fence modes.

Messages to the launcher go through ``status_q``: ("ready"|"listening"|
"result"|"error", rank, payload). A rank exits when told to (serve), when its
job is done (batch, bench), when the launcher disappears (watchdog), or on
SIGTERM between requests.
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from moetrace.emulator.config import EmulatorConfig


@dataclass
class RankJob:
    cfg: EmulatorConfig
    mode: str  # "batch" | "serve" | "bench"
    prefix: str  # shared-memory name prefix of the run
    store_path: str  # torch.distributed FileStore
    launcher_pid: int
    requests: tuple = ()  # normalized requests (batch)
    bench: dict | None = None  # {"layer", "repeats", "fences"}


@dataclass
class RankState:
    rank: int
    world: int
    device: torch.device
    runtime: object = None
    fork: object = None  # ForkTransport when cfg.transport == "fork"
    weights: object = None
    ctx: object = None
    wrappers: dict = field(default_factory=dict)
    model: object = None
    engine: object = None
    hooks: list = field(default_factory=list)
    loads: list = field(default_factory=list)  # (load_count, layer, request, ms)
    request_idx: int = -1
    term: threading.Event = field(default_factory=threading.Event)


def _device(cfg: EmulatorConfig, rank: int) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible to this rank")
    if ":" in cfg.device:
        return torch.device(cfg.device)
    return torch.device("cuda", rank % torch.cuda.device_count())


def _init_distributed(job: RankJob, rank: int, world: int, device: torch.device) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if torch.cuda.device_count() >= world:
            backend = "nccl"
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{job.store_path}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=job.cfg.collective_timeout_s), **kw)


def _watch_launcher(job: RankJob, state: RankState) -> None:
    """Exit when the launcher is gone (its SIGKILL leaves no one to stop us)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != job.launcher_pid:
            rt = state.runtime
            if rt is not None and state.rank == 0:
                rt.slots.unlink()
                rt.control.unlink()
            os._exit(3)


def _snapshot(cfg: EmulatorConfig, state: RankState, ctx, layer_idx: int) -> None:
    from safetensors.torch import save_file

    out = os.path.join(cfg.snapshot_dir, f"rank{state.rank}")
    os.makedirs(out, exist_ok=True)
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in ctx.gpu_layer.expert_params().items()}
    meta = {"layer": str(layer_idx), "load": str(ctx.load_count), "request": str(state.request_idx),
            "rank": str(state.rank), "fence": ctx.fence}
    save_file(tensors, os.path.join(out, f"load{ctx.load_count:05d}.safetensors"), metadata=meta)


def build(job: RankJob, state: RankState, with_model: bool = True) -> None:
    from moetrace.emulator.model import (
        EmulatedFusedMoE,
        EmulatedRunner,
        KTConfig,
        KTEPWrapperMethod,
        ServerArgs,
        build_model,
    )
    from moetrace.emulator.staging import SharedFullContext, make_wrappers, open_runtime, slot_layout
    from moetrace.emulator.weights import open_weights

    cfg, rank, world, device = job.cfg, state.rank, state.world, state.device
    weights = state.weights = open_weights(cfg.weights, world)
    dims = weights.dims
    i_tp = dims.i_tp(world)
    layers = list(dims.moe_layers)
    if job.bench is not None:
        layers = [job.bench["layer"]]
    # Resident experts (the model) and rank 0's CPU experts need the shards; a bench peer does not.
    own = {L: weights.layer_shards(L, rank) for L in layers} if with_model or rank == 0 else {}

    gpu_layer = EmulatedFusedMoE(layers[0], dims.num_experts, dims.hidden, i_tp, dims.block, rank, world, device)
    mask = l2g = None
    if cfg.num_gpu_experts:
        mask = torch.zeros(dims.num_experts, dtype=torch.bool)
        mask[: cfg.num_gpu_experts] = True
        l2g = torch.arange(dims.num_experts)
    all_reduce = dist.all_reduce
    if cfg.transport == "fork":
        if job.bench is not None:
            raise ValueError("the staged-load benchmark times the emulator's own transport (transport emulator)")
        from moetrace.emulator.fork_transport import build_fork_transport

        ft = state.fork = build_fork_transport(cfg, job.prefix, rank, world, gpu_layer, weights, layers, mask)
        ctx = state.ctx = ft.ctx
        state.wrappers, all_reduce = ft.wrappers, ft.all_reduce
    else:
        rt = state.runtime = open_runtime(
            rank=rank, world=world, prefix=job.prefix, layout=slot_layout(gpu_layer), fence=cfg.fence, device=device,
            slow_rank=cfg.slow_rank, slow_tensor=cfg.slow_tensor, timeout_s=cfg.op_timeout_s,
            unlink_after_attach=cfg.unlink_after_attach,
        )
        ctx = state.ctx = SharedFullContext(gpu_layer, rt)
        if rank == 0:  # kt-kernel's CPU experts: every rank's shard, on rank 0 only
            cpu = {L: [own[L] if r == 0 else weights.layer_shards(L, r) for r in range(world)] for L in layers}
            state.wrappers = make_wrappers(rt, cpu, cfg.slow_rank, cfg.op_timeout_s)
    if not with_model:
        if cfg.forward_hooks:
            # No model to hook in bench mode, but the factories still run: that
            # is where moetrace's KT capture wraps SharedFullContext.load.
            from moetrace.emulator.forward_hooks import register_forward_hooks

            state.hooks = register_forward_hooks(torch.nn.Module(), cfg.forward_hooks)
        return

    def on_load(c, layer_idx):
        state.loads.append((c.load_count, int(layer_idx), state.request_idx, round(c.last_load_ms, 3)))
        if cfg.snapshot_dir:
            _snapshot(cfg, state, c, layer_idx)

    kt_config = KTConfig(cfg.prefill_threshold, cfg.chunk_tokens)

    def make_experts(L):
        m = EmulatedFusedMoE(L, dims.num_experts, dims.hidden, i_tp, dims.block, rank, world, device)
        m.load_shards(own[L])
        m.quant_method = KTEPWrapperMethod(dims.block, kt_config, ctx, state.wrappers.get(L), mask, l2g,
                                           on_load)
        return m

    def tp_all_reduce(t):
        if world > 1:
            all_reduce(t)  # fork transport: through the schedule, which must see every collective

    state.model = build_model(dims, cfg.seed, make_experts, tp_all_reduce, device)
    from moetrace.emulator.engine import Engine

    state.engine = Engine(state.model, device, cfg.chunk_tokens, cfg.prefix_cache)
    if cfg.forward_hooks:
        from moetrace.emulator.forward_hooks import register_forward_hooks

        # As SGLang's ModelRunner registers its hooks: the hooks read the model path the server
        # loaded from the runner's server_args (no pass counter: steps follow the layer order).
        model_runner = EmulatedRunner(state.model, ServerArgs(cfg.weights.checkpoint, world, cfg.chunk_tokens,
                                                              cfg.prefill_threshold))
        state.hooks = register_forward_hooks(model_runner.model, cfg.forward_hooks)


def _generate(state: RankState, req: dict) -> dict:
    n_before = len(state.loads)
    gen = state.engine.generate(req["prompt_ids"], req["max_tokens"])
    return {"gen": gen, "staged_loads": len(state.loads) - n_before}


def _result_payload(state: RankState, out: dict) -> dict:
    gen = out["gen"]
    return {"prompt_ids": gen.prompt_ids, "output_ids": gen.output_ids, "token0_logits": gen.token0_logits.tolist(),
            "cached_tokens": gen.cached_tokens, "chunks": gen.chunks, "staged_loads": out["staged_loads"]}


def run_batch(job: RankJob, state: RankState, status_q) -> None:
    results = []
    for i, req in enumerate(job.requests):
        state.request_idx = i
        results.append(_result_payload(state, _generate(state, req)))
    if state.world > 1:
        dist.barrier()  # every rank finished before anyone tears down
    status_q.put(("result", state.rank, {"requests": results, "loads": state.loads, "hooks": state.hooks}))


def run_serve(job: RankJob, state: RankState, status_q, cmd_qs, stop_event) -> None:
    if state.rank != 0:
        cmd_q = cmd_qs[state.rank - 1]
        while True:
            try:
                cmd = cmd_q.get(timeout=0.5)
            except queue.Empty:
                if state.term.is_set():
                    return
                continue
            if cmd[0] == "stop":
                return
            state.request_idx += 1
            _generate(state, cmd[1])

    from moetrace.emulator.http_server import CompletionServer

    cfg = job.cfg
    info = {"model_path": cfg.weights.describe(), "tp_size": state.world, "fence": cfg.fence,
            "slow_rank": cfg.slow_rank, "device": cfg.device, "shm_prefix": job.prefix,
            "chunk_tokens": cfg.chunk_tokens, "prefill_threshold": cfg.prefill_threshold}
    server = CompletionServer(cfg.host, cfg.port, cfg.model_name, info, on_shutdown=stop_event.set)
    try:
        status_q.put(("listening", 0, {"port": server.port, "host": cfg.host}))
        while not (stop_event.is_set() or state.term.is_set()):
            item = server.next_request(0.1)
            if item is None:
                continue
            req, fut = item
            wire = {"prompt_ids": req["prompt_ids"], "max_tokens": req["max_tokens"]}
            for q in cmd_qs:
                q.put(("generate", wire))
            state.request_idx += 1
            try:
                out = _generate(state, wire)
            except BaseException as err:
                fut.set_exception(err)
                raise
            fut.set_result(server.completion_response(req, out["gen"], out["staged_loads"]))
    finally:
        for q in cmd_qs:
            q.put(("stop",))
        server.close()


def run_bench(job: RankJob, state: RankState, status_q) -> None:
    layer, repeats, fences = job.bench["layer"], job.bench["repeats"], job.bench["fences"]
    rt, ctx = state.runtime, state.ctx
    wrapper = state.wrappers.get(layer)
    times: dict[str, list[float]] = {f: [] for f in fences}
    # "outer:" times include whatever wraps SharedFullContext.load on the class
    # (moetrace's KT capture when forward hooks are on): the tracing overhead.
    times.update({f"outer:{f}": [] for f in fences})
    for _ in range(repeats):
        for fence in fences:
            rt.fence = fence
            if state.world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            ctx.load(layer, wrapper, None, None, None)
            times[f"outer:{fence}"].append(round((time.perf_counter() - t0) * 1e3, 3))
            times[fence].append(ctx.last_load_ms)
    status_q.put(("result", state.rank, {"times_ms": times}))


def _cleanup(state: RankState) -> None:
    if state.fork is not None:
        state.fork.close()
    rt = state.runtime
    if rt is not None:
        try:
            rt.close()
        finally:
            state.ctx = state.model = state.engine = None
            state.wrappers = {}
            gc.collect()  # drop every tensor view of the host slots before unmapping them
            if rt.device.type == "cuda":
                for t in rt.slots.own().values():
                    try:
                        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
                    except Exception:
                        pass
            rt.slots.close(unlink=state.rank == 0)
            rt.control.close(unlink=state.rank == 0)
    if state.weights is not None:
        state.weights.close()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _log_to(log_dir: str, rank: int) -> None:
    """This process's stdout and stderr, file descriptors included (kt-kernel prints from
    C++), into LOG_DIR/rank<r>.log."""
    os.makedirs(log_dir, exist_ok=True)
    fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def rank_main(rank: int, job: RankJob, status_q, cmd_qs, stop_event) -> None:
    """Entry point of a spawned rank process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C
    if job.cfg.log_dir:
        _log_to(job.cfg.log_dir, rank)
    from moetrace.hooks import weight_events

    weight_events.expect_absent("moetrace's emulator")  # no SGLang weight writers here, by design
    torch.set_num_threads(1)
    world = job.cfg.tp
    state = RankState(rank, world, torch.device("cpu"))
    signal.signal(signal.SIGTERM, lambda *_: state.term.set())
    threading.Thread(target=_watch_launcher, args=(job, state), name="launcher-watchdog", daemon=True).start()
    rc = 0
    try:
        state.device = _device(job.cfg, rank)
        _init_distributed(job, rank, world, state.device)
        build(job, state, with_model=job.mode != "bench")
        if world > 1:
            dist.barrier()
        status_q.put(("ready", rank, {"pid": os.getpid(), "hooks": state.hooks}))
        if job.mode == "batch":
            run_batch(job, state, status_q)
        elif job.mode == "serve":
            run_serve(job, state, status_q, cmd_qs, stop_event)
        elif job.mode == "bench":
            run_bench(job, state, status_q)
        else:
            raise ValueError(f"unknown mode {job.mode!r}")
    except BaseException as err:
        rc = 1
        tb = traceback.format_exc(limit=6)
        msg = str(err).strip() or type(err).__name__
        status_q.put(("error", rank, {"message": f"{type(err).__name__}: {msg}", "traceback": tb}))
    finally:
        try:
            _cleanup(state)
        except Exception:
            rc = rc or 1
        status_q.close()
        status_q.join_thread()
    sys.exit(rc)
