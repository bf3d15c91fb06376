"""``moetrace launch -- <sglang command>``: run a server with capture hooks on.

Appends the moetrace ``--forward-hooks`` entry (merged into one the command
already has) and the CUDA-graph flags for the SGLang version. A run id names one
launch: an existing run folder is refused (``replace`` deletes it first), and
``_run.json`` with a fresh ``run_nonce`` is written before the server starts; the
same nonce goes to every rank through the hook config. The server runs as the
leader of its own session (servers.process_group). On SIGINT/SIGTERM (or ``stop``) every
rank is first asked to close its trace (a control file the ranks' writer threads
poll) and the launcher waits, bounded, for their manifests to say ``finished``
(SGLang's shutdown SIGKILLs its workers, so without this no rank could finish);
then the whole process group is signalled, given ``stop_grace_s`` seconds, and
killed. A second signal kills the group at once; nothing of the group outlives
the launcher.

``OUT/<run_id>/_run.json`` records the command, versions, start/end, the
server's exit code, why and how it was stopped and a per-rank summary;
``complete`` is true only when every expected rank of this launch closed cleanly
with rows written, nothing dropped and no hook errors, and the server did not
exit non-zero on its own; ``problems`` says why not. The launcher ends with one
summary line.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Callable, Sequence

import pyarrow.fs as pafs

from moetrace import outputs, storage
from moetrace.errors import MoetraceError
from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec, index_fits
from moetrace.schema import label_key, parse_rank_label
from moetrace.servers import vllm_command
from moetrace.servers.command import (
    FLAG_CHOICES,
    LEGACY_CUDA_GRAPH_FLAGS,
    build_command,
    cuda_graph_flags_for,
    expected_tp,
    invokes_sglang,
    model_path_of_command,
    server_distribution,
)
from moetrace.servers.process_group import ServerGroup
from moetrace.tracer.claim import REFUSED_PREFIX, read_refusals
from moetrace.tracer.completeness import common_value, expected_labels, expected_rank_count, run_problems
from moetrace.tracer.config import check_metrics_ports
from moetrace.tracer.manifest import RUN_MANIFEST_NAME, new_run_manifest, read_manifests, utc_now


def rank_summary(manifests: dict[str, dict], expected_ranks: int | None) -> list[dict]:
    """One entry per expected rank (every TP rank of every stage and replica the
    manifests name; per rank found when the TP size is unknown); a rank without a
    manifest is listed with present: false."""
    keys = ("finished", "close_reason", "disabled", "rows_written", "rows_dropped", "hook_errors", "sink_errors",
            "online")
    want = expected_labels(manifests, expected_ranks) or []
    out = []
    for r in sorted(set(want) | set(manifests), key=label_key):
        m = manifests.get(r, {})
        replica, pp, tp = parse_rank_label(r) or (None, 0, 0)
        out.append({"rank_label": r, "tp_rank": m.get("tp_rank", tp), "pp_rank": m.get("pp_rank", pp or 0),
                    "replica": m.get("replica", replica), "present": r in manifests, **{k: m.get(k) for k in keys}})
    return out


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
    guards = [m["guard"] for m in manifests.values() if isinstance(m.get("guard"), dict)]
    if guards:  # the guard's counts: its trace rows may be the mismatches only
        t = {k: sum(int((g.get("tensors") or {}).get(k) or 0) for g in guards) for k in ("match", "mismatch")}
        loads = sum(int((g.get("loads") or {}).get("mismatch") or 0) for g in guards)
        line += (f"; guard: {t['match'] + t['mismatch']:,} tensors verified, {t['mismatch']:,} mismatched in "
                 f"{loads:,} loads")
    elif online and (match or mismatch or indexed):
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
    """One launch: refuses (or with ``replace``, clears) an existing run folder, writes
    ``_run.json`` with a fresh ``run_nonce`` before the server starts, runs the server as
    the leader of its own session, and stops the whole group (servers.process_group)."""

    def __init__(self, cmd: Sequence[str], config: dict, *, server_flags: str = "auto",
                 disable_cuda_graph: bool = True, close_timeout_s: float = 20.0, stop_grace_s: float = 30.0,
                 replace: bool = False, echo: Callable[[str], None] = print,
                 targets: Sequence[str] = DEFAULT_TARGETS, server_log=None):
        if not cmd:
            raise MoetraceError("launch: give the server command after --, e.g. moetrace launch --out t -- python -m "
                                "sglang.launch_server ...")
        if server_flags not in FLAG_CHOICES:
            raise MoetraceError(f"--server-flags {server_flags!r}: expected one of {', '.join(FLAG_CHOICES)}")
        self.user_cmd = list(cmd)
        self.echo = echo
        self.server_log = server_log  # an open file for the server's output (default: moetrace's stderr)
        self.close_timeout_s = close_timeout_s
        self.stop_grace_s = stop_grace_s
        self.replace = replace
        # vLLM takes the config through its plugin and the environment (servers.vllm_command)
        self.vllm = vllm_command.invokes_vllm(self.user_cmd)
        dist = vllm_command.vllm_distribution() if self.vllm else server_distribution()
        self.sglang_version, how = (dist[1], "distribution") if dist and not self.vllm else (None, "unknown")
        self.version_found_by = how
        self._server_flags, self._distribution = server_flags, dist
        self.flags: tuple[str, ...] | None = None  # None: the server's --help decides, in run()
        self.flags_found_by: str | None = None
        if self.vllm:
            self.flags, self.flags_found_by = vllm_command.eager_flags(self.user_cmd, keep=not disable_cuda_graph)
        elif not disable_cuda_graph:
            self.flags, self.flags_found_by = (), "kept"
        elif server_flags != "auto" or (dist is not None and dist[0] == "sglang-kt"):
            self.flags, self.flags_found_by = cuda_graph_flags_for(self.user_cmd, server_flags, dist)
        config = dict(config)
        config.pop("run_nonce", None)  # every launch is a new one, whatever a hook config file says
        self.spec = hook_spec(config, targets)
        self.config = self.spec[0]["config"]
        if self.config.get("index"):  # what the server command tells: its TP size and checkpoint folder
            index_fits(self.config["index"], expected_tp(self.user_cmd), model_path_of_command(self.user_cmd))
        check_metrics_ports(self.config.get("metrics_port"), expected_tp(self.user_cmd))
        self.run_id, self.nonce = self.config["run_id"], self.config["run_nonce"]
        self.control_dir = tempfile.mkdtemp(prefix="moetrace-ctl-")
        self.control_file = self.config["control_file"] = os.path.join(self.control_dir, f"{self.run_id}.close")
        if self.vllm:
            self.spec = vllm_command.plugin_spec(self.config)
        self.cmd = self.build()
        self.expected_ranks = expected_tp(self.user_cmd)
        self.fs, base = storage.open_fs(self.config["out"])
        self.run_dir = storage.join(base, self.run_id)
        self.server: ServerGroup | None = None
        self._signals: list[int] = []  # signal numbers (and _Stop requests), in arrival order
        self._stop_requested_at: float | None = None  # monotonic time the first stop was acted on
        self._stop = {"signal": None, "reason": None, "escalation": None, "grace_s": stop_grace_s,
                      "group_killed": False, "leftover_pids": []}
        self.run_manifest = new_run_manifest(
            self.run_id, self.config["out"], run_nonce=self.nonce, replaced=replace, sglang_version=self.sglang_version,
            sglang_version_found_by=how, server_distribution={"name": dist[0], "version": dist[1]} if dist else None,
            cuda_graph_flags=list(self.flags or ()), cuda_graph_flags_found_by=self.flags_found_by,
            user_command=self.user_cmd, command=self.cmd, hook_spec=self.spec, expected_ranks=self.expected_ranks,
            tp_size=self.expected_ranks, checkpoint_id=self.config.get("checkpoint_id"),
        )

    def build(self) -> list[str]:
        """The command the server runs: the user's, with moetrace's hook flags."""
        if self.vllm:
            return self.user_cmd + [f for f in self.flags if f not in self.user_cmd]
        return build_command(self.user_cmd, self.spec, self.flags or ())

    def server_env(self) -> dict[str, str]:
        """The server's environment: ours, the run id, and for vLLM the hook config."""
        env = dict(os.environ, MOETRACE_RUN_ID=self.run_id)
        if self.vllm:
            env.update(vllm_command.server_env(self.config))
        return env

    @property
    def proc(self) -> subprocess.Popen | None:
        return None if self.server is None else self.server.proc

    def _write(self) -> None:
        storage.make_dirs(self.fs, self.run_dir)
        storage.write_json(self.fs, storage.join(self.run_dir, RUN_MANIFEST_NAME), self.run_manifest)

    def _claim_run_dir(self) -> None:
        """A run id names one launch: an existing run folder is refused (its trace would
        pass for this run's), or with ``replace`` deleted first; then _run.json is written."""
        out = self.config["out"]
        outputs.check_output(out, "--out", kind="dir")
        try:
            used = bool(storage.list_dir(self.fs, self.run_dir))
            if used and not self.replace:
                raise MoetraceError(
                    f"run folder {self.run_dir} already exists (run id {self.run_id!r} was used before, and its trace "
                    "would pass for this one's): pick another --run-id, or pass --replace to delete it first")
            if used:
                self._check_replaceable()
                storage.remove_tree(self.fs, self.run_dir)
                self.echo(f"moetrace: --replace: deleted the earlier run folder {self.run_dir}")
            self._probe_flags()
            self._write()
        except MoetraceError:
            raise
        except Exception as err:
            raise MoetraceError(f"--out {out}: cannot write {self.run_dir}/{RUN_MANIFEST_NAME} "
                                f"({_first_line(err)})") from None

    def _check_replaceable(self) -> None:
        """--replace deletes a run folder only when everything in it is moetrace's: its
        _run.json, rank folders, refusal records and their temp files; never through a
        link, never a folder holding anything else."""
        local = outputs.local_path(self.run_dir)
        if local is not None and os.path.islink(local.rstrip("/")):
            raise MoetraceError(f"--replace: run folder {self.run_dir} is a symbolic link; moetrace deletes only "
                                "folders it wrote, never through a link")
        for info in storage.list_dir(self.fs, self.run_dir):
            name = info.base_name
            ours = (name == RUN_MANIFEST_NAME or name.startswith((REFUSED_PREFIX, f".{RUN_MANIFEST_NAME}.tmp-"))
                    or (name.startswith("rank=") and info.type == pafs.FileType.Directory))
            if ours and local is not None and os.path.islink(os.path.join(local, name)):
                ours = False
            if not ours:
                raise MoetraceError(f"--replace: run folder {self.run_dir} holds {name}, which moetrace did not "
                                    "write; it deletes only its own run folders: move that away or pick another "
                                    "--run-id")

    def _probe_flags(self) -> None:
        """--server-flags auto without the fork's distribution: the server command's own
        --help decides (run only once the launch is not refused, and only for a command
        that starts SGLang itself: anything else might ignore --help and serve)."""
        if self.flags is not None:
            return
        if invokes_sglang(self.user_cmd):
            self.flags, self.flags_found_by = cuda_graph_flags_for(self.user_cmd, self._server_flags,
                                                                   self._distribution)
        else:
            self.flags, self.flags_found_by = LEGACY_CUDA_GRAPH_FLAGS, "default"
        self.cmd = self.build()
        self.run_manifest.update(cuda_graph_flags=list(self.flags), cuda_graph_flags_found_by=self.flags_found_by,
                                 command=self.cmd)

    def _on_signal(self, signum, frame) -> None:
        self._signals.append(signum)

    def stop(self, reason: str) -> None:
        """Ask the run loop to close the traces, then stop the server, exactly as a
        first SIGTERM does, but reported as ``moetrace: <reason>: ...`` and recorded
        as ``stop_reason`` in ``_run.json``. Safe to call from any thread, before or
        during ``run()``; returns at once. A stop never escalates: once a stop (or a
        signal) is being handled, a later ``stop`` does nothing (a second outside
        signal kills the server's process group at once)."""
        self._signals.append(_Stop(str(reason)))  # list.append is atomic; the run loop polls

    def _second_signal(self) -> bool:
        """A signal from outside after the one being handled: kill now, wait no more."""
        return any(not isinstance(s, _Stop) for s in self._signals[1:])

    def request_close(self, timeout: float) -> bool:
        """Ask every rank to close its trace; wait until this launch's manifests say
        finished (bounded; a second signal cuts the wait short)."""
        with open(self.control_file, "w") as f:
            f.write(utc_now() + "\n")
        start = time.monotonic()
        while time.monotonic() < start + timeout and not self._second_signal():
            ms = {r: m for r, m in read_manifests(self.config["out"], self.run_id).items()
                  if m.get("run_nonce") == self.nonce}
            if not ms and time.monotonic() > start + 2.0:
                return False  # no rank ever opened a trace: nothing to wait for
            want = expected_labels(ms, self.expected_ranks) if ms else None
            if ms and all(m.get("finished") for m in ms.values()) and (want is None or set(want) <= set(ms)):
                return True
            if self.server is not None and self.server.poll() is not None:
                return False
            time.sleep(0.1)
        return False

    def run(self) -> int:
        self._claim_run_dir()
        self.echo(f"moetrace: run {self.run_id} -> {self.run_dir}")
        self.echo("moetrace: " + " ".join(self.cmd[:3]) + " ... " + " ".join(self.flags))
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.server = ServerGroup(self.cmd, self.server_env(), self.server_log)
            self.run_manifest["server_pid"] = self.server.pid
            self._write()
            while self.server.poll() is None:
                if self._signals:
                    self._stop_server(self._signals[0])
                    break
                time.sleep(0.1)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._finish()
        rc = self.server.returncode
        return 128 - rc if rc is not None and rc < 0 else int(rc or 0)

    def _stop_server(self, sig: int) -> None:
        """Close the traces (bounded), signal the server's whole process group, wait the
        grace period, then kill the group; a second outside signal kills at once."""
        name = signal.Signals(int(sig)).name
        reason = sig.reason if isinstance(sig, _Stop) else name
        self._stop_requested_at = time.monotonic()
        self._stop.update(signal=name, reason=reason)
        self.run_manifest.update(stop_signal=name, stop_reason=reason)
        self.echo(f"moetrace: {reason}: closing traces, then stopping the server")
        self.run_manifest["ranks_closed_before_stop"] = self.request_close(self.close_timeout_s)
        if not self._second_signal():
            self.server.signal(int(sig))
            if self.server.wait_gone(self.stop_grace_s, interrupted=self._second_signal):
                self._stop["escalation"] = "none"
                return
        how = "second-signal" if self._second_signal() else "grace-expired"
        why = "second signal" if how == "second-signal" else f"still running after {self.stop_grace_s:g} s"
        self.echo(f"moetrace: {why}: killing the server's process group")
        self._stop.update(escalation=how, group_killed=True)
        self.server.kill()

    def _reap_group(self) -> None:
        """No process of the server's group outlives the launcher: a leader that exited on
        its own may leave workers behind; they get SIGTERM, a short grace, then SIGKILL."""
        left = self.server.members()
        if left:
            self._stop["leftover_pids"] = left
            self._stop["escalation"] = self._stop["escalation"] or "server-exited"
            self.server.signal(signal.SIGTERM)
            if not self.server.wait_gone(min(5.0, self.stop_grace_s), interrupted=self._second_signal):
                self._stop["group_killed"] = True
                self.server.kill()
        self.server.reap()

    def _finish(self) -> None:
        if self.server is not None:
            if self.server.poll() is None:
                self._stop["group_killed"] = True
                self.server.kill()
            self._reap_group()
        try:
            manifests = read_manifests(self.config["out"], self.run_id)
        except Exception as err:  # an unreadable output must not hide the server's fate
            manifests = {}
            self.echo(f"moetrace: warning: cannot read the rank manifests: {err}")
        exit_code = None if self.server is None else self.server.returncode
        try:
            refusals = read_refusals(self.fs, self.run_dir)
        except Exception:
            refusals = []
        problems = run_problems(manifests, self.expected_ranks, server_started=self.server is not None,
                                server_exit_code=exit_code, stop_requested=self._stop_requested_at is not None,
                                nonce=self.nonce, refusals=refusals)
        ours = {r: m for r, m in manifests.items() if m.get("run_nonce") == self.nonce}
        self.run_manifest.update(
            finished_at=utc_now(),
            finished=True,
            server_exit_code=exit_code,
            stop=dict(self._stop),
            tp_size=expected_rank_count(ours, self.expected_ranks),
            ep_size=common_value(ours, "ep_size"),
            checkpoint_id=common_value(ours, "checkpoint_id") or self.config.get("checkpoint_id"),
            ranks=rank_summary(ours, self.expected_ranks),
            complete=not problems,
            problems=problems,
        )
        try:
            self._write()
        except Exception as err:
            self.echo(f"moetrace: warning: cannot write {RUN_MANIFEST_NAME}: {err}")
        shutil.rmtree(self.control_dir, ignore_errors=True)
        self.echo(summary_line(self.run_id, ours, self.expected_ranks, problems))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def launch(cmd: Sequence[str], config: dict, **kwargs) -> int:
    return Launcher(cmd, config, **kwargs).run()
