"""The emulated server: HTTP start/health/completion/shutdown, the CLI, and clean-up
after normal stops and after SIGKILLed ranks (no processes, no /dev/shm segments)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from moetrace.emulator import as_config, shm, start_server


def _get(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def _post(url: str, body: dict, timeout: float = 60):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie is gone too (its parent just has not reaped it yet)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pids, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt()


def test_http_health_completion_shutdown(ckpt):
    handle = start_server(as_config(ckpt, tp=2, fence="all"))
    pids = handle.pids
    try:
        assert handle.port and len(pids) == 2
        assert _get(handle.url + "/health") == (200, {"status": "ok"})
        assert _get(handle.url + "/v1/models")[1]["data"][0]["id"] == "moetrace-emulator"
        prompt = "A long enough prompt to take the staged path, twice over."
        code, body = _post(handle.url + "/v1/completions",
                           {"prompt": prompt, "max_tokens": 3, "return_token0_logits": True})
        assert code == 200
        choice = body["choices"][0]
        assert len(choice["token_ids"]) == 3 and isinstance(choice["text"], str)
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["moetrace"]["staged_loads"] == 4 and len(body["moetrace"]["token0_logits"]) == 256
        # token ids in, same greedy answer out; the replay hits the prefix cache
        code, again = _post(handle.url + "/v1/completions", {"prompt": list(prompt.encode()), "max_tokens": 3})
        assert again["choices"][0]["token_ids"] == choice["token_ids"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        with pytest.raises(urllib.error.HTTPError) as bad:
            _post(handle.url + "/v1/completions", {"prompt": ""})
        assert bad.value.code == 400
        assert _post(handle.url + "/shutdown", {}) == (200, {"status": "shutting down"})
        assert handle.wait(30) == 0
    finally:
        handle.stop()
    assert _wait_gone(pids)
    assert shm.list_segments(handle.shm_prefix) == []


def test_sigkilled_rank_is_cleaned_up_by_the_launcher(ckpt):
    # Keep the names linked while running, so the launcher's sweep is what removes them.
    handle = start_server(as_config(ckpt, tp=2, unlink_after_attach=False))
    pids = handle.pids
    try:
        assert len(shm.list_segments(handle.shm_prefix)) == 2 * 4 + 1  # 4 slots per rank + control block
        os.kill(pids[1], signal.SIGKILL)
        assert handle.wait(30) == 1
        assert "rank 1" in handle.failure and "SIGKILL" in handle.failure
    finally:
        handle.stop()
    assert _wait_gone(pids)  # rank 0 was stopped too
    assert shm.list_segments(handle.shm_prefix) == []


def test_cli_serve_sigterm(ckpt, tmp_path):
    ready = tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "moetrace.cli", "serve", str(ckpt), "--tp", "2", "--fence", "none",
           "--ready-file", str(ready), "--disable-prefill-cuda-graph", "--disable-decode-cuda-graph"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        # serve --help names exactly the keys the ready file holds
        from click.testing import CliRunner

        from moetrace.cli import main

        helped = re.search(r"Write \{([^}]*)\}", " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split()))
        assert helped and sorted(k.strip(' "') for k in helped.group(1).split(",")) == sorted(info)
        assert _get(info["url"] + "/health")[0] == 200
        code, body = _post(info["url"] + "/v1/completions", {"prompt": "x" * 40, "max_tokens": 2})
        assert code == 200 and len(body["choices"][0]["token_ids"]) == 2
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert f"listening on {info['url']}" in out and "stopped" in out
    assert _wait_gone(info["rank_pids"])
    assert shm.list_segments(info["shm_prefix"]) == []


def test_cli_serve_refuses_bad_input(tmp_path):
    from support.cli import cli, one_line_error

    one_line_error(cli("serve", tmp_path / "missing"), str(tmp_path / "missing"))
    one_line_error(cli("serve"), "give the checkpoint directory")
