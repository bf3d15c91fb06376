"""A rank manifest kept in memory while its trace is written: what the hooks and the
writer count into it, under one lock, and the copy the writer persists.

Every change bumps a counter, so the writer (tracer.sink) rewrites ``_manifest.json``
on its flush period only when something moved.
"""

from __future__ import annotations

import copy
import threading

from moetrace.tracer.manifest import utc_now


class RankRecord:
    """The in-memory rank manifest (tracer.manifest.RankManifest, as a dict) of one sink."""

    def __init__(self, manifest: dict, max_error_messages: int = 5):
        self._m = manifest
        self._lock = threading.Lock()
        self.max_error_messages = int(max_error_messages)
        self._changes = 0  # bumped on every manifest change; the writer persists them on its flush period
        self._written_changes = -1

    def drop(self, rows: int, reason: str) -> None:
        with self._lock:
            self._drop_locked(rows, reason)

    def _drop_locked(self, rows: int, reason: str) -> None:
        if rows <= 0:
            return
        self._changes += 1
        self._m["rows_dropped"] += rows
        self._m["drops"][reason] = self._m["drops"].get(reason, 0) + rows

    def record_error(self, kind: str, message: str) -> int:
        """Count an error ("hook" or "sink"); keep the first few messages. Returns the new count."""
        key = "hook_errors" if kind == "hook" else "sink_errors"
        with self._lock:
            self._changes += 1
            self._m[key] += 1
            if len(self._m["errors"]) < self.max_error_messages:
                self._m["errors"].append({"kind": kind, "at": utc_now(), "message": message[:2000]})
            return self._m[key]

    def note(self, message: str) -> None:
        with self._lock:
            self._changes += 1
            if message not in self._m["notes"] and len(self._m["notes"]) < 50:
                self._m["notes"].append(message)

    def add_weight_update(self, update: dict) -> None:
        """One weight update of the server, in the order they happened (the first 100)."""
        with self._lock:
            self._changes += 1
            if len(self._m["weight_updates"]) < 100:
                self._m["weight_updates"].append(update)

    def update(self, **fields) -> None:
        """Set manifest fields (e.g. ranks from the first module, disabled)."""
        with self._lock:
            self._changes += 1
            self._m.update(fields)

    def set_model(self, name: str, **facts) -> None:
        """The manifest's ``models`` entry of a model the hooks serve (target, draft)."""
        with self._lock:
            self._changes += 1
            self._m["models"][name] = {"architecture": None, "found_by": None, "layers": None,
                                       "steps_found_by": None, "slot_maps": {}, **facts}

    def add_model_layers(self, name: str, layers) -> None:
        with self._lock:
            entry = self._m["models"].get(name)
            if entry is not None:
                self._changes += 1
                entry["layers"] = sorted(set(entry.get("layers") or []) | {int(x) for x in layers})

    def count_slot_map(self, model: str, how: str) -> None:
        """One more capture whose slots were mapped by `how` (hooks.slots: SlotMap.found_by)."""
        with self._lock:
            self._changes += 1
            entry = self._m["models"].setdefault(model, {"slot_maps": {}})
            maps = entry.setdefault("slot_maps", {})
            maps[how] = maps.get(how, 0) + 1

    def set_layout(self, key: str, facts: dict) -> None:
        """Record a layer's layout facts under manifest["layouts"][key]; a change after
        the first record replaces them and marks them "changed"."""
        with self._lock:
            layouts = self._m["layouts"]
            if key in layouts:
                facts = {**facts, "changed": True}
            self._changes += 1
            layouts[key] = facts

    def set_steps_seen(self, n: int) -> None:
        with self._lock:
            self._m["steps_seen"] = max(self._m["steps_seen"], n)

    def counters(self) -> dict:
        """Error and drop counts (cheap: the metrics mirror them every second)."""
        with self._lock:
            return {"hook_errors": self._m["hook_errors"], "sink_errors": self._m["sink_errors"],
                    "drops": dict(self._m["drops"])}

    def manifest(self) -> dict:
        with self._lock:
            return copy.deepcopy(self._m)

    def _snapshot(self) -> dict:
        """The manifest to write now (its lists and counters copied under the lock)."""
        with self._lock:
            self._m["updated_at"] = utc_now()
            self._written_changes = self._changes
            snap = dict(self._m)
            snap["parts"] = list(self._m["parts"])
            snap["drops"] = dict(self._m["drops"])
            snap["errors"] = list(self._m["errors"])
            snap["online"] = dict(self._m["online"])
            snap["dumps"] = {**self._m["dumps"], "files": list(self._m["dumps"]["files"])}
            snap["notes"] = list(self._m["notes"])
            snap["models"] = {k: {**v, "slot_maps": dict(v.get("slot_maps") or {})}
                              for k, v in self._m["models"].items()}
        return snap
