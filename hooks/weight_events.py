"""The server's weight-update events, counted: the epoch of tracer.unchanged's keys.

SGLang writes expert weights through ``param.data`` (FusedMoE's weight_loader),
which does not bump the parameter's version counter. So a resident capture may
reuse a fingerprint only where every runtime write path is known and counted:
the ``WeightUpdater`` methods that load, receive or update weights, EPLB's
``ExpertLocationUpdater.update``, and the ``weight_loader`` of each captured
parameter. ``epoch()`` is None until all of them are wrapped (then nothing is
reused); each call through one bumps the epoch before and after it runs.

The guard also needs to know when an update entry point (from disk, from tensors,
from distributed, from IPC; 0.5.23's ``WeightUpdater``, the KT fork's ``ModelRunner``)
has returned and which checkpoint it loaded: ``watch_updates(listener)``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import threading
import weakref

_WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
_EPLB_UPDATER = "sglang.srt.eplb.expert_location_updater"
_WRITER_PREFIXES = ("update_weights", "load_weights", "receive_weights", "begin_weight_update", "end_weight_update")
_MARK = "__moetrace_counts_weight_events__"
_ANNOUNCES = "__moetrace_announces_weight_update__"
# The entry points that replace weights: 0.5.23's WeightUpdater, the KT fork's (and older
# upstream releases') ModelRunner. init_/destroy_weights_update_group write nothing.
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
_UPDATE_PREFIXES = ("update_weights", "receive_weights", "load_weights", "begin_weight_update", "end_weight_update")
_listeners: list = []  # weakref.WeakMethod / weakref.ref of callables(entry, model_path, ok)
_depth = threading.local()

# Set by a server that has none of SGLang's writers or update entry points by design
# (moetrace's emulator): their absence is then recorded in the manifest, not logged.
_absence_expected: str | None = None

_counter = itertools.count(1)
_epoch = 0
_installed = False
_lock = threading.Lock()


def expect_absent(server: str) -> None:
    """Declare that this process's server has no SGLang weight writers by design."""
    global _absence_expected
    _absence_expected = server


def absence_expected() -> str | None:
    """The server that declared expect_absent, or None (a real SGLang server)."""
    return _absence_expected


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


# ---------------------------------------------------------------- update entry points


def _succeeded(result) -> bool:
    """SGLang's update methods return (success, message); the others return None."""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        return result[0]
    return True


def _notify(entry: str, model_path, ok: bool) -> None:
    for ref in list(_listeners):
        listener = ref()
        if listener is None:
            _listeners.remove(ref)
            continue
        try:
            listener(entry, None if model_path is None else str(model_path), ok)
        except Exception:  # a listener must never break the server's update
            pass


def announcing(fn, entry: str):
    """fn wrapped so that the listeners hear (entry, model_path or None, succeeded) when
    the outermost update call of this thread returns or raises."""
    if getattr(fn, _ANNOUNCES, False):
        return fn
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        ok = False
        try:
            result = fn(*args, **kwargs)
            ok = _succeeded(result)
            return result
        finally:
            _depth.n = depth
            if depth == 0:
                path = None
                if signature is not None:
                    try:
                        path = signature.bind(*args, **kwargs).arguments.get("model_path")
                    except TypeError:
                        pass
                _notify(entry, path, ok)

    setattr(wrapper, _ANNOUNCES, True)
    return wrapper


def watch_updates(listener) -> list[str]:
    """Tell ``listener(entry, model_path, ok)`` about every weight update of the server
    (held weakly). Returns the entry points found, as "Class.method" (empty: none found,
    e.g. not an SGLang process; updates are then not seen)."""
    ref = weakref.WeakMethod(listener) if inspect.ismethod(listener) else weakref.ref(listener)
    if ref not in _listeners:
        _listeners.append(ref)
    found = []
    for module, cls_name in ((_WEIGHT_UPDATER, "WeightUpdater"), (_MODEL_RUNNER, "ModelRunner")):
        cls = getattr(sys.modules.get(module), cls_name, None)
        if not isinstance(cls, type):
            continue
        for name in [n for n in vars(cls) if n.startswith(_UPDATE_PREFIXES) and callable(vars(cls)[n])]:
            setattr(cls, name, announcing(vars(cls)[name], name))
            found.append(f"{cls_name}.{name}")
    return found
