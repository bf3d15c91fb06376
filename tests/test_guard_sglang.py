"""fail-closed through SGLang's own failure path (0.5.23, the parts that run on CPU):
a guarded staged load raises in the scheduler's forward pass; SGLang's
run_scheduler_process logs it and sends SIGQUIT to the server's main process, whose
SignalHandler kills the whole process tree; the client's request gets no response and
no token; the metrics written for SGLang's /metrics (PROMETHEUS_MULTIPROC_DIR, read by
the same MultiProcessCollector SGLang serves) and the trace's mismatch rows survive."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from support.traces import read_rows

from moetrace.checkpoints.index import write_index
from moetrace.checkpoints.index_build import build_index

pytest.importorskip("psutil")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang wheel not installed (make venv installs it with --no-deps)", allow_module_level=True)

CKPT = dict(num_layers=2, num_experts=8, hidden=128, intermediate=256, seed=3)


def _metrics(folder) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(folder))  # what SGLang's /metrics mounts
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_fail_closed_in_sglangs_scheduler_kills_the_server_before_a_token(make_ckpt, tmp_path):
    ckpt = make_ckpt(**CKPT)
    index = write_index(build_index(ckpt, 1), tmp_path / "index.parquet")
    (tmp_path / "prom").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"checkpoint": str(ckpt), "index": str(index),
                                                      "out": str(tmp_path / "traces"), "run_id": "crash"}))
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"))
    server = subprocess.Popen([sys.executable, "-c", "import sys; from support.sglang_crash import server_main; "
                               "server_main(sys.argv[1])", str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "port").exists():
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read() if server.poll() else "timeout"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{(tmp_path / 'port').read_text()}/generate"
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError, urllib.error.URLError)):
            urllib.request.urlopen(urllib.request.Request(url, data=b'{"text": "hi"}', method="POST"), timeout=240)
        code = server.wait(timeout=60)
        log = server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert code == -9, log  # kill_process_tree SIGKILLs the main process itself
    assert "Scheduler hit an exception" in log and "GuardMismatch: moetrace guard: rank 0 step 0 layer 0" in log, log
    assert "SIGQUIT received" in log, log
    assert not (tmp_path / "tokens").exists()  # the pass never completed: no token
    rows = read_rows(str(tmp_path / "traces"), "crash").to_pylist()
    assert [(r["layer"], r["expert"], r["online"]) for r in rows] == [(0, e, "mismatch") for e in range(6)]
    manifest = json.loads((tmp_path / "traces" / "crash" / "rank=0" / "_manifest.json").read_text())
    assert manifest["guard"]["failed_closed"]["layer"] == 0 and manifest["guard"]["metrics"]["exporter"] == "sglang"
    m = _metrics(tmp_path / "prom")
    labels = (("layer", "0"), ("source", "staged"), ("tensor", "w2_weight_scale_inv"), ("tp_rank", "0"))
    assert m[("moetrace_guard_tensors_mismatched_total", labels)] == 6
    assert m[("moetrace_guard_status", (("status", "mismatch"), ("tp_rank", "0")))] == 1
