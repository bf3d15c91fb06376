"""Traffic for `moetrace audit --launch`: start the server with capture hooks
(servers.launcher.Launcher: SGLang, the KT fork, vLLM or moetrace's emulator), wait for
/health, send prompts on the OpenAI /v1/completions endpoint (SGLang and vLLM both
serve it) that take the staged path (fresh long prompts, then the same prefixes
replayed with more text), stop the server cleanly (ranks close their traces first).
jobs.audit analyzes the run folder.
"""

from __future__ import annotations

import json
import shlex
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from moetrace.errors import MoetraceError
from moetrace.jobs.progress import Progress
from moetrace.servers.command import is_moetrace_serve

WORDS = ("expert", "slot", "rank", "layer", "scale", "fence", "copy", "stream", "event", "prefill", "chunk",
         "token", "shard", "weight", "block", "host", "device", "barrier", "writer", "reader")


@dataclass(frozen=True)
class Traffic:
    requests: int = 3  # fresh long prompts
    prompt_tokens: int | None = 2048  # about this many words each (None: audit --launch sizes them, jobs.staging)
    prompt_tokens_from: str = "--prompt-tokens"  # or "the staging threshold", "the default"
    replays: int = 1  # each prompt replayed this many times with an extension (prefix-cache hits)
    max_tokens: int = 4
    ready_timeout_s: float = 600.0
    request_timeout_s: float = 600.0


@dataclass
class TrafficResult:
    ok: bool = False
    sent: int = 0
    failed: int = 0
    error: str | None = None
    seconds_to_ready: float | None = None
    latencies_s: list[float] = field(default_factory=list)


def prompt(i: int, words: int) -> str:
    """A deterministic prompt of `words` words, different for each i."""
    n = len(WORDS)
    return " ".join(WORDS[(i * 7 + j * (i + 3) + j // n) % n] for j in range(max(1, words)))


def base_url_from(cmd: list[str], explicit: str | None) -> str:
    if explicit:
        return explicit.rstrip("/")
    if is_moetrace_serve(cmd) and not any(t == "--port" or t.startswith("--port=") for t in cmd):
        raise MoetraceError("--launch: `moetrace serve` picks a random port without --port; give it --port N "
                            "(or pass --base-url)")
    from moetrace.servers.vllm_command import DEFAULT_PORT, invokes_vllm

    host, port = "127.0.0.1", str(DEFAULT_PORT) if invokes_vllm(cmd) else "30000"  # the server's defaults
    for i, tok in enumerate(cmd):
        for flag, setter in (("--port", "port"), ("--host", "host")):
            if tok == flag and i + 1 < len(cmd):
                if setter == "port":
                    port = cmd[i + 1]
                else:
                    host = cmd[i + 1]
            elif tok.startswith(flag + "="):
                if setter == "port":
                    port = tok.split("=", 1)[1]
                else:
                    host = tok.split("=", 1)[1]
    if port == "0":
        raise MoetraceError("--launch: the server command uses --port 0; give a fixed --port or --base-url")
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://{host}:{port}"


def _get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def _host_port(base_url: str) -> tuple[str, int | None]:
    u = urllib.parse.urlsplit(base_url)
    try:
        return u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return u.hostname or "", None


def _is_local(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "") or host.startswith("127.")


def check_port_free(base_url: str) -> dict:
    """Before launching: nothing may answer where the new server will listen, or the
    traffic would go to that other process. Returns the port_check record."""
    host, port = _host_port(base_url)
    check = {"host": host, "port": port, "free_before_launch": None, "listener_verified": None, "how": None}
    if port is None or not _is_local(host):
        check["how"] = "not checked: the server URL is not on this machine"
        return check
    try:
        with socket.create_connection((host or "127.0.0.1", port), timeout=1.0):
            pass
    except OSError:
        check["free_before_launch"] = True
        return check
    raise MoetraceError(f"--launch: port {port} on {host} is already in use by another process (it answered before "
                        "the server was started); stop it, or give the server another --port")


def drive(base_url: str, traffic: Traffic, server_alive: Callable[[], bool], echo: Callable[[str], None],
          listener_is_ours: Callable[[], bool | None] | None = None, port_check: dict | None = None,
          live: Progress | None = None) -> TrafficResult:
    """Wait for health, check the server answering is the one started (its process
    group holds the listening socket), then send the prompts; never raises. ``live``:
    a live line while waiting, a bar over the requests."""
    live = live or Progress.off()
    with live.step(f"waiting for {base_url}/health"):
        res = _wait_healthy(base_url, traffic, server_alive)
    if res.error is not None:
        return res
    return _send(base_url, traffic, server_alive, echo, listener_is_ours, port_check, live, res)


def _wait_healthy(base_url: str, traffic: Traffic, server_alive: Callable[[], bool]) -> TrafficResult:
    res = TrafficResult()
    t0 = time.monotonic()
    while True:
        if not server_alive():
            res.error = f"the server exited before {base_url}/health answered"
            return res
        try:
            if _get(f"{base_url}/health", timeout=5) == 200:
                break
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() - t0 > traffic.ready_timeout_s:
            res.error = (f"the server never answered {base_url}/health within {traffic.ready_timeout_s:.0f} s "
                         "(--ready-timeout; is --port/--base-url right?)")
            return res
        time.sleep(0.5)
    res.seconds_to_ready = round(time.monotonic() - t0, 2)
    return res


def _send(base_url: str, traffic: Traffic, server_alive: Callable[[], bool], echo: Callable[[str], None],
          listener_is_ours, port_check: dict | None, live: Progress, res: TrafficResult) -> TrafficResult:
    ours = listener_is_ours() if listener_is_ours is not None else None
    if port_check is not None:
        port_check["listener_verified"] = ours
        how = ("/proc: a process of the server's session holds the listening socket" if ours
               else "/proc" if ours is False else "cannot tell on this system")
        port_check["how"] = port_check["how"] or how
    if ours is False:
        res.error = (f"the server answering {base_url} is not the one started (no process of its group listens on "
                     "that port): another process holds it; no traffic sent")
        return res
    echo(f"moetrace: server healthy at {base_url} after {res.seconds_to_ready} s; sending "
         f"{traffic.requests} fresh prompts x (1 + {traffic.replays} replays) of ~{traffic.prompt_tokens} words")
    total = traffic.requests * (traffic.replays + 1)
    with live.bar("requests", total) as bar:
        for i in range(traffic.requests):
            base = prompt(i, traffic.prompt_tokens)
            for r in range(traffic.replays + 1):
                text = base if r == 0 else f"{base} {prompt(1000 + i * 10 + r, 16)}"
                bar.relabel(f"requests (now {'a fresh prompt' if r == 0 else f'replay {r}'})")
                t = time.monotonic()
                try:
                    _post(f"{base_url}/v1/completions",
                          {"prompt": text, "max_tokens": traffic.max_tokens, "temperature": 0},
                          traffic.request_timeout_s)
                    res.sent += 1
                    res.latencies_s.append(round(time.monotonic() - t, 3))
                except (urllib.error.URLError, OSError, ValueError) as err:
                    res.failed += 1
                    res.error = f"request {res.sent + res.failed} failed: {err}"
                    if not server_alive():
                        return res
                bar.advance()
    res.ok = res.failed == 0
    return res


def split_command(command: str) -> list[str]:
    """--launch CMD as the shell would split it; a quoting mistake is one line."""
    try:
        return shlex.split(command)
    except ValueError as err:
        raise MoetraceError(f"--launch {command!r}: cannot split the command like a shell would ({err})") from None


def launch_and_drive(server_cmd: str | list[str], config: dict, traffic: Traffic, base_url: str | None = None,
                     echo: Callable[[str], None] = print, live: Progress | None = None,
                     **launcher_kwargs) -> tuple[str, int, TrafficResult]:
    """Run the server under the Launcher, drive traffic from a thread, stop it.

    Returns (run folder URL/path, server exit code, traffic result).
    """
    from moetrace.jobs.staging import command_staging
    from moetrace.servers.launcher import Launcher
    from moetrace.servers.process_group import session_listens

    cmd = split_command(server_cmd) if isinstance(server_cmd, str) else list(server_cmd)
    if not cmd:
        raise MoetraceError("--launch: empty server command")
    url = base_url_from(cmd, base_url)
    port_check = check_port_free(url)
    launcher = Launcher(cmd, config, echo=echo, **launcher_kwargs)
    launcher.run_manifest["port_check"] = port_check
    launcher.run_manifest["staging"] = command_staging(cmd)  # what the command says; the ranks record the server's
    launcher.run_manifest["traffic"] = {"requests": traffic.requests, "prompt_tokens": traffic.prompt_tokens,
                                        "replays": traffic.replays, "max_tokens": traffic.max_tokens,
                                        "prompt_tokens_from": traffic.prompt_tokens_from}
    host, port = _host_port(url)
    result = TrafficResult()

    def listener_is_ours() -> bool | None:
        if launcher.server is None or port is None or not _is_local(host):
            return None
        return session_listens(launcher.server.pid, port)

    def worker():
        nonlocal result
        try:
            result = drive(url, traffic, lambda: launcher.proc is None or launcher.proc.poll() is None, echo,
                           listener_is_ours, port_check, live)
        except Exception as err:  # drive never raises; belt and braces for the thread
            result.error = f"traffic driver crashed: {err}"
        finally:
            # Same path as a Ctrl-C: ranks close their traces, then SIGTERM.
            launcher.stop("traffic done")

    thread = threading.Thread(target=worker, name="moetrace-traffic", daemon=True)
    thread.start()
    code = launcher.run()
    thread.join(timeout=30)
    return f"{launcher.config['out'].rstrip('/')}/{launcher.run_id}", code, result
