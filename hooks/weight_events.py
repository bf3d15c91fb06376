"""The server's weight-update events, counted: the epoch of tracer.unchanged's keys.

SGLang writes expert weights through ``param.data`` (FusedMoE's weight_loader),
which does not bump the parameter's version counter. So a resident capture may
reuse a fingerprint only where every runtime write path is known and counted:
the ``WeightUpdater`` methods that load, receive or update weights, EPLB's
``ExpertLocationUpdater.update``, and the ``weight_loader`` of each captured
parameter. ``epoch()`` is None until all of them are wrapped (then nothing is
reused); each call through one bumps the epoch before and after it runs.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading

_WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
_EPLB_UPDATER = "sglang.srt.eplb.expert_location_updater"
_WRITER_PREFIXES = ("update_weights", "load_weights", "receive_weights", "begin_weight_update", "end_weight_update")
_MARK = "__moetrace_counts_weight_events__"

_counter = itertools.count(1)
_epoch = 0
_installed = False
_lock = threading.Lock()


def bump() -> None:
    global _epoch
    with _lock:
        _epoch = next(_counter)


def epoch() -> int | None:
    """The current weights epoch, or None when not every write path is counted."""
    return _epoch if _installed else None


def counting(fn):
    """fn wrapped so that each call bumps the epoch before and after it."""
    if getattr(fn, _MARK, False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bump()
        try:
            return fn(*args, **kwargs)
        finally:
            bump()

    setattr(wrapper, _MARK, True)
    return wrapper


def wrap_methods(cls, names) -> int:
    """Wrap these methods of cls in place; returns how many were found."""
    found = 0
    for name in names:
        fn = cls.__dict__.get(name)
        if callable(fn):
            setattr(cls, name, counting(fn))
            found += 1
    return found


def install() -> bool:
    """Wrap SGLang's weight writers (idempotent). False: some are not there, so
    resident fingerprints are never reused in this process."""
    global _installed
    with _lock:
        if _installed:
            return True
    # SGLang's model_runner imports both modules (0.5.23: model_runner.py:79, :188),
    # so inside a server they are loaded; nothing is imported here.
    updater = getattr(sys.modules.get(_WEIGHT_UPDATER), "WeightUpdater", None)
    eplb = getattr(sys.modules.get(_EPLB_UPDATER), "ExpertLocationUpdater", None)
    if updater is None or eplb is None:  # not SGLang, or a version whose writers we do not know
        return False
    writers = [n for n in vars(updater) if n.startswith(_WRITER_PREFIXES)]
    if not writers or not wrap_methods(eplb, ["update"]):
        return False
    wrap_methods(updater, writers)
    with _lock:
        _installed = True
    return True


def watch_params(tensors) -> bool:
    """Count calls through each parameter's own ``weight_loader`` (every SGLang
    loading path writes expert weights through it). False when one cannot be
    wrapped: that module's fingerprints are then never reused."""
    for t in tensors.values():
        loader = getattr(t, "weight_loader", None)
        if callable(loader) and not getattr(loader, _MARK, False):
            try:
                t.weight_loader = counting(loader)
            except (AttributeError, TypeError):
                return False
    return True
