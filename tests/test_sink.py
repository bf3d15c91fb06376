"""tracer.sink / capture / sampling / config: Parquet parts, manifest, drops, faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from support.traces import read_rows as read_trace

from moetrace.errors import MoetraceError
from moetrace.fingerprint import fingerprint_rows
from moetrace.schema import TRACE_SCHEMA
from moetrace.tracer import sink as sink_mod
from moetrace.tracer.capture import Tracer
from moetrace.tracer.config import TraceConfig
from moetrace.tracer.manifest import read_manifests
from moetrace.tracer.sampling import Sampling
from moetrace.tracer.steps import LayerOrderSteps, ServerSteps

E = 8


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (E, 64, 96), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    s = torch.rand(E, 1, 1, generator=g)
    return {"w2_weight": w, "w2_weight_scale_inv": s}


def _tracer(out, run_id="r1", **kw) -> Tracer:
    cfg = TraceConfig.from_dict({"out": str(out), "run_id": run_id, "flush_interval_s": 0.2, **kw})
    return Tracer(cfg, kw.get("tp_rank", 0) or 0, kw.get("tp_size", 1) or 1)


def _manifest(out, run_id="r1", rank=0) -> dict:
    return json.loads((Path(out) / run_id / f"rank={rank}" / "_manifest.json").read_text())


def test_roundtrip_parts_schema_and_manifest(tmp_path):
    tr = _tracer(tmp_path, rows_per_part=20, tp_rank=1, tp_size=2)
    ts = _tensors()
    for step in range(3):
        for layer in (0, 1):
            tr.capture(ts, layer=layer, source="resident", step=step, experts=range(8, 16))
    assert _manifest(tmp_path, rank=1)["finished"] is False  # written at open
    assert tr.close()
    t = read_trace(str(tmp_path), "r1")
    assert t.schema.equals(TRACE_SCHEMA)
    assert t.num_rows == 3 * 2 * 2 * E
    # The run folder is a plain Parquet dataset for pyarrow and pandas as is:
    # temp parts are dot files and the manifests start with "_", which they skip.
    dataset = ds.dataset(tmp_path / "r1", format="parquet", partitioning="hive")
    assert dataset.to_table().num_rows == t.num_rows
    import pandas as pd

    frame = pd.read_parquet(tmp_path / "r1")
    assert len(frame) == t.num_rows and set(frame["tp_rank"].astype(int)) == {1}
    want = {(e + 8): f.digest for e, f in enumerate(fingerprint_rows(ts["w2_weight"]))}
    rows = t.filter(ds.field("tensor") == "w2_weight").to_pylist()
    assert all(r["digest"] == want[r["expert"]] for r in rows)
    r0 = rows[0]
    assert (r0["tp_rank"], r0["tp_size"], r0["dtype"], r0["shape"], r0["nbytes"]) == (1, 2, "float8_e4m3fn", [64, 96], 64 * 96)
    assert r0["copy_position"] == 2 and r0["source"] == "resident" and r0["online"] is None and len(r0["chunk_digests"]) == 16
    m = _manifest(tmp_path, rank=1)
    assert m["finished"] and m["finished_at"] and m["close_reason"] == "close"
    assert m["rows_written"] == t.num_rows == m["rows_captured"] and m["rows_dropped"] == 0
    assert sum(p["rows"] for p in m["parts"]) == t.num_rows and len(m["parts"]) >= 2
    assert m["run_id"] == "r1" and m["tp_rank"] == 1 and m["versions"]["torch"] == torch.__version__
    assert m["config"]["out"] == str(tmp_path) and m["pid"] == os.getpid()
    assert sorted({r["capture_seq"] for r in t.to_pylist()}) == list(range(6))


def test_file_uri_output(tmp_path):
    tr = _tracer(f"file://{tmp_path}/t", run_id="uri")
    tr.capture(_tensors(), layer=3, source="staged", step=0, experts=range(E), positions=list(range(E))[::-1])
    assert tr.close()
    t = read_trace(f"file://{tmp_path}/t", "uri")
    assert t.num_rows == 2 * E
    assert t.column("transport_position").to_pylist()[:E] == list(range(E))[::-1]
    assert read_manifests(f"file://{tmp_path}/t", "uri")["0"]["finished"]


def test_full_queue_drops_are_counted_and_never_block(tmp_path, monkeypatch):
    gate = threading.Event()
    real = sink_mod.finalize

    def slow_finalize(*a, **k):
        gate.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(sink_mod, "finalize", slow_finalize)
    tr = _tracer(tmp_path, queue_size=2)
    ts = {"w2_weight": _tensors()["w2_weight"]}
    t0 = time.monotonic()
    for step in range(20):
        tr.capture(ts, layer=0, source="resident", step=step, experts=range(E))
    assert time.monotonic() - t0 < 5  # never blocks on the stuck writer
    m = tr.sink.manifest()
    assert m["drops"]["queue_full"] == m["rows_dropped"] >= 16 * E
    gate.set()
    assert tr.close()
    m = _manifest(tmp_path)
    assert m["rows_written"] + m["rows_dropped"] == m["rows_captured"] == 20 * E
    assert read_trace(str(tmp_path), "r1").num_rows == m["rows_written"]


def test_byte_bound_of_queue(tmp_path, monkeypatch):
    gate = threading.Event()
    real = sink_mod.finalize
    monkeypatch.setattr(sink_mod, "finalize", lambda *a, **k: (gate.wait(10), real(*a, **k))[1])
    tr = _tracer(tmp_path, queue_max_bytes=1)
    for step in range(4):
        tr.capture({"w2_weight": _tensors()["w2_weight"]}, layer=0, source="resident", step=step, experts=range(E))
    assert tr.sink.manifest()["drops"].get("queue_full", 0) >= 2 * E
    gate.set()
    assert tr.close()


def test_unwritable_output_is_refused_at_open(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(MoetraceError, match="cannot create"):
        _tracer(blocker / "trace")


def test_write_failure_mid_run_is_counted(tmp_path):
    tr = _tracer(tmp_path, rows_per_part=4)
    tr.capture(_tensors(), layer=0, source="resident", step=0, experts=range(E))
    assert tr.flush()
    rank_dir = tmp_path / "r1" / "rank=0"
    os.rename(rank_dir, tmp_path / "moved")
    rank_dir.write_text("not a folder")  # every later write fails
    tr.capture(_tensors(), layer=0, source="resident", step=1, experts=range(E))
    tr.close(timeout=10)  # must return, not raise
    m = tr.sink.manifest()
    assert m["rows_written"] == 2 * E and m["drops"]["write_failed"] == 2 * E
    assert m["sink_errors"] >= 1 and not m["errors"] == []
    assert len(list((tmp_path / "moved").glob("part-*.parquet"))) >= 1


_KILLED_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from moetrace.tracer.config import TraceConfig
    from moetrace.tracer.capture import Tracer
    cfg = TraceConfig.from_dict({"out": sys.argv[1], "run_id": "killed", "rows_per_part": 8, "flush_interval_s": 0.05})
    tr = Tracer(cfg, 0, 1)
    t = {"w2_weight": torch.randint(0, 256, (8, 5000), dtype=torch.uint8)}
    for step in range(5):
        tr.capture(t, layer=0, source="resident", step=step, experts=range(8))
    assert tr.flush()
    print("ready", flush=True)
    step = 5
    while True:
        tr.capture(t, layer=0, source="resident", step=step, experts=range(8))
        step += 1
        time.sleep(0.002)
    """
)


def test_killed_process_leaves_readable_parts(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    rank_dir = tmp_path / "killed" / "rank=0"
    parts = sorted(rank_dir.glob("part-*.parquet"))
    assert len(parts) >= 5
    rows = sum(pq.read_table(p).num_rows for p in parts)  # every visible part is complete
    m = json.loads((rank_dir / "_manifest.json").read_text())
    assert m["finished"] is False and m["finished_at"] is None
    assert rows >= m["rows_written"] >= 40
    assert ds.dataset(rank_dir, format="parquet", exclude_invalid_files=True).to_table().num_rows == rows


def test_sampling_layers_experts_steps(tmp_path):
    tr = _tracer(tmp_path, layers="1,3-4", experts=[2, 5], every_n_steps=2, tensors="w2_weight")
    for step in range(5):
        for layer in range(6):
            tr.capture(_tensors(), layer=layer, source="resident", step=step, experts=range(E))
    assert tr.close()
    t = read_trace(str(tmp_path), "r1").to_pylist()
    assert {r["step"] for r in t} == {0, 2, 4}
    assert {r["layer"] for r in t} == {1, 3, 4}
    assert {(r["expert"], r["slot"]) for r in t} == {(2, 2), (5, 5)}
    assert {r["tensor"] for r in t} == {"w2_weight"}
    want = fingerprint_rows(_tensors()["w2_weight"])
    assert all(r["digest"] == want[r["expert"]].digest for r in t)


def test_first_n_steps_closes_the_trace(tmp_path):
    tr = _tracer(tmp_path, first_n_steps=2)
    for step_layer in [0, 1, 0, 1, 0, 1]:  # passes 0, 1, 2
        step = tr.step_for("resident", step_layer)
        tr.capture(_tensors(), layer=step_layer, source="resident", step=step, experts=range(E))
    assert not tr.enabled
    assert tr.sink._closed.wait(10)
    m = _manifest(tmp_path)
    assert m["finished"] and m["close_reason"] == "sampling-complete" and m["rows_dropped"] == 0
    assert {r["step"] for r in read_trace(str(tmp_path), "r1").to_pylist()} == {0, 1}


def test_step_counter_resident_and_staged():
    c = LayerOrderSteps()
    assert [c("resident", l) for l in (0, 1, 2)] == [0, 0, 0]
    assert [c("resident", l) for l in (0, 1, 2)] == [1, 1, 1]
    # KT: the staged load of layer L runs inside layer L's forward, before its hook.
    seq = [("staged", 0), ("resident", 0), ("staged", 1), ("resident", 1), ("resident", 2), ("staged", 0),
           ("resident", 0), ("resident", 1)]
    assert [c(k, l) for k, l in seq] == [2, 2, 2, 2, 2, 3, 3, 3]
    one = LayerOrderSteps()  # a single MoE layer still counts passes
    assert [one("resident", 5) for _ in range(3)] == [0, 1, 2]


def test_server_steps_follow_the_counter_across_a_reset():
    counter = iter([7, 7, 8, 9, 0, 0, 1])  # elastic EP recovery resets forward_pass_id on every rank at once
    s = ServerSteps(lambda: next(counter), "model-runner-pass-id")
    assert [s("resident", 0) for _ in range(7)] == [7, 7, 8, 9, 10, 10, 11]


def test_parse_and_config_errors(tmp_path):
    with pytest.raises(MoetraceError, match="unknown key"):
        TraceConfig.from_dict({"out": "x", "layer": 3})
    with pytest.raises(MoetraceError, match="'out'"):
        TraceConfig.from_dict({})
    with pytest.raises(MoetraceError, match="needs an index"):
        TraceConfig.from_dict({"out": "x", "dump_max_count": 2})
    with pytest.raises(MoetraceError, match="sources"):
        TraceConfig.from_dict({"out": "x", "sources": "resident,gpu"})
    cfg = TraceConfig.from_dict({"out": "x", "run_id": "a", "layers": "0-2", "max_hook_errors": None})
    assert cfg.max_hook_errors is None and cfg.sampling.layers == {0, 1, 2}
    assert TraceConfig.from_dict(cfg.to_dict()) == cfg
    s = Sampling(every_n_steps=3, first_n_steps=7, sources=frozenset({"staged"}))
    assert [st for st in range(10) if s.want("staged", st, 0)] == [0, 3, 6] and not s.want("resident", 0, 0)


def test_filter_values_are_validated(tmp_path):
    """A typo in a filter must not silently change what is traced (docs/capture.md)."""
    from click.testing import CliRunner

    from moetrace.cli import main
    from moetrace.schema import TENSOR_NAMES

    def refused(cfg):
        with pytest.raises(MoetraceError) as info:
            TraceConfig.from_dict({"out": str(tmp_path), **cfg})
        msg = str(info.value)
        assert "\n" not in msg
        return msg

    msg = refused({"tensors": "w13_weight,w2_wieght"})
    assert msg.startswith("tensors:") and "'w2_wieght'" in msg and "'w2_weight_scale_inv'" in msg
    assert "w13_weight'," not in msg.split("expected")[0]  # only the bad name is named as unknown
    assert "'staged'" in refused({"sources": ["resident", "stagd"]}) and "stagd" in refused({"sources": "stagd"})
    for key in ("layers", "experts"):
        for bad in ("-1", [-2], "-3-4", "0,-1"):
            msg = refused({key: bad})
            assert msg.startswith(f"{key}:") and ">= 0" in msg, msg
    assert "every_n_steps" in refused({"every_n_steps": 0}) and "every_n_steps" in refused({"every_n_steps": "x"})
    assert "first_n_steps" in refused({"first_n_steps": "two"})
    assert "tensors" in refused({"tensors": 5})
    with pytest.raises(MoetraceError, match="tensors"):
        Sampling(tensors=frozenset({"w2_weigth"}))
    # Every real FusedMoE param name (FP8 block, FP8 per-channel, BF16) is accepted.
    names = sorted(TENSOR_NAMES)
    cfg = TraceConfig.from_dict({"out": str(tmp_path), "run_id": "a", "tensors": ",".join(names) + ",",
                                 "sources": " staged ", "experts": 3, "every_n_steps": "2"})
    assert cfg.sampling.tensors == set(names) and cfg.sampling.sources == {"staged"}
    assert cfg.sampling.experts == {3} and cfg.sampling.every_n_steps == 2
    assert TraceConfig.from_dict(cfg.to_dict()) == cfg
    # The walkthrough's command: hook-spec refuses it (exit 2, one line naming the value).
    res = CliRunner().invoke(main, ["hook-spec", "--out", str(tmp_path), "--tensors", "w2_wieght"])
    assert res.exit_code == 2 and "w2_wieght" in res.output and "w2_weight" in res.output
    res = CliRunner().invoke(main, ["hook-spec", "--out", str(tmp_path), "--layers=-1"])
    assert res.exit_code == 2 and "layers" in res.output and ">= 0" in res.output
