"""The server's process group: start it in its own session, signal the whole group,
wait a bounded grace period, then kill what is left; and who listens on a port.

A server (SGLang, the KT fork, the emulator) forks workers; signalling its PID alone
leaves them running with PPID 1. Every member of the session started here is found
through /proc (Linux) so the launcher can report, and kill, leftovers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Mapping, Sequence

from moetrace.errors import MoetraceError


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):  # pytest's capture, io.StringIO
        return False


class ServerGroup:
    """One server command running as the leader of a new session (pgid == sid == pid)."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str] | None = None, log=None):
        """log: an open file for the server's stdout and stderr (default: moetrace's stderr
        for both: moetrace's stdout holds its own verdict, never a server's access log)."""
        out = log if log is not None else (sys.stderr.fileno() if _has_fileno(sys.stderr) else None)
        try:
            self.proc = subprocess.Popen(list(cmd), env=dict(env) if env is not None else None, start_new_session=True,
                                         stdout=out, stderr=log)
        except OSError as err:
            raise MoetraceError(f"launch: cannot start {cmd[0]} ({err.strerror or err})") from None
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def members(self) -> list[int]:
        """PIDs still in the server's session (the leader included while it lives)."""
        return session_members(self.pid)

    def signal(self, sig: int) -> None:
        """Signal every process of the group (the leader's children too)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        for pid in self.members():  # members that left the group but not the session
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def wait_gone(self, timeout: float, interrupted=lambda: False) -> bool:
        """Wait until the leader exited and no member is left; False on timeout or
        when `interrupted()` turns true (a second Ctrl-C)."""
        deadline = time.monotonic() + timeout
        while True:
            self.proc.poll()
            if self.proc.returncode is not None and not self.members():
                return True
            if interrupted() or time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def reap(self) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # state ppid pgrp session ...


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes whose session id is `sid`; [] where /proc is absent."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        f = _stat_fields(name)
        if f is not None and f[0] != "Z" and int(f[3]) == sid:
            out.append(int(name))
    return sorted(out)


def _listening_inodes(port: int) -> set[int] | None:
    found, readable = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(cols[9]))  # 0A: LISTEN
    return found if readable else None


def session_listens(sid: int, port: int) -> bool | None:
    """Does a process of session `sid` hold the socket listening on TCP `port`?
    None when this system cannot tell (no /proc)."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    want = {f"socket:[{i}]" for i in inodes}
    for pid in session_members(sid) if want else ():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in want:
                    return True
            except OSError:
                continue
    return False
