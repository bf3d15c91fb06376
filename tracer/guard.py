"""The in-server guard: every staged load and every resident weight change verified on
the rank's device against the index, one small result per load brought to the host.

Per capture event (a KT staged load, a resident FusedMoE forward whose weights are not
provably unchanged): the chunk digests of every tensor are computed on the device
and compared there with this rank's expected chunk digests (tracer.expected); the flags
of the whole load come back in ONE device-to-host copy. Mismatching rows still become
full trace rows (chunk digests, capped dumps); matching rows only with
``guard_rows: all``. Actions on a mismatch: ``record`` (counts, trace rows, one warning),
``alert`` (plus an ERROR line per mismatching load), ``fail-closed`` (plus GuardMismatch
raised out of the hook, so the layer is never used). docs/guard.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from moetrace.fingerprint import finalize, row_chunk_digests
from moetrace.schema import format_ids
from moetrace.tracer import index_fit
from moetrace.tracer.batch import CapturedTensor, CaptureEvent
from moetrace.tracer.expected import MATCH, MISMATCH, UNVERIFIED, VERDICTS, guard_device, load_expected
from moetrace.tracer.manifest import utc_now

log = logging.getLogger("moetrace.guard")

_KEEP = 20  # mismatches and weight updates listed in the manifest
_ALERTS_PER_MINUTE = 10


class GuardMismatch(RuntimeError):
    """fail-closed: a layer's experts do not match the index; raised out of the hook so
    the layer is never used (the forward pass fails, no token is returned)."""


class Guard:
    """One per rank (tracer). ``check`` verifies one capture event; ``weights_updated``
    is told about the server's weight updates (hooks.weight_events)."""

    def __init__(self, config, tp_rank: int, tp_size: int, sink, counters_of_sink):
        self.config, self.action, self.rows = config, config.guard, config.guard_rows
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        self.sink = sink
        self._lock = threading.RLock()
        self.expected, self.reason, self._generation = None, None, 0
        self._held: dict[tuple[str, int], int] = {}  # (source, target layer) -> slots the last capture held
        self.device = guard_device()
        self.gaps: dict[str, int] = {}  # "<model> layer L tensor" captured, not in the index -> tensors unverified
        self._fitted: set[str] = set()  # layout keys whose fit with the index was checked
        self._set_expected(config.index, None)
        from moetrace.tracer.metrics import GuardMetrics  # prometheus-client only when the guard is on

        self.metrics = GuardMetrics(tp_rank, config.metrics_port, counters_of_sink)
        self.loads = dict.fromkeys(("ok", "mismatch", "unverified"), 0)
        self.tensors = dict.fromkeys((*VERDICTS, "reused"), 0)
        self.by_source: dict[str, dict[str, int]] = {}
        self.mismatches: list[dict] = []
        self.updates: list[dict] = []
        self.failed_closed: dict | None = None
        self.seconds, self.max_load_seconds, self.last_verified = 0.0, 0.0, None
        # source -> (step, {(layer, tensor): rows verified}, unverified)
        self._pass: dict[str, tuple[int, dict, dict]] = {}
        self.coverage: dict[str, float] = {}
        self._memo: dict[tuple[str, int, str], tuple[object, list[int]]] = {}  # resident: key -> last flags
        self._alerts: list[float] = []
        self._warned = False
        self.publish()

    # ------------------------------------------------------------ the expected digests

    def _set_expected(self, index: str | None, why_none: str | None) -> None:
        with self._lock:
            self.expected, self.reason, self._memo = None, why_none, {}
            self._generation += 1
            self._expected_per_pass: dict[str, int] = {}  # source -> expected tensors of a pass (lazily)
            self.gaps = {}  # what the new expected digests cannot verify is found again
            if index is None:
                return
            try:
                self.expected = load_expected(index, self.tp_rank, self.device)
            except Exception as err:  # unreadable: reported as unverified, never as ok
                msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                self.reason = f"index unreadable, nothing is verified: {msg}"
                log.error("moetrace guard on rank %d: %s", self.tp_rank, self.reason)
                return
            self._fitted = set()
            self.misfit(index_fit.tp_misfit(self.expected.meta, self.tp_size))

    def misfit(self, why: str | None) -> None:
        """An index that does not fit the server (tracer.index_fit): unverified from now on,
        said once in the log, never a mismatch (fail-closed must not kill a clean server)."""
        if why is None or self.expected is None:
            return
        with self._lock:
            index = self.expected.path
            self.expected, self._memo = None, {}
            self._generation += 1
            self.reason = f"the index {index} does not fit the server: {why}; nothing is verified"
        log.error("moetrace guard on rank %d: %s", self.tp_rank, self.reason)
        if hasattr(self, "metrics"):
            self.publish()

    @property
    def status(self) -> str:
        if self.reason is not None:
            return "unverified"
        if self.tensors["mismatch"]:
            return "mismatch"
        if self.gaps:  # some captured tensors were never compared: never "ok"
            return "unverified"
        return "ok" if self.tensors["match"] else "waiting"

    @property
    def status_reason(self) -> str | None:
        if self.reason is not None or not self.gaps:
            return self.reason
        shown = sorted(self.gaps)[:8]
        more = f" and {len(self.gaps) - 8} more" if len(self.gaps) > 8 else ""
        return (f"{sum(self.gaps.values())} captured tensors have no row in the index, never verified: "
                f"{'; '.join(shown)}{more}")

    # ------------------------------------------------------------ one load

    def check(self, tracer, event: CaptureEvent, items: list[CapturedTensor]) -> int:
        """Verify one capture event; submit its trace rows; returns the rows submitted.
        Raises GuardMismatch (fail-closed) after the rows, counts and manifest are written."""
        t0 = time.perf_counter()
        key = f"{event.source}:{event.model}:{int(event.layer)}"
        if key not in self._fitted and self.expected is not None:
            self._fitted.add(key)
            facts = tracer.layout(event.source, event.layer, event.model)  # recorded by the hook just before
            self.misfit(index_fit.layout_misfit(self.expected.meta, facts, event.source))
        with self._lock:
            exp = self.expected
            if exp is not None and items and items[0].data.device != exp.device:
                exp = self.expected = exp.on(items[0].data.device)
            experts = tuple(event.experts)
            pending, flags_on_device = [], []
            for it in items:
                memo = self._remembered(event, it)
                if memo is not None:
                    pending.append((it, memo, None, None))
                    continue
                chunks = row_chunk_digests(it.rows)
                tracer.fingerprinted += 1
                host = tracer.host_chunks(chunks) if self.rows == "all" else None
                flags = None if exp is None else exp.compare(event.where, it.name, experts, chunks, it.nbytes)
                if flags is not None:
                    flags_on_device.append(flags)
                pending.append((it, flags, chunks, host))
            # The one device-to-host copy of this load: it waits for what the stream ran before it
            # (a staged load ends with the fork's own device sync: the guard's kernels only).
            back = torch.cat(flags_on_device).cpu().tolist() if flags_on_device else []
            results, at = [], 0
            for it, flags, chunks, host in pending:
                n = len(event.experts)
                if isinstance(flags, torch.Tensor):
                    flags, at = back[at:at + n], at + n
                elif flags is None:
                    flags = [UNVERIFIED] * n
                results.append((it, flags, chunks, host))
                if event.source == "resident" and chunks is not None and it.key is not None:
                    self._memo[(*event.where, it.name)] = (self._memo_key(it), flags)
            submitted = sum(self._submit(tracer, event, *r, exp) for r in results)
            seconds = time.perf_counter() - t0
            message = self._account(event, results, seconds)
        if message is not None and self.action == "fail-closed":
            tracer.flush(timeout=min(5.0, self.config.close_timeout_s))  # rows on disk before the server dies
            raise GuardMismatch(message)
        return submitted

    def _memo_key(self, it: CapturedTensor):
        return (it.key, self._generation)

    def _remembered(self, event: CaptureEvent, it: CapturedTensor) -> list[int] | None:
        """The last flags of a resident parameter provably unchanged since (same weights
        key, same expected digests; resident_cache on); with guard_rows=all only when its fingerprints are
        reused too."""
        if event.source != "resident" or it.key is None:
            return None
        found = self._memo.get((*event.where, it.name))
        if found is None or found[0] != self._memo_key(it) or (self.rows == "all" and it.fps is None):
            return None
        return found[1]

    def _submit(self, tracer, event, it, flags, chunks, host, exp) -> int:
        """Trace rows of one tensor: mismatches always (with dumps), all rows with guard_rows=all."""
        words = [None if f == UNVERIFIED else VERDICTS[f] for f in flags]
        if chunks is None:  # remembered verdicts of unchanged weights: nothing was read, no row claims these bytes
            return 0
        bad = [i for i, f in enumerate(flags) if f == MISMATCH]
        if self.rows == "all":
            batch = tracer.batch(event, it, host[0], host[1], None)
            batch.online = words
            if event.source == "resident":
                batch.on_folded = tracer.resident.remember(event.where, it.name, it.key)
        elif bad:
            picked = chunks.index_select(0, torch.as_tensor(bad, device=chunks.device)).cpu()
            batch = tracer.batch(event, it, None, None, finalize(picked, it.nbytes), rows=bad)
            batch.online = ["mismatch"] * len(bad)
        else:
            return 0
        if bad and self.config.dump_max_count:
            self._dumps(tracer, batch, it, bad, exp)
        return batch.n_rows if tracer.sink.submit(batch) else 0

    def _dumps(self, tracer, batch, it, bad, exp) -> None:
        if batch.fps is None:  # guard_rows=all: the mismatching rows' fingerprints here, as online verification does
            if batch.ready is not None:
                batch.ready.synchronize()
            batch.fps, batch.chunks, batch.ready = finalize(batch.chunks, it.nbytes), None, None
        table = exp.tables.get((batch.model, batch.layer, it.name)) if exp is not None else None
        for j, i in enumerate(bad):
            row = i if self.rows == "all" else j
            if tracer.sink.reserve_dump(it.nbytes):
                want = table.digest_of.get(batch.experts[row]) if table is not None else None
                batch.dumps.append((batch.experts[row], it.data[i].to("cpu", copy=True), want, batch.fps[row].digest))

    # ------------------------------------------------------------ accounting

    def _account(self, event: CaptureEvent, results, seconds: float) -> str | None:
        """Counts, coverage, metrics and the manifest for one load; the mismatch sentence
        (fresh or remembered mismatches) or None. Remembered verdicts of unchanged weights
        (resident_cache on) are counted as reused and left out of the pass's coverage: nothing
        read those bytes again."""
        counts: dict[tuple[int | str, str], list[int]] = {}  # (layer label, tensor) -> [match, mismatch, unverified]
        label = event.layer if event.model == "target" else f"{event.model}:{event.layer}"  # the metrics' layer
        bad, fresh_bad, verified_rows, unverified_rows = [], 0, {}, {}
        source = self.by_source.setdefault(event.source, dict.fromkeys(VERDICTS, 0))
        for it, flags, chunks, _ in results:
            c = [flags.count(MATCH), flags.count(MISMATCH), flags.count(UNVERIFIED)]
            if c[1]:
                ids = [e for e, f in zip(event.experts, flags) if f == MISMATCH]
                bad.append(f"{it.name} of expert{'s' if len(ids) > 1 else ''} {format_ids(ids)}")
            if chunks is None:  # not read again: a write through .data would not show, so it is not verified
                self.tensors["reused"] += len(flags)
                verified_rows[(event.layer, it.name)], unverified_rows[(event.layer, it.name)] = 0, len(flags)
                continue
            verified_rows[(event.layer, it.name)] = c[0] + c[1]
            unverified_rows[(event.layer, it.name)] = c[2]
            counts[(label, it.name)] = c
            fresh_bad += c[1]
            if c[2] and self.expected is not None:
                where = f"{'' if event.model == 'target' else event.model + ' '}layer {event.layer} {it.name}"
                self.gaps[where] = self.gaps.get(where, 0) + c[2]
            for word, n in zip(VERDICTS, c):
                self.tensors[word] += n
                source[word] += n
        if counts:
            totals = [sum(c[i] for c in counts.values()) for i in range(3)]
            result = "mismatch" if totals[1] else "unverified" if totals[2] else "ok"
            self.loads[result] += 1
            self.seconds += seconds
            self.max_load_seconds = max(self.max_load_seconds, seconds)
            if totals[0] + totals[1]:
                self.last_verified = time.time()
                self.metrics.verified_at(self.last_verified)
            self.metrics.load(event.source, counts, result, seconds)
        self._count_pass(event, verified_rows, unverified_rows)
        message = None
        if bad:
            n = sum(flags.count(MISMATCH) for _, flags, _, _ in results)
            what = "staged load" if event.source == "staged" else "resident weights"
            index = self.expected.path if self.expected is not None else self.config.index
            layer = f"{'' if event.model == 'target' else event.model + ' '}layer {event.layer}"
            message = (f"moetrace guard: rank {self.sink.label} step {event.step} {layer} {what}: "
                       f"{n} tensor{'s do' if n > 1 else ' does'} not match the index {index} ({'; '.join(bad)})")
            if fresh_bad:
                if len(self.mismatches) < _KEEP:
                    self.mismatches.append({"step": event.step, "source": event.source, "model": event.model,
                                            "layer": event.layer,
                                            "capture_seq": event.capture_seq, "tensors": fresh_bad,
                                            "what": "; ".join(bad)})
                self._act(event, message)
            elif self.action == "fail-closed":
                self._act(event, message)
        self.publish()
        return message

    def _count_pass(self, event: CaptureEvent, verified_rows: dict, unverified_rows: dict) -> None:
        """Pass coverage of the target model (a draft counts its own passes)."""
        if event.model != "target":
            return
        held = (event.source, event.layer)
        if event.slot_count is not None and self._held.get(held) != event.slot_count:
            self._held[held] = event.slot_count
            self._expected_per_pass.pop(event.source, None)
        step, rows, missed = self._pass.get(event.source, (event.step, {}, {}))
        if step != event.step:
            rows, missed = {}, {}
        rows.update(verified_rows)
        missed.update(unverified_rows)  # captured, never compared: counted against coverage
        self._pass[event.source] = (event.step, rows, missed)
        total = self._expected_count(event.source) if self.expected is not None else 0
        if total:
            self.coverage[event.source] = round(min(1.0, sum(rows.values()) / (total + sum(missed.values()))), 6)
            self.metrics.pass_coverage(event.source, self.coverage[event.source])

    def _expected_count(self, source: str) -> int:
        """Expected tensors of one pass of `source` (an EP or KT rank holds some of the
        logical experts the index lists: a layer counts the slots its captures held)."""
        n = self._expected_per_pass.get(source)
        if n is None:
            s = self.config.sampling
            held = {layer: k for (src, layer), k in self._held.items() if src == source}
            n = self._expected_per_pass[source] = self.expected.expected_in(s.layers, s.experts, s.tensors, held)
        return n

    def _act(self, event: CaptureEvent, message: str) -> None:
        if self.action == "fail-closed":
            self.failed_closed = {"at": utc_now(), "step": event.step, "source": event.source, "layer": event.layer,
                                  "message": message}
            log.error("%s; fail-closed: the layer is not used, the forward pass fails", message)
        elif self.action == "alert":
            now = time.monotonic()
            self._alerts = [t for t in self._alerts if now - t < 60.0]
            if len(self._alerts) < _ALERTS_PER_MINUTE:
                self._alerts.append(now)
                log.error("%s (ALERT)", message)
        elif not self._warned:
            self._warned = True
            log.warning("%s; recorded (metrics, manifest, trace rows); later mismatches are not logged", message)

    # ------------------------------------------------------------ weight updates

    def weights_updated(self, entry: str, model_path: str | None, ok: bool) -> None:
        """After a weight-update entry point: re-verify against the index of the new
        checkpoint when update_index_dir holds one, else every verdict is unverified."""
        index = self._update_index(model_path) if ok and model_path else None
        if index is not None:
            self._set_expected(index, None)
        else:
            why = "failed" if not ok else f"loaded {model_path}" if model_path else "wrote new weights"
            hint = (f"no index of {model_path} in {self.config.update_index_dir}" if model_path and
                    self.config.update_index_dir else "no index of the new weights (see update_index_dir)")
            self._set_expected(None, f"weights updated ({entry} {why}): {hint}; resident and staged experts "
                                        "are unverified")
            log.warning("moetrace guard on rank %d: %s", self.tp_rank, self.reason)
        result = "reverified" if self.expected is not None else "unverified"
        with self._lock:
            if len(self.updates) < _KEEP:
                self.updates.append({"at": utc_now(), "entry": entry, "model_path": model_path, "ok": bool(ok),
                                     "index": index if self.expected is not None else None})
        self.metrics.weight_update(entry, result)
        self.publish()

    def _update_index(self, model_path: str) -> str | None:
        """The index built from model_path at this TP size: the newest in update_index_dir,
        else the serving index itself (the same checkpoint loaded again, e.g. EPLB's recovery)."""
        from moetrace.checkpoints.index import index_metadata

        folder = self.config.update_index_dir
        names = sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []
        paths = [os.path.join(folder, n) for n in names if n.endswith(".parquet")]
        want, found = os.path.realpath(model_path), []
        for path in [p for p in paths if os.path.isfile(p)] + [self.config.index]:
            try:
                meta = index_metadata(path)
            except Exception as err:  # a bad file is skipped by name, never the re-verification with it
                why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                log.warning("moetrace guard on rank %d: update_index_dir: skipped %s (%s)", self.tp_rank, path, why)
                continue
            if os.path.realpath(str(meta.get("checkpoint_path") or "")) == want and meta.get("tp_size") == self.tp_size:
                found.append((os.path.getmtime(path) if path != self.config.index else 0.0, path))
        return max(found)[1] if found else None

    # ------------------------------------------------------------ manifest

    def manifest(self) -> dict:
        exp = self.expected
        return {
            "action": self.action, "rows": self.rows, "status": self.status, "status_reason": self.status_reason,
            "index": exp.path if exp is not None else self.config.index,
            "checkpoint_id": exp.checkpoint_id if exp is not None else None,
            "device": str(exp.device if exp is not None else self.device),
            "expected_tensors": exp.tensors if exp is not None else 0,
            "loads": dict(self.loads), "tensors": dict(self.tensors),
            "by_source": {k: dict(v) for k, v in self.by_source.items()}, "coverage": dict(self.coverage),
            "last_verified_at": None if self.last_verified is None else
            time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.last_verified)) + "Z",
            "seconds": round(self.seconds, 6), "max_load_seconds": round(self.max_load_seconds, 6),
            "mismatches": list(self.mismatches), "weight_updates": list(self.updates),
            "failed_closed": self.failed_closed, "metrics": self.metrics.describe(),
        }

    def publish(self) -> None:
        self.metrics.status(self.status)
        self.sink.update(guard=self.manifest())

    def stopped(self, reason: str) -> None:
        """Verification stopped (tracing disabled itself): unverified from now on."""
        with self._lock:
            self.expected, self.reason = None, reason
        log.error("moetrace guard on rank %d: %s; nothing is verified from now on", self.tp_rank, reason)
        self.publish()

    def close(self) -> None:
        self.publish()
        self.metrics.close()
