"""Which captures to keep: layers, experts, tensors, sources, steps.

A 48-layer x 256-expert model can be traced whole (the default) or sparsely:
``Sampling(layers=[0, 47], experts=range(0, 256, 16), every_n_steps=10)``.
Steps are the tracer's forward-pass numbers (equal on every rank), so the same
policy picks the same entries on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from moetrace.errors import MoetraceError
from moetrace.schema import SOURCES, TENSOR_NAMES, parse_ids


def _names(value, what: str) -> frozenset[str] | None:
    """None | "a,b" | ["a", "b"] -> frozenset of stripped names (None, "" or []: all)."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in items):
        raise MoetraceError(f"{what}: {value!r}; expected a list of names or a comma-separated string")
    names = frozenset(v.strip() for v in items if v.strip())
    return names or None


def _int_or_none(value, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MoetraceError(f"{what}: {value!r} is not an integer")
    try:
        return int(value)
    except ValueError:
        raise MoetraceError(f"{what}: {value!r} is not an integer") from None


@dataclass(frozen=True)
class Sampling:
    """What to capture. None means "all" for layers, experts and tensors."""

    layers: frozenset[int] | None = None
    experts: frozenset[int] | None = None  # global (logical) expert ids
    tensors: frozenset[str] | None = None  # FusedMoE param names
    sources: frozenset[str] = frozenset(SOURCES)
    every_n_steps: int = 1
    first_n_steps: int | None = None  # keep steps [0, first_n_steps) only

    def __post_init__(self):
        if self.every_n_steps < 1:
            raise MoetraceError(f"every_n_steps: must be >= 1, got {self.every_n_steps}")
        if self.first_n_steps is not None and self.first_n_steps < 0:
            raise MoetraceError(f"first_n_steps: must be >= 0 or null, got {self.first_n_steps}")
        bad = set(self.sources) - set(SOURCES)
        if bad:
            raise MoetraceError(f"sources: unknown {sorted(bad)}; expected a subset of {list(SOURCES)}")
        if self.tensors is not None:
            bad = set(self.tensors) - set(TENSOR_NAMES)
            if bad:
                raise MoetraceError(f"tensors: unknown {sorted(bad)}; expected a subset of {list(TENSOR_NAMES)}")
        for what, ids in (("layers", self.layers), ("experts", self.experts)):
            if ids is not None and any(v < 0 for v in ids):
                raise MoetraceError(f"{what}: ids must be >= 0, got {sorted(v for v in ids if v < 0)}")

    @classmethod
    def from_config(cls, cfg: dict) -> "Sampling":
        tensors = _names(cfg.get("tensors"), "tensors")
        sources = _names(cfg.get("sources"), "sources")
        every = _int_or_none(cfg.get("every_n_steps"), "every_n_steps")
        return cls(
            layers=parse_ids(cfg.get("layers"), "layers"),
            experts=parse_ids(cfg.get("experts"), "experts"),
            tensors=tensors,
            sources=sources if sources is not None else frozenset(SOURCES),
            every_n_steps=1 if every is None else every,
            first_n_steps=_int_or_none(cfg.get("first_n_steps"), "first_n_steps"),
        )

    def to_config(self) -> dict:
        return {
            "layers": sorted(self.layers) if self.layers is not None else None,
            "experts": sorted(self.experts) if self.experts is not None else None,
            "tensors": sorted(self.tensors) if self.tensors is not None else None,
            "sources": sorted(self.sources),
            "every_n_steps": self.every_n_steps,
            "first_n_steps": self.first_n_steps,
        }

    def past_last_step(self, step: int) -> bool:
        """True once no later step can be kept (tracing can stop)."""
        return self.first_n_steps is not None and step >= self.first_n_steps

    def want(self, source: str, step: int, layer: int) -> bool:
        if source not in self.sources:
            return False
        if self.first_n_steps is not None and step >= self.first_n_steps:
            return False
        if step % self.every_n_steps:
            return False
        return self.layers is None or layer in self.layers

    def want_tensor(self, name: str) -> bool:
        return self.tensors is None or name in self.tensors

    def expert_positions(self, global_ids: Sequence[int]) -> list[int] | None:
        """Positions in `global_ids` to keep; None = keep all (no gather needed)."""
        if self.experts is None:
            return None
        return [i for i, e in enumerate(global_ids) if e in self.experts]
