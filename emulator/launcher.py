"""Start, watch and stop the rank processes of one emulated server; always clean up.

``RankGroup`` spawns ``tp`` rank processes (multiprocessing "spawn", like
SGLang's workers), collects their messages, and on any exit path (normal
stop, a rank's error or death, the caller's exception, interpreter exit)
stops the survivors (stop request, then SIGTERM, then SIGKILL), unlinks every
shared-memory segment of the run's prefix and removes its temp directory.

``start_server`` returns a ``ServerHandle`` for a listening HTTP server
(demos, audits, tests); ``serve`` is the blocking CLI body.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from typing import Callable

from moetrace import outputs
from moetrace.emulator import shm
from moetrace.emulator.config import EmulatorConfig
from moetrace.emulator.rank import RankJob, rank_main
from moetrace.emulator.weights import weights_dims
from moetrace.errors import MoetraceError

# --ready-file replaces only an earlier server's ready file (its own fields)
READY_FILE = outputs.json_document("a moetrace serve ready file",
                                   lambda doc: {"url", "port", "rank_pids", "shm_prefix"} <= doc.keys())


class EmulatorError(MoetraceError):
    """A rank failed, died or timed out; the message names the rank and why."""

    exit_code = 1  # the server process failed, as a process exits; not an audit verdict (errors.ExitCode)


class RankGroup:
    def __init__(self, cfg: EmulatorConfig, mode: str, requests=(), bench: dict | None = None):
        cfg.validate()
        self.dims = weights_dims(cfg.weights, cfg.tp)
        cfg.validate(self.dims)
        self.cfg = cfg
        self.mode = mode
        self.world = cfg.tp
        self.prefix = cfg.shm_prefix or shm.new_prefix()
        self.tmpdir = tempfile.mkdtemp(prefix="moetrace-emu-")
        ctx = mp.get_context("spawn")
        self.status_q = ctx.Queue()
        self.cmd_qs = [ctx.Queue() for _ in range(self.world - 1)]
        self.stop_event = ctx.Event()
        job = RankJob(cfg, mode, self.prefix, os.path.join(self.tmpdir, "store"), os.getpid(), tuple(requests), bench)
        self.procs = [
            ctx.Process(target=rank_main, args=(r, job, self.status_q, self.cmd_qs, self.stop_event),
                        name=f"moetrace-emu-rank{r}", daemon=True)
            for r in range(self.world)
        ]
        self.messages: list[tuple] = []
        self.errors: dict[int, dict] = {}
        self.closed = False
        self.stop_requested = False
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        atexit.register(self.close)

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def poll(self, timeout: float = 0.0) -> list[tuple]:
        """Drain the ranks' messages (waiting up to ``timeout`` for the first)."""
        got = []
        try:
            msg = self.status_q.get(timeout=timeout) if timeout > 0 else self.status_q.get_nowait()
            while True:
                got.append(msg)
                msg = self.status_q.get_nowait()
        except (queue.Empty, EOFError, OSError, ValueError):
            pass
        with self._lock:
            for m in got:
                self.messages.append(m)
                if m[0] == "error":
                    self.errors.setdefault(m[1], m[2])
        return got

    @property
    def stopping(self) -> bool:
        """A stop was asked for: by the launcher, or by POST /shutdown (the shared stop event)."""
        return self.stop_requested or self.stop_event.is_set()

    def failure(self) -> str | None:
        """Why the group failed, or None: a rank's error, or a rank gone before it was asked to stop."""
        if self.errors:
            rank = min(self.errors)
            return f"rank {rank}: {self.errors[rank]['message']}"
        for r, p in enumerate(self.procs):
            if p.pid is not None and not p.is_alive() and not self.stopping:
                code = p.exitcode
                if code == 0 and self.mode != "serve":
                    continue
                signalled = code is not None and code < 0
                how = f"killed by {signal.Signals(-code).name}" if signalled else f"exit code {code}"
                return f"rank {r} (pid {p.pid}) exited unexpectedly ({how})"
        return None

    def wait_for(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            self.poll(0.1)
            if done():
                return
            err = self.failure()
            if err:
                raise EmulatorError(f"emulator {what} failed: {err}")
            if time.monotonic() > deadline:
                raise EmulatorError(f"emulator {what} timed out after {timeout:g} s")

    def of_kind(self, kind: str) -> dict[int, dict]:
        with self._lock:
            return {m[1]: m[2] for m in self.messages if m[0] == kind}

    def request_stop(self) -> None:
        self.stop_requested = True
        self.stop_event.set()

    def stop(self, grace_s: float = 15.0) -> None:
        """Ask the ranks to exit, then SIGTERM, then SIGKILL; then clean up."""
        self.request_stop()
        self._join(grace_s)
        self.close()

    def _join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
            self.poll()

    def kill(self) -> None:
        self.stop_requested = True
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.kill()
        self._join(5.0)

    def close(self) -> None:
        """Idempotent: no rank left running, no segment, no temp dir."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        self.stop_requested = True
        self.stop_event.set()
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
        self._join(3.0)
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(5.0)
        self.poll()
        shm.sweep(self.prefix)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        for q in [self.status_q, *self.cmd_qs]:
            q.close()
            q.cancel_join_thread()
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def exit_code(self) -> int:
        if self.errors:
            return 1
        codes = [p.exitcode for p in self.procs if p.pid is not None]
        return 0 if codes and all(c == 0 for c in codes) else 1


class ServerHandle:
    """A running emulated server. ``stop()`` (or leaving the ``with`` block) shuts it down."""

    def __init__(self, group: RankGroup):
        self.group = group
        self.host = group.cfg.host
        self.port: int | None = None
        self._done = threading.Event()
        self._failure: str | None = None
        self._monitor = threading.Thread(target=self._watch, name="moetrace-emu-monitor", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pids(self) -> list[int]:
        return self.group.pids

    @property
    def shm_prefix(self) -> str:
        return self.group.prefix

    @property
    def failure(self) -> str | None:
        return self._failure

    def _start(self, ready_timeout: float) -> "ServerHandle":
        g = self.group
        g.start()
        try:
            g.wait_for(lambda: len(g.of_kind("ready")) == g.world and 0 in g.of_kind("listening"),
                       ready_timeout, "start-up")
        except BaseException:
            g.close()
            raise
        self.port = g.of_kind("listening")[0]["port"]
        self._monitor.start()
        return self

    def _watch(self) -> None:
        g = self.group
        while not g.closed:
            g.poll(0.2)
            if not g.stopping:
                err = g.failure()
                if err:
                    self._failure = err
                    g.close()
                    break
            if all(p.exitcode is not None for p in g.procs):
                g.close()
                break
        self._done.set()

    def request_stop(self) -> None:
        self.group.request_stop()

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until every rank exited and the run is cleaned up; its exit code (None on timeout)."""
        if not self._done.wait(timeout):
            return None
        return 1 if self._failure else self.group.exit_code()

    def stop(self, timeout: float = 30.0) -> int:
        self.request_stop()
        rc = self.wait(timeout)
        if rc is None:
            self.group.close()
            self._done.wait(5.0)
            return 1
        return rc

    def kill(self) -> None:
        self.group.kill()
        self.group.close()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(config: EmulatorConfig, ready_timeout: float | None = None) -> ServerHandle:
    """Spawn the ranks and return once rank 0 is listening (``handle.port``)."""
    group = RankGroup(config, "serve")
    return ServerHandle(group)._start(ready_timeout or config.startup_timeout_s)


def serve(config: EmulatorConfig, echo: Callable[[str], None] = print, ready_file: str | None = None) -> int:
    """The ``moetrace serve`` body: run until /shutdown, SIGTERM or SIGINT (twice: kill)."""
    handle = start_server(config)
    signals: list[int] = []

    def on_signal(signum, frame):
        signals.append(signum)
        if len(signals) == 1:
            handle.request_stop()
        else:
            handle.kill()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        info = {"url": handle.url, "port": handle.port, "pid": os.getpid(), "rank_pids": handle.pids,
                "shm_prefix": handle.shm_prefix, "tp": config.tp, "fence": config.fence}
        if ready_file:
            outputs.write_local_text(ready_file, "--ready-file", json.dumps(info), ours=READY_FILE)
        echo(f"moetrace serve: listening on {handle.url} (tp={config.tp}, fence={config.fence}, "
             f"slow_rank={config.slow_rank}, pid {os.getpid()})")
        rc = None
        while rc is None:
            rc = handle.wait(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        handle.group.close()
    if handle.failure:
        echo(f"moetrace serve: {handle.failure}")
    else:
        echo("moetrace serve: stopped")
    return rc
