"""Configuration of one emulated TP server: plain frozen dataclasses, validated once.

Everything a rank process needs travels in an ``EmulatorConfig`` (spawned
processes receive it as their argument), so every rank sees the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetrace.errors import MoetraceError

FENCES = ("none", "all")
# The fork's copy order for FP8 block experts (SharedFullContext.WEIGHT_NAMES_FP8).
WEIGHT_NAMES_FP8 = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
VOCAB_SIZE = 256  # byte-level tokens


@dataclass(frozen=True)
class ModelDims:
    """What the emulated model needs to know about the experts."""

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    hidden: int
    intermediate: int  # moe_intermediate_size, before TP
    top_k: int
    block: tuple[int, int] = (128, 128)  # weight_block_size (block_n, block_k)

    def i_tp(self, tp: int) -> int:
        return self.intermediate // tp


@dataclass(frozen=True)
class WeightsSpec:
    """Where expert weights come from: a safetensors checkpoint directory, or
    deterministic filler bytes of the given dims (benchmarks; no checkpoint)."""

    checkpoint: str | None = None
    dims: ModelDims | None = None  # filler weights when checkpoint is None

    def describe(self) -> str:
        return self.checkpoint or f"filler {self.dims}"


@dataclass(frozen=True)
class EmulatorConfig:
    """One emulated TP KT-staging server.

    fence: "none" is the fork as it is (rank 0 waits only for its own previous
    copy before refilling a host slot); "all" adds the seed PR's fences (every
    rank syncs its copy event, then a collective fence, before rank 0 reuses a
    slot; plus a drain and fence before the first write of each load).
    slow_rank: the rank whose copy of ``slow_tensor`` is held back by the
    deterministic injection (None: no injection, natural timing).
    """

    weights: WeightsSpec
    tp: int = 2
    fence: str = "none"
    slow_rank: int | None = 1
    slow_tensor: str = "w2_weight_scale_inv"
    chunk_tokens: int = 32  # prefill chunk size (SGLang --chunked-prefill-size)
    prefill_threshold: int = 8  # staged path when a pass has >= this many tokens (--kt-gpu-prefill-token-threshold)
    num_gpu_experts: int = 0  # the GPU mask handed to load; FP8 block stages every expert anyway (as the fork)
    device: str = "cpu"
    seed: int = 0  # non-expert weights (embedding, attention, router, lm_head)
    forward_hooks: tuple = ()  # SGLang --forward-hooks entries (dicts)
    prefix_cache: bool = True
    op_timeout_s: float = 30.0  # any wait on a copy, a write or a held copy
    collective_timeout_s: float = 60.0  # torch.distributed process-group timeout
    startup_timeout_s: float = 180.0
    shm_prefix: str | None = None  # default: a fresh per-run prefix
    unlink_after_attach: bool = True  # as the fork: names vanish once every rank mapped them
    snapshot_dir: str | None = None  # save ctx.gpu_layer after every staged load (tests)
    # Each rank's stdout and stderr (kt-kernel's own start-up lines and timings, the hooks'
    # messages) go to LOG_DIR/rank<r>.log instead of the launcher's terminal (None: inherited).
    log_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    model_name: str = "moetrace-emulator"
    # "emulator": moetrace's SharedFullContext; "fork": the installed sglang-kt's own,
    # under the simulated CUDA runtime (CPU only; fork_transport.py), rank 0 writing
    # with kt-kernel's writer (writer="kt-kernel") when it runs here, else moetrace's.
    transport: str = "emulator"
    fork_path: str | None = None
    writer: str = "kt-kernel"

    def replace(self, **kw) -> "EmulatorConfig":
        return replace(self, **kw)

    def validate(self, dims: ModelDims | None = None) -> None:
        """Raise MoetraceError (one line) for settings the emulator refuses."""
        if self.fence not in FENCES:
            raise MoetraceError(f"--fence must be one of {', '.join(FENCES)}, got {self.fence!r}")
        if self.tp < 1:
            raise MoetraceError(f"--tp must be >= 1, got {self.tp}")
        if self.slow_rank is not None:
            if self.slow_rank == 0:
                raise MoetraceError("--slow-rank 0 is refused: rank 0 waits for its own copies before every refill, "
                                    "so a slow rank 0 cannot race; pick a peer rank (1..tp-1) or -1 for none")
            if self.tp > 1 and not 0 < self.slow_rank < self.tp:
                raise MoetraceError(f"--slow-rank {self.slow_rank} is not a peer rank of --tp {self.tp} (use "
                                    f"1..{self.tp - 1} or -1)")
        if self.slow_tensor not in WEIGHT_NAMES_FP8:
            raise MoetraceError(f"slow_tensor must be one of {', '.join(WEIGHT_NAMES_FP8)}, got {self.slow_tensor!r}")
        if self.chunk_tokens < 1 or self.prefill_threshold < 1:
            raise MoetraceError("--chunk-tokens and the prefill threshold must be >= 1")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise MoetraceError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.host not in ("127.0.0.1", "localhost"):
            raise MoetraceError(f"the emulator serves on loopback only (127.0.0.1 or localhost), got --host "
                                f"{self.host}")
        if not isinstance(self.forward_hooks, tuple):
            raise MoetraceError("forward_hooks must be a tuple of hook-spec dicts")
        if self.transport not in ("emulator", "fork") or self.writer not in ("kt-kernel", "moetrace"):
            raise MoetraceError(f"transport must be emulator or fork and writer kt-kernel or moetrace, got "
                                f"{self.transport!r} and {self.writer!r} (resolve \"auto\" with resolve_transport)")
        if self.transport == "fork" and (self.device != "cpu" or not self.weights.checkpoint):
            raise MoetraceError("transport fork needs --device cpu (its CUDA runtime is simulated) and a checkpoint "
                                "(kt-kernel reads its experts from it)")
        if dims is None:
            return
        if dims.intermediate % self.tp:
            raise MoetraceError(f"moe_intermediate_size {dims.intermediate} is not divisible by --tp {self.tp}")
        bn, bk = dims.block
        i_tp = dims.i_tp(self.tp)
        if i_tp % bn or i_tp % bk:
            raise MoetraceError(f"I/TP = {i_tp} is not a multiple of the FP8 block {list(dims.block)} "
                                f"(SGLang refuses it too): use a smaller --tp or another checkpoint")
        if not 0 <= self.num_gpu_experts < dims.num_experts:
            raise MoetraceError(f"num_gpu_experts must be in [0, {dims.num_experts}), got {self.num_gpu_experts}")


def as_config(checkpoint=None, config: EmulatorConfig | None = None, **kw) -> EmulatorConfig:
    """Build a config from a checkpoint path (or a WeightsSpec) plus keyword overrides."""
    if config is not None:
        return config.replace(**kw) if kw else config
    if isinstance(checkpoint, WeightsSpec):
        weights = checkpoint
    elif isinstance(checkpoint, ModelDims):
        weights = WeightsSpec(dims=checkpoint)
    elif checkpoint is None:
        raise MoetraceError("give a checkpoint directory (or a WeightsSpec) to emulate")
    else:
        weights = WeightsSpec(checkpoint=str(checkpoint))
    if "forward_hooks" in kw and kw["forward_hooks"] is not None:
        kw["forward_hooks"] = tuple(kw["forward_hooks"])
    elif "forward_hooks" in kw:
        kw["forward_hooks"] = ()
    if kw.get("slow_rank") is not None and kw["slow_rank"] < 0:
        kw["slow_rank"] = None
    return EmulatorConfig(weights=weights, **kw)

