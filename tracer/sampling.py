"""Which captures to keep: layers, experts, tensors, sources, steps.

A 48-layer x 256-expert model can be traced whole (the default) or sparsely:
``Sampling(layers=[0, 47], experts=range(0, 256, 16), every_n_steps=10)``.
Steps are the tracer's forward-pass numbers (equal on every rank), so the same
policy picks the same entries on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from moetrace.errors import MoetraceError

SOURCES = ("resident", "staged")


def parse_int_set(value, what: str) -> frozenset[int] | None:
    """None | "all" | "0,2,5-7" | [0, 2, "5-7"] -> frozenset of ints (None = all)."""
    if value is None or value == "all":
        return None
    items: Iterable = value.split(",") if isinstance(value, str) else value
    out: set[int] = set()
    for item in items:
        if isinstance(item, bool):
            raise MoetraceError(f"{what}: {item!r} is not an integer or range like 4-7")
        if isinstance(item, int):
            out.add(item)
            continue
        text = str(item).strip()
        if not text:
            continue
        try:
            if "-" in text:
                lo, hi = text.split("-", 1)
                lo_i, hi_i = int(lo), int(hi)
                if hi_i < lo_i:
                    raise ValueError
                out.update(range(lo_i, hi_i + 1))
            else:
                out.add(int(text))
        except ValueError:
            raise MoetraceError(f"{what}: {text!r} is not an integer or range like 4-7") from None
    if any(v < 0 for v in out):
        raise MoetraceError(f"{what}: ids must be >= 0, got {sorted(v for v in out if v < 0)}")
    return frozenset(out)


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

    @classmethod
    def from_config(cls, cfg: dict) -> "Sampling":
        sources = cfg.get("sources")
        tensors = cfg.get("tensors")
        if isinstance(sources, str):
            sources = sources.split(",")
        if isinstance(tensors, str):
            tensors = tensors.split(",")
        return cls(
            layers=parse_int_set(cfg.get("layers"), "layers"),
            experts=parse_int_set(cfg.get("experts"), "experts"),
            tensors=frozenset(t.strip() for t in tensors) if tensors else None,
            sources=frozenset(s.strip() for s in sources) if sources else frozenset(SOURCES),
            every_n_steps=int(cfg.get("every_n_steps") or 1),
            first_n_steps=None if cfg.get("first_n_steps") is None else int(cfg["first_n_steps"]),
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
