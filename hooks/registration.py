"""Where a hook factory was called from: the model, the runner, the modules hooked.

SGLang calls the factory from ``register_forward_hooks(model, hook_specs)``,
itself called with a ModelRunner's model (0.5.23:
``finalize_cuda_graph_capture(model_runner)``; the fork:
``ModelRunner.initialize``), for the target and for a speculative draft's
runner alike. Reading those frames (once, at factory time) tells which model a
hook serves, the modules it will be registered on (so the layers this pipeline
stage owns), and the server's own forward-pass counter.
"""

from __future__ import annotations

import fnmatch
import sys
import weakref
from dataclasses import dataclass, field

REGISTER_FN = "register_forward_hooks"
DRAFT_ARCH_MARKERS = ("MTP", "NextN", "Eagle", "EAGLE", "Draft")
PASS_ID_ATTR = "_worker_forward_pass_id"  # newer hook managers: a counter on model.model (or the root)


@dataclass
class Registration:
    model: object | None  # the root module handed to register_forward_hooks
    runner: object | None  # the ModelRunner that owns it
    targets: list[str] = field(default_factory=list)
    modules: dict[str, object] = field(default_factory=dict)  # hooked module name -> module
    dp_rank: int | None = None  # the fork's ModelRunner(dp_rank=...) argument, when seen

    @property
    def architecture(self) -> str | None:
        return type(self.model).__name__ if self.model is not None else None

    def draft(self) -> tuple[bool, str]:
        """(is draft, what said so)."""
        flag = getattr(self.runner, "is_draft_worker", None)
        if isinstance(flag, bool):
            return flag, "runner.is_draft_worker"
        marks = {getattr(m, "is_draft", None) for m in self.modules.values()} - {None}
        if len(marks) == 1:
            return bool(marks.pop()), "module.is_draft"
        arch = self.architecture or ""
        if any(m in arch for m in DRAFT_ARCH_MARKERS):
            return True, "architecture"
        return False, "default"

    def pass_counter(self):
        """(callable returning the server's current pass id, its name) or (None, "layer-order")."""
        root = self.model
        tracker = getattr(root, "model", None) if root is not None else None
        for holder in (tracker, root):
            if holder is not None and isinstance(getattr(holder, PASS_ID_ATTR, None), int):
                return (lambda h=holder: getattr(h, PASS_ID_ATTR)), "hook-manager-pass-id"
        if self.runner is not None and isinstance(getattr(self.runner, "forward_pass_id", None), int):
            return (lambda r=self.runner: r.forward_pass_id), "model-runner-pass-id"
        return None, "layer-order"


def _is_runner(obj, model) -> bool:
    return obj is not None and getattr(obj, "model", None) is model and hasattr(obj, "forward_pass_id")


def find_registration(max_depth: int = 40) -> Registration | None:
    """The register_forward_hooks call this factory runs in, or None (called directly).
    Read once per factory call; frames are only looked at, never kept."""
    frame = sys._getframe(1)
    depth = 0
    reg = None
    try:
        while frame is not None and depth < max_depth:
            loc = frame.f_locals
            if reg is None and frame.f_code.co_name == REGISTER_FN and "model" in loc:
                spec = loc.get("spec") if isinstance(loc.get("spec"), dict) else {}
                targets = [t for t in spec.get("target_modules") or [] if isinstance(t, str)]
                named = loc.get("name_to_module")
                if not isinstance(named, dict):
                    named = dict(loc["model"].named_modules())
                mods = {n: m for n, m in named.items() if any(fnmatch.fnmatch(n, t) for t in targets)}
                reg = Registration(loc["model"], None, targets, mods)
            elif reg is not None:
                if reg.runner is None:
                    for name in ("model_runner", "self"):
                        if _is_runner(loc.get(name), reg.model):
                            reg.runner = loc[name]
                if reg.runner is not None and loc.get("self") is reg.runner and isinstance(loc.get("dp_rank"), int):
                    reg.dp_rank = loc["dp_rank"]  # the fork: ModelRunner.__init__(..., dp_rank=...)
                    break
            frame = frame.f_back
            depth += 1
    finally:
        del frame
    return reg


# Which model each hooked module belongs to (weak: modules live as long as the server).
# The KT load wrapper asks it for the layer a staged load was made for.
MODULE_MODELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def model_name(reg: Registration | None) -> tuple[str, str]:
    """("target" | "draft", what said so) for the model a factory call serves."""
    if reg is None:
        return "target", "no registration frames (factory called directly)"
    draft, how = reg.draft()
    return ("draft" if draft else "target"), how


def bind_modules(reg: Registration | None, model: str) -> None:
    for module in (reg.modules.values() if reg is not None else ()):
        try:
            MODULE_MODELS[module] = model
        except TypeError:  # not weak-referenceable: a staged load of it reads as the target's
            pass


def model_of(module, default: str = "target") -> str:
    """The model a module was hooked for; a FusedMoE built under a draft scope (0.5.23:
    ``is_draft``) is the draft's even when the registration frames were not seen."""
    if module is None:
        return default
    if getattr(module, "is_draft", False) is True:
        return "draft"
    try:
        return MODULE_MODELS.get(module, default)
    except TypeError:
        return default
