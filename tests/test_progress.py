"""Progress on stderr: live lines on a terminal only (never with --json or into a pipe),
erased when their step ends; audit --launch shows a bar over its requests."""

from __future__ import annotations

import http.server
import io
import json
import threading
import time

from moetrace.jobs import progress as P
from moetrace.jobs.progress import Progress
from moetrace.jobs.traffic import Traffic, drive


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_live_lines_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(P, "TICK_S", 0.01)
    tty, pipe = Terminal(), io.StringIO()
    for stream in (tty, pipe):
        prog = Progress(stream=stream)
        with prog.step("writing the checkpoint"):
            with prog.step("inner"):
                time.sleep(0.05)
        with prog.bar("requests", 2) as bar:
            bar.advance()
            # the ticker thread redraws every TICK_S; on a loaded machine it may take longer than 50 ms
            deadline = time.monotonic() + 10
            while (stream is tty and "1/2" not in tty.getvalue() and time.monotonic() < deadline) or (
                    stream is pipe and time.monotonic() < deadline - 9.95):
                time.sleep(0.01)
    out = tty.getvalue()
    assert "writing the checkpoint ... 0 s" in out and "writing the checkpoint: inner ... 0 s" in out
    assert f"requests [{'#' * 10}{' ' * 10}] 1/2 0 s" in out
    assert out.endswith(P.CLEAR)  # erased at the end: the command's own output stays clean
    assert pipe.getvalue() == ""  # not a terminal: nothing
    quiet = Terminal()
    with Progress(enabled=False, stream=quiet).step("x"):  # --json
        pass
    assert quiet.getvalue() == ""


def test_a_line_of_the_command_never_shares_a_row_with_the_live_line():
    tty = Terminal()
    prog = Progress(stream=tty)
    with prog.step("running"):
        prog.above("moetrace: server healthy", lambda m: tty.write(m + "\n"))
    out = tty.getvalue()
    # cleared before the line, drawn again after it
    assert f"{P.CLEAR}moetrace: server healthy\n{P.CLEAR}running ... 0 s" in out


def test_audit_traffic_shows_a_bar_over_its_requests(monkeypatch):
    monkeypatch.setattr(P, "TICK_S", 0.01)

    class Server(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def do_POST(self):
            time.sleep(0.05)  # a request that takes a while: the bar is redrawn meanwhile
            body = json.dumps({"choices": []}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tty = Terminal()
    try:
        res = drive(f"http://127.0.0.1:{server.server_address[1]}", Traffic(requests=2, replays=1, ready_timeout_s=5),
                    lambda: True, lambda m: None, live=Progress(stream=tty))
    finally:
        server.shutdown()
    assert res.ok and res.sent == 4
    out = tty.getvalue()
    assert "waiting for http://127.0.0.1:" in out
    assert "requests (now a fresh prompt) [" in out and "requests (now replay 1) [" in out
    assert "] 3/4 " in out and out.endswith(P.CLEAR)
