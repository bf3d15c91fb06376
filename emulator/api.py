"""Python entry points: run a whole emulated TP server in-process, or compute the reference.

    from moetrace.emulator import run_emulation, reference_outputs
    res = run_emulation(ckpt, tp=2, fence="none", requests=["hello " * 20],
                        forward_hooks=[...], device="cpu")
    ref = reference_outputs(ckpt, ["hello " * 20], tp=2)
    (res.requests[0].token0_logits - ref[0].token0_logits).abs().max()

``run_emulation`` spawns the ranks (no HTTP), runs the requests in order on
every rank and returns per-request tokens and token-0 logits of every rank,
the staged-load log, and (with ``snapshot_dir``) every staged layer as each
rank held it when its ``SharedFullContext.load`` returned. ``reference_outputs``
computes the same requests in this process straight from the checkpoint's
shards: no host slots, no copies, no race.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moetrace.emulator.config import EmulatorConfig, ModelDims, WeightsSpec, as_config
from moetrace.emulator.engine import Engine, decode, normalize_request
from moetrace.emulator.launcher import RankGroup


@dataclass
class RequestResult:
    prompt_ids: list[int]
    output_ids: list[int]
    token0_logits: torch.Tensor  # rank 0's logits that chose output token 0
    rank_token0_logits: list[torch.Tensor]  # every rank's (equal after the all-reduce)
    cached_tokens: int = 0
    chunks: list[int] = field(default_factory=list)
    staged_loads: int = 0

    @property
    def text(self) -> str:
        return decode(self.output_ids)


@dataclass(frozen=True)
class LoadRecord:
    rank: int
    load: int  # 1-based load count on that rank (= snapshot number)
    layer: int
    request: int
    ms: float


@dataclass
class EmulationResult:
    config: EmulatorConfig
    requests: list[RequestResult]
    loads: list[LoadRecord]
    hooks: dict[int, list]  # rank -> [(spec name, module name)] registered
    shm_prefix: str
    pids: list[int]
    seconds: float

    def snapshot(self, rank: int, load: int) -> dict[str, torch.Tensor]:
        """ctx.gpu_layer of ``rank`` right after its ``load``-th staged load (needs snapshot_dir)."""
        from safetensors.torch import load_file

        if not self.config.snapshot_dir:
            raise ValueError("run_emulation(..., snapshot_dir=DIR) records snapshots")
        return load_file(f"{self.config.snapshot_dir}/rank{rank}/load{load:05d}.safetensors")


def run_emulation(checkpoint=None, requests=(), *, config: EmulatorConfig | None = None, timeout_s: float | None = None,
                  **overrides) -> EmulationResult:
    """Run ``requests`` (prompt strings, token-id lists or {"prompt", "max_tokens"} dicts)
    on an emulated TP server. ``overrides`` are EmulatorConfig fields: tp, fence,
    slow_rank (-1/None: no injection), forward_hooks, device, chunk_tokens,
    prefill_threshold, snapshot_dir, shm_prefix, unlink_after_attach, ..."""
    cfg = as_config(checkpoint, config, **overrides)
    reqs = [normalize_request(r) for r in requests]
    t0 = time.perf_counter()
    group = RankGroup(cfg, "batch", requests=reqs)
    try:
        group.start()
        limit = timeout_s or cfg.startup_timeout_s + cfg.op_timeout_s * max(1, len(reqs)) * 4
        group.wait_for(lambda: len(group.of_kind("result")) == group.world, limit, "run")
        pids = group.pids
    finally:
        group.stop()
    results = group.of_kind("result")
    out = []
    for i in range(len(reqs)):
        per = [results[r]["requests"][i] for r in range(group.world)]
        logits = [torch.tensor(p["token0_logits"], dtype=torch.float32) for p in per]
        p0 = per[0]
        out.append(RequestResult(p0["prompt_ids"], p0["output_ids"], logits[0], logits, p0["cached_tokens"],
                                 p0["chunks"], p0["staged_loads"]))
    loads = sorted((LoadRecord(r, *rec) for r in results for rec in results[r]["loads"]),
                   key=lambda x: (x.rank, x.load))
    hooks = {r: [tuple(h) for h in results[r]["hooks"]] for r in results}
    return EmulationResult(cfg, out, loads, hooks, group.prefix, pids, time.perf_counter() - t0)


def reference_outputs(checkpoint=None, requests=(), *, config: EmulatorConfig | None = None,
                      **overrides) -> list[RequestResult]:
    """The same requests computed in this process from the checkpoint's TP shards
    directly (every rank's partial output summed in rank order), with the same
    chunking, prefix cache and non-expert weights as the emulator: what an
    uncorrupted server returns. Bit-equal to a correct TP2 emulation on CPU."""
    from moetrace.emulator.model import ReferenceExperts, build_model
    from moetrace.emulator.weights import open_weights

    cfg = as_config(checkpoint, config, **overrides)
    weights = open_weights(cfg.weights, cfg.tp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks compute single-threaded: same kernels, same bits
    try:
        dims = weights.dims
        cfg.validate(dims)
        shards = {L: [weights.layer_shards(L, r) for r in range(cfg.tp)] for L in dims.moe_layers}
        model = build_model(dims, cfg.seed, lambda L: ReferenceExperts(shards[L], dims.block), lambda t: None, "cpu")
        engine = Engine(model, "cpu", cfg.chunk_tokens, cfg.prefix_cache)
        out = []
        for req in (normalize_request(r) for r in requests):
            g = engine.generate(req["prompt_ids"], req["max_tokens"])
            out.append(RequestResult(g.prompt_ids, g.output_ids, g.token0_logits, [g.token0_logits],
                                     g.cached_tokens, g.chunks))
        return out
    finally:
        torch.set_num_threads(threads)
        weights.close()


def time_loads(weights: ModelDims | WeightsSpec | str, *, tp: int = 2, fences=("none", "all"), repeats: int = 3,
               layer: int | None = None, device: str = "cpu", slow_rank: int | None = None,
               timeout_s: float = 600.0, **overrides) -> dict[str, list[float]]:
    """Wall time (ms, as rank 0 measures ``SharedFullContext.load``) of ``repeats``
    staged loads of one layer per fence mode, the modes interleaved."""
    cfg = as_config(weights, None, tp=tp, device=device, slow_rank=slow_rank, op_timeout_s=timeout_s,
                    collective_timeout_s=timeout_s, **overrides)
    from moetrace.emulator.weights import weights_dims

    dims = weights_dims(cfg.weights, tp)
    layer = dims.moe_layers[0] if layer is None else layer
    group = RankGroup(cfg, "bench", bench={"layer": layer, "repeats": repeats, "fences": list(fences)})
    try:
        group.start()
        group.wait_for(lambda: len(group.of_kind("result")) == group.world, timeout_s, "benchmark")
    finally:
        group.stop()
    return group.of_kind("result")[0]["times_ms"]
