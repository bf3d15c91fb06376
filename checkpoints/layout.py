"""The server layout an expected shard is built for: how a rank's FusedMoE holds the
bytes the checkpoint gives it, as far as moetrace reproduces that exactly.

Derived from what a trace recorded (checkpoints.layout_rules), stored in the index
metadata (``layout``), applied by checkpoints.shards (order, padding) and
checkpoints.transforms (post-load transforms). Anything else is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrace.errors import MoetraceError


@dataclass(frozen=True)
class ServerLayout:
    up_first: bool = False  # w13 holds up rows before gate rows
    intermediate_padded: int | None = None  # per-rank I after the runner's padding; None: unpadded
    transforms: tuple[str, ...] = ()  # post-load transforms reproduced, in the order applied

    def to_json(self) -> dict:
        return {"up_first": self.up_first, "intermediate_padded": self.intermediate_padded,
                "transforms": list(self.transforms)}

    @classmethod
    def from_json(cls, doc: dict | None) -> "ServerLayout":
        """None / {} (indexes from before layouts were recorded): the canonical layout."""
        doc = doc or {}
        padded = doc.get("intermediate_padded")
        return cls(bool(doc.get("up_first", False)), None if padded is None else int(padded),
                   tuple(doc.get("transforms") or ()))

    def describe(self) -> str:
        parts = ["up rows first" if self.up_first else "gate rows first"]
        if self.intermediate_padded:
            parts.append(f"I per rank padded to {self.intermediate_padded}")
        return ", ".join(parts + list(self.transforms))


CANONICAL = ServerLayout()


class LayoutRefused(MoetraceError):
    """The server holds a transform of the shards that moetrace does not reproduce (exit 2)."""

    def __init__(self, transform: str, why: str, where: str = ""):
        self.transform, self.why, self.where = transform, why, where
        super().__init__(f"{where + ': ' if where else ''}the server holds {transform} ({why}); moetrace does not "
                         "reproduce it, so these experts cannot be compared byte for byte (see docs/compat.md)")
