"""Resident expert weights fingerprinted once per version.

A resident capture whose parameter is provably unchanged since its last
fingerprint reuses that fingerprint: same storage pointer, offset, shape,
strides, dtype and device, same torch version counter (``tensor._version``,
bumped by every in-place op on the tensor or a view of it), same slot map, and
the same weights epoch (the server's weight-update events, counted by hooks/).
Writes through ``param.data`` do not bump the version counter, which is why a
key needs an epoch: without one (``None``) nothing is reused. Any doubt (an
inference tensor has no version counter) re-hashes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from moetrace.fingerprint import Fingerprint


@dataclass(frozen=True)
class WeightsKey:
    """What must be equal for a parameter's bytes to be the ones fingerprinted before."""

    epoch: int
    ptr: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    version: int
    experts: tuple[int, ...]


def weights_key(t: torch.Tensor, experts: Sequence[int], epoch: int | None) -> WeightsKey | None:
    if epoch is None or t.is_inference():
        return None
    try:
        version = t._version
    except RuntimeError:  # no version counter: nothing proves the bytes unchanged
        return None
    return WeightsKey(int(epoch), t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
                      t.device, int(version), tuple(int(e) for e in experts))


class ResidentCache:
    """(layer, tensor) -> (key, fingerprints) of the last resident capture that was hashed; the
    layer may be (model, layer) so that a draft model's layer 0 is not the target's.

    Entries are filled by the sink's writer thread once it has folded a batch
    (``remember`` returns that callback), so until then a capture hashes again.
    Counters: ``hashed`` (resident tensors fingerprinted), ``reused`` (served here).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[tuple[object, str], tuple[WeightsKey, list[Fingerprint]]] = {}
        self.hashed = 0
        self.reused = 0

    def lookup(self, layer, tensor: str, key: WeightsKey | None) -> list[Fingerprint] | None:
        if key is None:
            return None
        with self._lock:
            entry = self._entries.get((layer, tensor))
            if entry is None or entry[0] != key:
                return None
            self.reused += 1
            return entry[1]

    def remember(self, layer, tensor: str, key: WeightsKey | None) -> Callable[[list[Fingerprint]], None] | None:
        with self._lock:
            self.hashed += 1
        if key is None:
            return None

        def store(fps: list[Fingerprint]) -> None:
            with self._lock:
                self._entries[(layer, tensor)] = (key, fps)

        return store

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
