"""Does an index fit the server it is asked to verify? (TP size, checkpoint, layout, layers)

An index built for another TP size, another checkpoint or another w13 order (up-first)
makes every tensor "mismatch": a fail-closed guard would then kill a clean server over
its own misconfiguration. So the guard asks here before it verifies (at start, when it
learns the server's checkpoint, at the first capture of each layer) and goes
``unverified`` with the reason on a misfit (tracer.guard); ``hook-spec`` and ``launch``
refuse an index that does not fit what they can tell of the server (hooks.spec,
servers.launcher). Each function returns None (fits, or cannot tell) or one sentence.
docs/guard.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from moetrace.checkpoints.layout import LayoutRefused, ServerLayout
from moetrace.checkpoints.layout_rules import derive_layout
from moetrace.errors import MoetraceError


def tp_misfit(meta: dict, tp_size: int | None) -> str | None:
    if tp_size is None or meta.get("tp_size") in (None, tp_size):
        return None
    return f"the index is built for --tp {meta.get('tp_size')}, the server runs TP {tp_size}"


def checkpoint_identity(model_path: str | None) -> str | None:
    """The identity of the checkpoint folder at `model_path` (config and headers only);
    None when it cannot be read here (a hub id, another machine, not a checkpoint moetrace reads)."""
    if not model_path or not os.path.isdir(model_path):
        return None
    from moetrace.checkpoints.reader import open_checkpoint

    try:
        return open_checkpoint(model_path).identity
    except MoetraceError:
        return None


def checkpoint_misfit(meta: dict, model_path: str | None, identity: str | None = None) -> str | None:
    """The index's checkpoint vs the checkpoint folder the server loaded (`identity`: its
    identity when already read); None when the folder cannot be read here."""
    identity = identity or checkpoint_identity(model_path)
    if identity is None or identity == meta.get("checkpoint_id"):
        return None
    return (f"the index is of checkpoint {meta.get('checkpoint_id')} ({meta.get('checkpoint_path')}), the server "
            f"loaded {model_path} (checkpoint {identity})")


def checkpoint_id_misfit(meta: dict, checkpoint_id: str | None) -> str | None:
    if not checkpoint_id or checkpoint_id == meta.get("checkpoint_id"):
        return None
    return f"the index is of checkpoint {meta.get('checkpoint_id')}, --checkpoint-id says {checkpoint_id}"


def layout_misfit(meta: dict, facts: dict | None, source: str) -> str | None:
    """The layout a captured layer's facts (hooks.layout_facts) give vs the one the index was
    built for; None when the facts are missing or too few to tell."""
    fmt, size, mtp = meta.get("format"), meta.get("intermediate_size"), meta.get("moe_tp_size") or 1
    if facts is None or fmt is None or not size:
        return None
    try:
        server = derive_layout(facts, fmt, int(size) // int(mtp), source)
    except LayoutRefused as err:
        if err.transform == "an unknown layout":  # facts the trace could not read: cannot tell
            return None
        return f"the server holds {err.transform}, which moetrace does not reproduce ({err.why})"
    index = ServerLayout.from_json(meta.get("layout"))
    same = (server.up_first, server.intermediate_padded) == (index.up_first, index.intermediate_padded)
    if same and (source == "staged" or tuple(server.transforms) == tuple(index.transforms)):
        return None
    return f"the index is built for {index.describe()}, the server's {source} layer holds {server.describe()}"


@dataclass(frozen=True)
class LayoutFit:
    """How a captured layer's tensors can be held to an index built for another layout:
    ``why`` None: as they are; ``swap_w13``: the two halves of every w13 tensor swapped
    (the index is of the other gate/up order, nothing else differs); else not at all
    (every tensor of the layer unverified, ``why`` says so)."""

    why: str | None = None
    swap_w13: bool = False

    @property
    def verifiable(self) -> bool:
        return self.why is None or self.swap_w13


def layout_fit(meta: dict, facts: dict | None, source: str) -> LayoutFit:
    """layout_misfit, told apart: a layout that differs from the index's only in the w13
    half order can still be verified (swap_w13); anything else cannot."""
    why = layout_misfit(meta, facts, source)
    if why is None:
        return LayoutFit()
    try:
        fmt, size, mtp = meta["format"], int(meta["intermediate_size"]), int(meta.get("moe_tp_size") or 1)
        server = derive_layout(facts, fmt, size // mtp, source)
    except (LayoutRefused, KeyError, TypeError, ValueError):
        return LayoutFit(why)
    index = ServerLayout.from_json(meta.get("layout"))
    other_order = (server.up_first != index.up_first and server.intermediate_padded == index.intermediate_padded
                   and (source == "staged" or not (server.transforms or index.transforms)))  # a transform: no swap
    return LayoutFit(why, swap_w13=other_order)


def model_path_of(runner) -> str | None:
    """The checkpoint folder an SGLang ModelRunner loaded (server_args.model_path)."""
    for owner in (getattr(runner, "server_args", None), getattr(runner, "model_config", None)):
        path = getattr(owner, "model_path", None)
        if isinstance(path, str) and path:
            return path
    return None
