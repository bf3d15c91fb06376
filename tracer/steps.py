"""Forward-pass numbers ("steps") of one model on one rank, equal on every rank for the same pass.

The server's own pass counter is used when the hooks can read it (a newer hook
manager's ``_worker_forward_pass_id`` on the model, else 0.5.23's and the KT fork's
``ModelRunner.forward_pass_id``); otherwise the order of MoE layers tells passes
apart. Each model (target, draft) counts its own passes: a draft's layer 0 between
the target's layers would break the layer-order inference of a shared counter.
"""

from __future__ import annotations

from typing import Callable

STEP_SOURCES = ("hook-manager-pass-id", "model-runner-pass-id", "layer-order")


class LayerOrderSteps:
    """MoE layers run in increasing layer order within a pass, so a layer id that is
    not above the previous one starts a new pass. A staged (KT) load of layer L happens
    inside layer L's forward, before its forward hook: the load advances the counter
    and the hook of the same layer does not advance it again."""

    found_by = "layer-order"

    def __init__(self):
        self.step = 0
        self._last: int | None = None
        self._staged_at: int | None = None

    def _advance(self, layer: int) -> None:
        if self._last is not None and layer <= self._last:
            self.step += 1
        self._last = layer

    def __call__(self, source: str, layer: int) -> int:
        if source == "staged":
            self._advance(layer)
            self._staged_at = layer
            return self.step
        if self._staged_at is not None and layer == self._staged_at:
            self._staged_at = None
            return self.step
        self._staged_at = None
        self._advance(layer)
        return self.step


class ServerSteps:
    """The server's counter, read at every capture. It may restart (0.5.23 resets
    ``forward_pass_id`` when elastic EP recovers ranks; every rank at once): steps keep
    increasing past such a reset, by the same offset on every rank."""

    def __init__(self, read: Callable[[], int], found_by: str):
        self.read = read
        self.found_by = found_by
        self._offset = 0
        self._last_raw: int | None = None
        self._last: int | None = None

    def __call__(self, source: str, layer: int) -> int:
        raw = int(self.read())
        if self._last_raw is not None and raw < self._last_raw:
            self._offset = self._last + 1 - raw
        self._last_raw = raw
        self._last = self._offset + raw
        return self._last


def step_counter(read: Callable[[], int] | None = None, found_by: str = "layer-order"):
    """The counter for one model: the server's (`read`) when it has one, else layer order."""
    return LayerOrderSteps() if read is None else ServerSteps(read, found_by)
