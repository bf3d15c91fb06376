"""``--forward-hooks`` factories for tests: record what the hooks see (tests only).

    {"name": "probe", "target_modules": ["model.layers.*.mlp.experts"],
     "hook_factory": "support.probes:record_calls",
     "config": {"out": "/tmp/probe"}}

Each rank appends JSON lines to ``<out>/rank<r>.jsonl``: one ``factory`` line
when the factory is called, one ``call`` line per forward of a matched module
(class, layer_id, rank attributes, parameter names and shapes, token count).
"""

from __future__ import annotations

import json
import os
import threading


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return int(os.environ.get("RANK", "0"))


def record_calls(config: dict):
    out = config["out"]
    os.makedirs(out, exist_ok=True)
    rank = _rank()
    path = os.path.join(out, f"rank{rank}.jsonl")
    lock = threading.Lock()

    def write(rec: dict) -> None:
        with lock, open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    write({"event": "factory", "rank": rank, "pid": os.getpid(), "config": config})

    def hook(module, inputs, output):
        write({
            "event": "call",
            "rank": rank,
            "class": type(module).__name__,
            "layer_id": getattr(module, "layer_id", None),
            "moe_tp_rank": getattr(module, "moe_tp_rank", None),
            "moe_tp_size": getattr(module, "moe_tp_size", None),
            "num_experts": getattr(module, "num_experts", None),
            "params": {n: [list(p.shape), str(p.dtype)] for n, p in module.named_parameters(recurse=False)},
            "tokens": int(inputs[0].shape[0]) if inputs else None,
        })

    return hook


def record_loads(config: dict):
    """Wraps ``SharedFullContext.load`` on the class (as moetrace's KT capture does)
    and records each call's ``layer_idx`` and the stale ``gpu_layer.layer_id``;
    returns a no-op forward hook."""
    import functools

    from moetrace.emulator.staging import SharedFullContext

    out = config["out"]
    os.makedirs(out, exist_ok=True)
    rank = _rank()
    path = os.path.join(out, f"loads_rank{rank}.jsonl")
    original = SharedFullContext.__dict__["load"]

    @functools.wraps(original)
    def load(ctx, layer_idx, *args, **kwargs):
        result = original(ctx, layer_idx, *args, **kwargs)
        with open(path, "a") as f:
            f.write(json.dumps({"rank": rank, "layer_idx": int(layer_idx), "gpu_layer_layer_id": ctx.gpu_layer.layer_id,
                                "load_count": ctx.load_count}) + "\n")
        return result

    SharedFullContext.load = load
    return lambda module, inputs, output: None
