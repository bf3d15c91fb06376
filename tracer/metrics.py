"""The guard's Prometheus metrics (prometheus-client, imported only when the guard is on).

Where they appear: inside an SGLang server started with ``--enable-metrics`` the
workers inherit ``PROMETHEUS_MULTIPROC_DIR`` and every metric made here is written to
that folder, so SGLang's own ``/metrics`` (a ``MultiProcessCollector``) serves it
beside ``sglang:*``; gauges say how processes combine (``mostrecent``, per ``tp_rank``
label). Otherwise, with ``metrics_port``, each rank serves its own registry on
127.0.0.1:port+tp_rank; else the counts stay in the manifest only. docs/guard.md
lists every metric.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger("moetrace.guard")

PREFIX = "moetrace_"  # no colon: colons are for recording rules, and OpenMetrics writes a counter's samples without one
STATUSES = ("ok", "mismatch", "unverified", "waiting")
LOAD_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_TICK_S = 1.0


def multiproc_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


class GuardMetrics:
    """One rank's metrics. ``exporter``: "sglang" (multiprocess files under SGLang's
    /metrics), "port" (own loopback server on ``port``) or "none" (``reason`` says why)."""

    def __init__(self, tp_rank: int, metrics_port: int | None, counters: Callable[[], dict]):
        self.rank = str(int(tp_rank))
        self.exporter, self.port, self.reason = "none", None, None
        self._counters = counters  # the sink's error and drop counts, mirrored on every tick
        self._seen: dict[tuple, int] = {}
        self._server = None
        self._last_verified = None
        self._started = time.time()
        self._stop = threading.Event()
        self._ok = False
        try:
            import prometheus_client as prom
            from prometheus_client import values
        except ImportError:
            self.reason = "prometheus-client is not installed (pip install 'moetrace[guard]')"
            return
        shared = multiproc_dir() is not None and values.ValueClass is not values.MutexValue
        registry = None if shared else prom.CollectorRegistry()
        self._make(prom, registry)
        if shared:
            self.exporter = "sglang"
            if metrics_port is not None:
                self.reason = "metrics_port ignored: PROMETHEUS_MULTIPROC_DIR is set, SGLang's /metrics serves them"
        elif metrics_port is not None:
            port = 0 if metrics_port == 0 else int(metrics_port) + int(tp_rank)
            try:
                if port > 65535:  # hook-spec/launch refuse it when they know the TP size
                    raise ValueError(f"metrics_port {metrics_port} + tp_rank {tp_rank} is past port 65535")
                self._server, _ = prom.start_http_server(port, addr="127.0.0.1", registry=registry)
                self.exporter, self.port = "port", int(self._server.server_port)
            except (OSError, OverflowError, ValueError) as err:
                self.reason = f"cannot serve metrics on 127.0.0.1:{port} ({err})"
                log.error("moetrace guard: %s; the counts stay in the manifest", self.reason)
        else:
            self.reason = "no exporter: start SGLang with --enable-metrics or give metrics_port"
        self._ok = True
        threading.Thread(target=self._tick, name=f"moetrace-metrics-r{self.rank}", daemon=True).start()

    def _make(self, prom, registry) -> None:
        r, g = ["tp_rank"], dict(registry=registry)
        by_tensor = r + ["layer", "tensor", "source"]
        self.verified = prom.Counter(PREFIX + "guard_tensors_verified", "Tensors compared with the index on the "
                                     "device, by verdict (match, mismatch)", by_tensor + ["verdict"], **g)
        self.mismatched = prom.Counter(PREFIX + "guard_tensors_mismatched", "Tensors whose digest is not the "
                                       "index's", by_tensor, **g)
        self.unverified = prom.Counter(PREFIX + "guard_tensors_unverified", "Captured tensors the guard could not "
                                       "check (no index entry, index unreadable, weights updated without an index)",
                                       by_tensor, **g)
        self.loads = prom.Counter(PREFIX + "guard_loads_verified", "Staged loads and resident captures checked, by "
                                  "result (ok, mismatch, unverified)", r + ["source", "result"], **g)
        self.updates = prom.Counter(PREFIX + "guard_weight_updates", "Weight updates seen, by entry point and what "
                                    "the guard verifies after them (reverified, unverified)", r + ["entry", "result"],
                                    **g)
        self.hook_errors = prom.Counter(PREFIX + "hook_errors", "Errors caught in moetrace's hooks", r, **g)
        self.sink_errors = prom.Counter(PREFIX + "sink_errors", "Errors of moetrace's trace writer", r, **g)
        self.dropped = prom.Counter(PREFIX + "rows_dropped", "Trace rows lost, by reason", r + ["reason"], **g)
        self.coverage = prom.Gauge(PREFIX + "guard_pass_coverage", "Share of this rank's expected tensors verified "
                                   "in the last pass (0-1)", r + ["source"], multiprocess_mode="mostrecent", **g)
        self.last = prom.Gauge(PREFIX + "guard_last_verified_timestamp_seconds", "Unix time of the last tensor "
                               "verified", r, multiprocess_mode="mostrecent", **g)
        self.since = prom.Gauge(PREFIX + "guard_seconds_since_last_verification", "Seconds since a tensor was last "
                                "verified (since the guard started, if none was)", r, multiprocess_mode="mostrecent",
                                **g)
        self.status_gauge = prom.Gauge(PREFIX + "guard_status", "1 for the guard's current status (ok, mismatch, "
                                       "unverified, waiting)", r + ["status"], multiprocess_mode="mostrecent", **g)
        self.seconds = prom.Histogram(PREFIX + "guard_load_seconds", "The guard's own time per load (fingerprint, "
                                      "compare, result copy)", r + ["source"], buckets=LOAD_BUCKETS, **g)
        for counter in (self.hook_errors, self.sink_errors):  # present at 0 from the start, as alerts expect
            counter.labels(self.rank)

    # ------------------------------------------------------------ updates

    def load(self, source: str, counts: dict[tuple[int, str], list[int]], result: str, seconds: float) -> None:
        """One checked load: counts[(layer, tensor)] = [match, mismatch, unverified]."""
        if not self._ok:
            return
        for (layer, tensor), (match, mismatch, unverified) in counts.items():
            labels = (self.rank, str(layer), tensor, source)
            if match:
                self.verified.labels(*labels, "match").inc(match)
            if mismatch:
                self.verified.labels(*labels, "mismatch").inc(mismatch)
                self.mismatched.labels(*labels).inc(mismatch)
            if unverified:
                self.unverified.labels(*labels).inc(unverified)
        self.loads.labels(self.rank, source, result).inc()
        self.seconds.labels(self.rank, source).observe(seconds)

    def verified_at(self, when: float) -> None:
        self._last_verified = when
        if self._ok:
            self.last.labels(self.rank).set(when)
            self.since.labels(self.rank).set(0.0)

    def pass_coverage(self, source: str, value: float) -> None:
        if self._ok:
            self.coverage.labels(self.rank, source).set(value)

    def status(self, status: str) -> None:
        if self._ok:
            for s in STATUSES:
                self.status_gauge.labels(self.rank, s).set(1.0 if s == status else 0.0)

    def weight_update(self, entry: str, result: str) -> None:
        if self._ok:
            self.updates.labels(self.rank, entry, result).inc()

    # ------------------------------------------------------------ the ticker

    def _tick(self) -> None:
        while not self._stop.wait(_TICK_S):
            try:
                self.sync()
            except Exception as err:  # a metric must never take the rank down
                log.debug("moetrace metrics tick: %s", err)

    def sync(self) -> None:
        """Seconds since the last verification; the sink's counters mirrored (monotonic)."""
        if not self._ok:
            return
        self.since.labels(self.rank).set(time.time() - (self._last_verified or self._started))
        c = self._counters()
        self._mirror(("hook_errors",), self.hook_errors.labels(self.rank), c["hook_errors"])
        self._mirror(("sink_errors",), self.sink_errors.labels(self.rank), c["sink_errors"])
        for reason, n in c["drops"].items():
            self._mirror(("drops", reason), self.dropped.labels(self.rank, reason), n)

    def _mirror(self, key: tuple, counter, value: int) -> None:
        delta = int(value) - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._seen[key] = int(value)

    def describe(self) -> dict:
        return {"exporter": self.exporter, "port": self.port, "reason": self.reason}

    def close(self) -> None:
        self._stop.set()
        if self._ok:
            try:
                self.sync()
            except Exception:
                pass
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
