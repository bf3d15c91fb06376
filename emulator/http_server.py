"""OpenAI-compatible HTTP front end of rank 0 (stdlib ``http.server``, loopback).

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /get_model_info``,
``POST /v1/completions`` (greedy; ``prompt`` a string or token ids;
``max_tokens``), ``POST /shutdown`` (loopback clients only). Handler threads
only parse and queue; rank 0's main loop runs the requests one at a time, in
lockstep with the other ranks.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import queue
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from moetrace.emulator.engine import normalize_request
from moetrace.errors import MoetraceError

REQUEST_TIMEOUT_S = 600.0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class CompletionServer:
    """Owns the HTTP server thread and the request queue."""

    def __init__(self, host: str, port: int, model_name: str, info: dict, on_shutdown: Callable[[], None]):
        if not _is_loopback(host):
            raise MoetraceError(f"the emulator serves on loopback only, got --host {host}")
        self.model_name = model_name
        self.info = info
        self.on_shutdown = on_shutdown
        self.stopping = threading.Event()
        self._work: queue.Queue[tuple[dict, Future]] = queue.Queue()
        self._ids = itertools.count()
        self.httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def next_request(self, timeout: float) -> tuple[dict, Future] | None:
        try:
            return self._work.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.stopping.set()
        while True:  # fail whatever is still queued
            try:
                _, fut = self._work.get_nowait()
            except queue.Empty:
                break
            fut.set_exception(MoetraceError("server is shutting down"))
        self.httpd.shutdown()
        self.httpd.server_close()

    def completion_response(self, req: dict, gen, staged_loads: int) -> dict:
        n_prompt, n_out = len(gen.prompt_ids), len(gen.output_ids)
        body = {
            "id": f"cmpl-{next(self._ids)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": gen.text, "logprobs": None, "finish_reason": "length",
                         "token_ids": gen.output_ids}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                      "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}},
            "moetrace": {"prompt_token_ids": gen.prompt_ids, "prefill_chunks": gen.chunks,
                         "staged_loads": staged_loads},
        }
        if req.get("return_token0_logits"):
            body["moetrace"]["token0_logits"] = gen.token0_logits.tolist()
        return body

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # quiet: the launcher prints what matters
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, code: int, message: str) -> None:
                self._send(code, {"error": {"message": message, "type": "invalid_request_error" if code < 500
                                            else "server_error", "code": code}})

            def _json_body(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                return json.loads(raw or b"{}")

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path in ("/health", "/health_generate"):
                    if server.stopping.is_set():
                        return self._error(503, "shutting down")
                    return self._send(200, {"status": "ok"})
                if path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [
                        {"id": server.model_name, "object": "model", "owned_by": "moetrace"}]})
                if path == "/get_model_info":
                    return self._send(200, server.info)
                return self._error(404, f"no route {path}")

            def do_POST(self):
                path = self.path.split("?", 1)[0]
                if path == "/shutdown":
                    if not _is_loopback(self.client_address[0]):
                        return self._error(403, "shutdown is accepted from loopback only")
                    self._send(200, {"status": "shutting down"})
                    server.stopping.set()
                    server.on_shutdown()
                    return None
                if path not in ("/v1/completions", "/generate"):
                    return self._error(404, f"no route {path}")
                try:
                    body = self._json_body()
                    req = normalize_request(body)
                    req["return_token0_logits"] = bool(body.get("return_token0_logits"))
                except (ValueError, MoetraceError) as err:
                    return self._error(400, str(err))
                if server.stopping.is_set():
                    return self._error(503, "shutting down")
                fut: Future = Future()
                server._work.put((req, fut))
                try:
                    return self._send(200, fut.result(timeout=REQUEST_TIMEOUT_S))
                except Exception as err:
                    return self._error(500, f"{type(err).__name__}: {err}")

        return Handler
