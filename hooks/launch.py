"""``moetrace launch -- <sglang command>``: run a server with capture hooks on.

Appends the moetrace ``--forward-hooks`` entry (merged into one the command
already has) and the CUDA-graph flags for the SGLang version, runs the server
in its own process group, and on SIGINT/SIGTERM first asks every rank to close
its trace (a control file the ranks' writer threads poll), waits for their
manifests to say ``finished`` (bounded), then forwards the signal. SGLang's
shutdown SIGKILLs its workers, so without this step no rank could finish its
manifest. A second signal kills the server's process group.

``OUT/<run_id>/_run.json`` records the command, versions, start/end, the
server's exit code, why it was stopped and a per-rank summary; ``complete`` is
true only when every expected rank closed cleanly with rows written, nothing
dropped and no hook errors, and the server did not exit non-zero on its own;
``problems`` says why not. ``Launcher.stop(reason)`` (any thread) stops the run
the way a first SIGTERM does. The launcher ends with one summary line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Callable, Sequence

from moetrace.errors import MoetraceError
from moetrace.hooks.server import FLAG_CHOICES, cuda_graph_flags_for, server_distribution
from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec
from moetrace import storage
from moetrace.tracer.manifest import (
    RUN_MANIFEST_NAME,
    common_value,
    expected_labels,
    expected_rank_count,
    label_key,
    new_run_manifest,
    read_refusals,
    read_manifests,
    run_problems,
    utc_now,
)

TP_FLAGS = ("--tp", "--tp-size", "--tensor-parallel-size")


def _flag_value(cmd: Sequence[str], names: Sequence[str]) -> str | None:
    for i, arg in enumerate(cmd):
        for n in names:
            if arg == n and i + 1 < len(cmd):
                return cmd[i + 1]
            if arg.startswith(n + "="):
                return arg.split("=", 1)[1]
    return None


def expected_tp(cmd: Sequence[str]) -> int | None:
    v = _flag_value(cmd, TP_FLAGS)
    return int(v) if v and v.isdigit() else None


def build_command(cmd: Sequence[str], spec: list[dict], flags: Sequence[str]) -> list[str]:
    """cmd + merged --forward-hooks + the CUDA-graph flags it does not have yet."""
    out: list[str] = []
    merged = False
    i = 0
    cmd = list(cmd)
    while i < len(cmd):
        arg = cmd[i]
        if arg == "--forward-hooks" or arg.startswith("--forward-hooks="):
            raw = arg.split("=", 1)[1] if "=" in arg else (cmd[i + 1] if i + 1 < len(cmd) else "[]")
            i += 1 if "=" in arg else 2
            try:
                existing = json.loads(raw)
            except json.JSONDecodeError as err:
                raise MoetraceError(f"--forward-hooks in the server command is not JSON ({err})") from None
            existing = existing if isinstance(existing, list) else [existing]
            out += ["--forward-hooks", json.dumps(existing + spec)]
            merged = True
            continue
        out.append(arg)
        i += 1
    if not merged:
        out += ["--forward-hooks", json.dumps(spec)]
    for f in flags:
        if f not in out:
            out.append(f)
    return out


def rank_summary(manifests: dict[str, dict], expected_ranks: int | None) -> list[dict]:
    """One entry per expected rank (every TP rank of every stage and replica the
    manifests name; per rank found when the TP size is unknown); a rank without a
    manifest is listed with present: false."""
    keys = ("tp_rank", "pp_rank", "replica", "finished", "close_reason", "disabled", "rows_written", "rows_dropped",
            "hook_errors", "sink_errors", "online")
    want = expected_labels(manifests, expected_ranks) or []
    labels = sorted(set(want) | set(manifests), key=label_key)
    return [{"rank_label": r, "present": r in manifests, **{k: manifests.get(r, {}).get(k) for k in keys}}
            for r in labels]


def summary_line(run_id: str, manifests: dict[str, dict], expected_ranks: int | None, problems: list[str]) -> str:
    """The launcher's one-line end-of-run report."""
    if problems:
        return f"moetrace: run {run_id} INCOMPLETE: " + "; ".join(problems)
    n = len(expected_labels(manifests, expected_ranks) or manifests)
    finished = sum(1 for m in manifests.values() if m.get("finished"))

    def total(key):
        return sum(int(m.get(key) or 0) for m in manifests.values())

    line = (f"moetrace: run {run_id} complete: {finished}/{n} ranks finished, {total('rows_written'):,} rows, "
            f"{total('rows_dropped'):,} dropped, {total('hook_errors'):,} hook errors")
    online = [m["online"] for m in manifests.values() if isinstance(m.get("online"), dict)]
    match = sum(int(o.get("match") or 0) for o in online)
    mismatch = sum(int(o.get("mismatch") or 0) for o in online)
    unchecked = sum(int(o.get("unchecked") or 0) for o in online)
    indexed = any((m.get("config") or {}).get("index") for m in manifests.values())
    if online and (match or mismatch or indexed):
        line += f"; online check: {match:,} match, {mismatch:,} mismatch"
        if unchecked:
            line += f", {unchecked:,} unchecked"
    return line


class _Stop(int):
    """A stop request from Launcher.stop: SIGTERM's number, plus the caller's reason."""

    def __new__(cls, reason: str):
        obj = super().__new__(cls, int(signal.SIGTERM))
        obj.reason = reason
        return obj


class Launcher:
    def __init__(self, cmd: Sequence[str], config: dict, *, server_flags: str = "auto",
                 disable_cuda_graph: bool = True, close_timeout_s: float = 20.0,
                 echo: Callable[[str], None] = print, targets: Sequence[str] = DEFAULT_TARGETS):
        if not cmd:
            raise MoetraceError("launch: give the server command after --, e.g. moetrace launch --out t -- python -m sglang.launch_server ...")
        if server_flags not in FLAG_CHOICES:
            raise MoetraceError(f"--server-flags {server_flags!r}: expected one of {', '.join(FLAG_CHOICES)}")
        self.user_cmd = list(cmd)
        self.echo = echo
        self.close_timeout_s = close_timeout_s
        dist = server_distribution()
        self.sglang_version, how = (dist[1], "distribution") if dist else (None, "unknown")
        self.version_source = how
        self.flags, self.flags_source = cuda_graph_flags_for(self.user_cmd, server_flags, dist) \
            if disable_cuda_graph else ((), "kept")
        self.control_dir = tempfile.mkdtemp(prefix="moetrace-ctl-")
        config = dict(config)
        self.spec = hook_spec(config, targets)
        run_id = self.spec[0]["config"]["run_id"]
        self.control_file = os.path.join(self.control_dir, f"{run_id}.close")
        self.spec[0]["config"]["control_file"] = self.control_file
        self.config = self.spec[0]["config"]
        self.run_id = run_id
        self.cmd = build_command(self.user_cmd, self.spec, self.flags)
        self.expected_ranks = expected_tp(self.user_cmd)
        self.fs, base = storage.open_fs(self.config["out"])
        self.run_dir = storage.join(base, run_id)
        self.proc: subprocess.Popen | None = None
        self._signals: list[int] = []  # signal numbers (and _Stop requests), in arrival order
        self._stop_requested_at: float | None = None  # monotonic time the first stop was acted on
        self.run_manifest = new_run_manifest(
            run_id, self.config["out"], sglang_version=self.sglang_version, sglang_version_source=how,
            server_distribution={"name": dist[0], "version": dist[1]} if dist else None,
            cuda_graph_flags=list(self.flags), cuda_graph_flags_source=self.flags_source,
            user_command=self.user_cmd, command=self.cmd, hook_spec=self.spec,
            expected_ranks=self.expected_ranks, tp_size=self.expected_ranks,
            checkpoint_id=self.config.get("checkpoint_id"),
        )

    def _write(self) -> None:
        storage.make_dirs(self.fs, self.run_dir)
        storage.write_json(self.fs, storage.join(self.run_dir, RUN_MANIFEST_NAME), self.run_manifest)

    def _on_signal(self, signum, frame) -> None:
        self._signals.append(signum)

    def stop(self, reason: str) -> None:
        """Ask the run loop to close the traces, then stop the server, exactly as a
        first SIGTERM does, but reported as ``moetrace: <reason>: ...`` and recorded
        as ``stop_reason`` in ``_run.json``. Safe to call from any thread, before or
        during ``run()``; returns at once. A stop never escalates: once a stop (or a
        signal) is being handled, a later ``stop`` does nothing (a second outside
        signal still kills the server's process group)."""
        self._signals.append(_Stop(str(reason)))  # list.append is atomic; the run loop polls

    def request_close(self, timeout: float) -> bool:
        """Ask every rank to close its trace; wait until their manifests say finished."""
        with open(self.control_file, "w") as f:
            f.write(utc_now() + "\n")
        start = time.monotonic()
        while time.monotonic() < start + timeout:
            ms = read_manifests(self.config["out"], self.run_id)
            if not ms and time.monotonic() > start + 2.0:
                return False  # no rank ever opened a trace: nothing to wait for
            want = expected_labels(ms, self.expected_ranks) if ms else None
            if ms and all(m.get("finished") for m in ms.values()) and (want is None or set(want) <= set(ms)):
                return True
            if self.proc is not None and self.proc.poll() is not None:
                return False
            time.sleep(0.1)
        return False

    def run(self) -> int:
        try:
            self._write()
        except Exception as err:
            raise MoetraceError(f"output {self.config['out']}: cannot write {RUN_MANIFEST_NAME} ({err})") from None
        self.echo(f"moetrace: run {self.run_id} -> {self.run_dir}")
        self.echo("moetrace: " + " ".join(self.cmd[:3]) + " ... " + " ".join(self.flags))
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        env = dict(os.environ, MOETRACE_RUN_ID=self.run_id)
        forwarded = 0
        try:
            try:
                self.proc = subprocess.Popen(self.cmd, env=env, start_new_session=True)
            except OSError as err:
                raise MoetraceError(f"launch: cannot start {self.cmd[0]} ({err})") from None
            self.run_manifest["server_pid"] = self.proc.pid
            self._write()
            while self.proc.poll() is None:
                if len(self._signals) > forwarded:
                    sig = self._signals[forwarded]
                    forwarded += 1
                    if forwarded == 1:
                        name = signal.Signals(int(sig)).name
                        reason = sig.reason if isinstance(sig, _Stop) else name
                        self._stop_requested_at = time.monotonic()
                        self.run_manifest.update(stop_signal=name, stop_reason=reason)
                        self.echo(f"moetrace: {reason}: closing traces, then stopping the server")
                        self.run_manifest["ranks_closed_before_stop"] = self.request_close(self.close_timeout_s)
                        self._send(int(sig))
                    elif not isinstance(sig, _Stop):
                        self._kill_group()
                time.sleep(0.1)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._finish()
        rc = self.proc.returncode
        return 128 - rc if rc is not None and rc < 0 else int(rc or 0)

    def _send(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _finish(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._kill_group()
            self.proc.wait()
        try:
            manifests = read_manifests(self.config["out"], self.run_id)
        except Exception as err:  # an unreadable output must not hide the server's fate
            manifests = {}
            self.echo(f"moetrace: warning: cannot read the rank manifests: {err}")
        exit_code = None if self.proc is None else self.proc.returncode
        try:
            fs, base = storage.open_fs(self.config["out"])
            refusals = read_refusals(fs, storage.join(base, self.run_id))
        except Exception:
            refusals = []
        problems = run_problems(manifests, self.expected_ranks, server_started=self.proc is not None,
                                server_exit_code=exit_code, stop_requested=self._stop_requested_at is not None,
                                refusals=refusals)
        self.run_manifest.update(
            finished_at=utc_now(),
            finished=True,
            server_exit_code=exit_code,
            tp_size=expected_rank_count(manifests, self.expected_ranks),
            ep_size=common_value(manifests, "ep_size"),
            checkpoint_id=self.config.get("checkpoint_id") or common_value(manifests, "checkpoint_id"),
            ranks=rank_summary(manifests, self.expected_ranks),
            complete=not problems,
            problems=problems,
        )
        try:
            self._write()
        except Exception as err:
            self.echo(f"moetrace: warning: cannot write {RUN_MANIFEST_NAME}: {err}")
        shutil.rmtree(self.control_dir, ignore_errors=True)
        self.echo(summary_line(self.run_id, manifests, self.expected_ranks, problems))


def launch(cmd: Sequence[str], config: dict, **kwargs) -> int:
    return Launcher(cmd, config, **kwargs).run()
