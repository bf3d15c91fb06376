"""Launching a server safely: a run id names one launch (a fresh run_nonce, an existing
run folder refused unless --replace clears it), the server's whole process group is
stopped (bounded grace, then killed; a second signal kills at once; no child outlives
the launcher), and audit --launch talks only to the server it started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner
from support.traces import write_scenario

from moetrace.cli import main
from moetrace.errors import MoetraceError
from moetrace.jobs.traffic import Traffic, drive
from moetrace.servers.launcher import Launcher
from moetrace.servers.process_group import session_listens, session_members


def launcher(out, cmd, run_id="X", **kw):
    lines: list[str] = []
    kw.setdefault("close_timeout_s", 0)  # no ranks here: do not wait for manifests
    return Launcher(cmd, {"out": str(out), "run_id": run_id}, server_flags="split", echo=lines.append, **kw), lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(script: str) -> list[str]:
    return ["sh", "-c", script, "server", "--tp", "2"]


def alive(pids) -> list[int]:
    """Those of `pids` still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


def pids_file_after(path, timeout=30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return [int(x) for x in path.read_text().split()]
        time.sleep(0.02)
    raise AssertionError(f"the fake server never wrote {path}")


# ---------------------------------------------------------------- 1. run identity


def test_reused_run_id_is_refused_and_leaves_the_old_trace_alone(small_model, small_index, tmp_path):
    """The issue's case: a clean run X, then a launch under the same id whose server
    never starts: it must not report the old trace as its own."""
    write_scenario(small_model, str(tmp_path), "X", [0])
    before = {p: p.read_bytes() for p in (tmp_path / "X").rglob("*") if p.is_file()}
    lch, _ = launcher(tmp_path, ["true", "--tp", "2"])
    with pytest.raises(MoetraceError, match=r"run folder .*X already exists .* --replace"):
        lch.run()
    assert lch.server is None  # refused before anything started
    assert {p: p.read_bytes() for p in (tmp_path / "X").rglob("*") if p.is_file()} == before
    port = free_port()
    r = CliRunner().invoke(main, ["audit", "--launch", f"true --tp 2 --port {port}", "--index", small_index,
                                  "--out", str(tmp_path), "--run-id", "X"])
    assert r.exit_code == 2 and "already exists" in r.output and "complete" not in r.output


def test_replace_clears_the_run_folder_first(small_model, tmp_path):
    write_scenario(small_model, str(tmp_path), "X", [0])
    lch, lines = launcher(tmp_path, ["true", "--tp", "2"], replace=True)
    assert lch.run() == 0
    assert sorted(p.name for p in (tmp_path / "X").iterdir()) == ["_run.json"]  # the stale ranks are gone
    run = json.loads((tmp_path / "X" / "_run.json").read_text())
    assert run["replaced"] is True and run["complete"] is False
    assert "no rank wrote a manifest" in " ".join(run["problems"])
    assert any("--replace: deleted the earlier run folder" in line for line in lines)


def test_run_file_with_a_fresh_nonce_is_written_before_the_server_starts(tmp_path):
    """The server sees OUT/X/_run.json already there, with the nonce its hooks carry."""
    seen = tmp_path / "seen.json"
    lch, _ = launcher(tmp_path / "out", sh(f"cat {tmp_path / 'out' / 'X' / '_run.json'} > {seen}"))
    lch2, _ = launcher(tmp_path / "out2", ["true"])
    assert lch.run() == 0
    early = json.loads(seen.read_text())
    hooks = json.loads(lch.cmd[lch.cmd.index("--forward-hooks") + 1])
    assert early["finished"] is False and len(early["run_nonce"]) == 32
    assert hooks[0]["config"]["run_nonce"] == early["run_nonce"] == lch.nonce
    assert lch2.nonce != lch.nonce  # every launch is a new one


def test_a_folder_mixing_launches_never_passes(small_model, small_index, tmp_path):
    from support.traces import patch_manifest

    from moetrace.analysis.report import analyze

    write_scenario(small_model, str(tmp_path), "X", [0])
    assert analyze([str(tmp_path / "X")], index=small_index).exit_code == 0
    patch_manifest(str(tmp_path), "X", 1, {"run_nonce": "f" * 32})  # rank 1 left by another launch
    with pytest.raises(MoetraceError, match="mixes launches: rank 1 has another run_nonce"):
        analyze([str(tmp_path / "X")], index=small_index)


# ---------------------------------------------------------------- 3. the server's process group


def test_sigterm_of_the_launcher_stops_the_servers_children(tmp_path):
    pids = tmp_path / "pids"
    lch, _ = launcher(tmp_path, sh(f'sleep 300 & echo $$ $! > {pids}; wait'))
    timer = threading.Thread(target=lambda: (pids_file_after(pids), os.kill(os.getpid(), signal.SIGTERM)))
    timer.start()
    assert lch.run() == 128 + signal.SIGTERM
    timer.join()
    assert alive(pids_file_after(pids)) == [] and session_members(lch.server.pid) == []
    run = json.loads((tmp_path / "X" / "_run.json").read_text())
    assert run["stop"]["signal"] == "SIGTERM" and run["stop"]["escalation"] == "none"


def test_a_server_ignoring_the_signal_is_killed_after_the_grace_period(tmp_path):
    pids = tmp_path / "pids"
    script = f'trap "" TERM; (trap "" TERM; sleep 300) & echo $$ $! > {pids}; wait'
    lch, lines = launcher(tmp_path, sh(script), stop_grace_s=0.5)
    threading.Thread(target=lambda: (pids_file_after(pids), lch.stop("test done")), daemon=True).start()
    lch.run()
    assert alive(pids_file_after(pids)) == []
    run = json.loads((tmp_path / "X" / "_run.json").read_text())
    assert run["stop"]["escalation"] == "grace-expired" and run["stop"]["group_killed"] is True
    assert any("still running after 0.5 s: killing the server's process group" in line for line in lines)


def test_a_second_signal_kills_at_once(tmp_path):
    """The grace period is long; only the second signal can end this run promptly
    (a watchdog kills the group after 60 s so a broken launcher fails instead of hanging)."""
    pids = tmp_path / "pids"
    script = f'trap "" INT TERM; (trap "" INT TERM; sleep 300) & echo $$ $! > {pids}; wait'
    lch, _ = launcher(tmp_path, sh(script), stop_grace_s=600)

    def press_ctrl_c_twice():
        got = pids_file_after(pids)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)
        for pid in alive(got):
            os.kill(pid, signal.SIGKILL)

    threading.Thread(target=press_ctrl_c_twice, daemon=True).start()
    lch.run()
    assert alive(pids_file_after(pids)) == []
    run = json.loads((tmp_path / "X" / "_run.json").read_text())
    assert run["stop"]["escalation"] == "second-signal" and run["stop"]["group_killed"] is True


def test_children_of_a_server_that_exited_on_its_own_are_reaped(tmp_path):
    pids = tmp_path / "pids"
    lch, _ = launcher(tmp_path, sh(f"sleep 300 & echo $$ $! > {pids}; exit 0"))
    lch.run()
    left = pids_file_after(pids)
    assert alive(left) == []
    run = json.loads((tmp_path / "X" / "_run.json").read_text())
    assert run["stop"]["escalation"] == "server-exited" and left[1] in run["stop"]["leftover_pids"]


# ---------------------------------------------------------------- 9. two processes, one port


def test_audit_launch_refuses_a_port_already_in_use(small_index, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        marker = tmp_path / "started"
        r = CliRunner().invoke(main, ["audit", "--launch", f"touch {marker} --tp 2 --port {port}", "--index", small_index,
                                      "--out", str(tmp_path / "out"), "--ready-timeout", "5"])
    assert r.exit_code == 2 and f"port {port} on 127.0.0.1 is already in use" in r.output, r.output
    assert not marker.exists() and not (tmp_path / "out").exists()  # nothing was launched


def test_traffic_goes_only_to_the_server_that_was_started(tmp_path):
    """Someone else answers on the port; the started server (not listening at all) is
    not the one answering: no request is sent and the traffic fails by name."""
    import http.server

    class Health(http.server.BaseHTTPRequestHandler):
        posts = 0

        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def do_POST(self):
            Health.posts += 1
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), Health)
    port = other.server_address[1]
    threading.Thread(target=other.serve_forever, daemon=True).start()
    ours = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert session_listens(os.getsid(0), port) is True  # the other server lives in this process
        check = {"how": None}
        res = drive(f"http://127.0.0.1:{port}", Traffic(requests=1, ready_timeout_s=5), lambda: True, lambda m: None,
                    lambda: session_listens(ours.pid, port), check)
    finally:
        ours.kill()
        ours.wait()
        other.shutdown()
    assert not res.ok and res.sent == 0 and Health.posts == 0
    assert "is not the one started" in res.error and check["listener_verified"] is False


def test_the_started_servers_listener_is_recognized(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(proc.stdout.readline().split(" port ")[1].split()[0])
        assert session_listens(proc.pid, port) is True
        assert session_listens(os.getsid(0), port) is False
    finally:
        proc.kill()
        proc.wait()
