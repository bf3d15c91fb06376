"""The in-server guard: on-device verification of staged loads and resident weights,
its metrics, its actions and its view of weight updates.

Expectations come from outside the guard: the checkpoint's shards (the race of the
staged load puts expert e+2's bytes in e's w2 scale), the index built by the real
build_index, the analysis of the same trace, and the emulator's own schedule.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from support.guarded import Experts, StagedContext, scrape, shards, total
from support.traces import read_rows

from moetrace import fingerprint as fp
from moetrace.checkpoints.index import write_index
from moetrace.checkpoints.index_build import build_index
from moetrace.errors import MoetraceError
from moetrace.hooks import sglang_hook, weight_events
from moetrace.hooks.kt import KTLoadCapture
from moetrace.tracer.capture import Tracer
from moetrace.tracer.completeness import rank_problems
from moetrace.tracer.config import TraceConfig
from moetrace.tracer.guard import GuardMismatch
from moetrace.tracer.manifest import read_manifests

CKPT = dict(num_layers=2, num_experts=8, hidden=128, intermediate=256, seed=3)
E = 8
ALL = E * 4  # tensors of one layer-load


@pytest.fixture(scope="module")
def model(make_ckpt, tmp_path_factory):
    """Checkpoints A and B (another seed), A's TP1 index, B's in an update folder."""
    a, b = make_ckpt(**CKPT), make_ckpt(**{**CKPT, "seed": 4})
    d = tmp_path_factory.mktemp("guard")
    updates = d / "updates"
    updates.mkdir()
    idx_a = write_index(build_index(a, 1), d / "a.parquet")
    idx_b = write_index(build_index(b, 1), updates / "b.parquet")
    digests = {(r["layer"], r["expert"], r["tensor"]): r["digest"] for r in pq.read_table(idx_a).to_pylist()}
    return SimpleNamespace(a=str(a), b=str(b), idx_a=str(idx_a), idx_b=str(idx_b), updates=str(updates),
                           host_a=shards(a), host_b=shards(b), digests=digests)


def _tracer(tmp_path, index, **config) -> Tracer:
    conf = TraceConfig.from_dict({"out": str(tmp_path), "run_id": "g", "index": index, "flush_interval_s": 0.2,
                                  **config})
    return Tracer(conf, 0, 1)


def _context_class():
    """A fresh SharedFullContext class per test (the KT wrapper patches its load)."""
    return type("SharedFullContext", (StagedContext,), {"load": StagedContext.load})


def test_device_compare_of_chunk_digests():
    """ExpectedDigests.compare flags a row by its chunk digests against the index's (expected
    from fingerprint_rows of the checkpoint's bytes): an equal row matches, one flipped byte
    in a short last chunk mismatches, a row of another length mismatches, an expert the
    index lacks is unverified, and a reordered expert list is looked up by expert id."""
    from moetrace.tracer.expected import MATCH, MISMATCH, UNVERIFIED, ExpectedDigests, Table

    g = torch.Generator().manual_seed(3)
    nbytes = 2 * fp.CHUNK_BYTES + 5
    want = torch.randint(0, 256, (3, nbytes), dtype=torch.uint8, generator=g)
    fps = fp.fingerprint_rows(want, "xxhash")
    chunks = torch.from_numpy(np.frombuffer(b"".join(f.chunk_digests for f in fps), np.uint8).reshape(3, -1, 16).copy())
    exp = ExpectedDigests("idx", 0, 0, torch.device("cpu"), None, None,
                      {("target", 0, "w2_weight"): Table(chunks, nbytes, {10: 0, 11: 1, 12: 2}, {})})
    got = want.clone()
    got[1, -1] ^= 1
    flags = exp.compare(("target", 0), "w2_weight", (10, 11, 12), fp.row_chunk_digests(got), nbytes)
    assert flags.tolist() == [MATCH, MISMATCH, MATCH]
    flags = exp.compare(("target", 0), "w2_weight", (12, 99, 10), fp.row_chunk_digests(want[[2, 0, 0]]), nbytes)
    assert flags.tolist() == [MATCH, UNVERIFIED, MATCH]
    short = fp.row_chunk_digests(want[:, :-1])
    assert exp.compare(("target", 0), "w2_weight", (10, 11, 12), short, nbytes - 1).tolist() == [MISMATCH] * 3
    assert exp.compare(("target", 1), "w2_weight", (10,), short[:1], nbytes - 1) is None


def test_staged_race_counted_scraped_and_traced(model, tmp_path, caplog):
    """Two raced staged loads: the mismatch counter rises by exactly the stale tensors
    (E-2 per load), /metrics over HTTP parses with prometheus_client's parser, alert
    logs one ERROR line per load, and only the stale rows reach the trace, holding E+2."""
    tr = _tracer(tmp_path, model.idx_a, guard="alert", metrics_port=0)
    cls = _context_class()
    ctx = cls(model.host_a, race=True)
    cap = KTLoadCapture(tr, cls).attach()
    try:
        with caplog.at_level(logging.ERROR, "moetrace.guard"):
            ctx.forward_layer(0)
            ctx.forward_layer(1)
    finally:
        cap.detach()
    g = tr.sink.manifest()["guard"]
    s = scrape(g["metrics"]["port"])
    mismatched = "moetrace_guard_tensors_mismatched_total"
    assert total(s, mismatched, layer=0, tensor="w2_weight_scale_inv", source="staged", tp_rank=0) == E - 2
    assert total(s, mismatched) == 2 * (E - 2)
    assert total(s, "moetrace_guard_tensors_verified_total", verdict="match") == 2 * ALL - 2 * (E - 2)
    assert total(s, "moetrace_guard_tensors_verified_total", verdict="mismatch") == 2 * (E - 2)
    assert total(s, "moetrace_guard_loads_verified_total", source="staged", result="mismatch") == 2
    assert total(s, "moetrace_guard_status", status="mismatch") == 1 and total(s, "moetrace_guard_status", status="ok") == 0
    assert total(s, "moetrace_guard_pass_coverage", source="staged") == 1.0
    assert total(s, "moetrace_guard_load_seconds_count", source="staged") == 2
    assert total(s, "moetrace_guard_last_verified_timestamp_seconds") > 0
    assert ("moetrace_hook_errors_total", (("tp_rank", "0"),)) in s and total(s, "moetrace_hook_errors_total") == 0
    assert len([r for r in caplog.records if r.getMessage().endswith("(ALERT)")]) == 2
    assert g["loads"] == {"ok": 0, "mismatch": 2, "unverified": 0} and g["coverage"] == {"staged": 1.0}
    assert tr.close()
    rows = read_rows(str(tmp_path), "g").to_pylist()
    assert sorted((r["layer"], r["expert"], r["tensor"]) for r in rows) == [
        (L, e, "w2_weight_scale_inv") for L in (0, 1) for e in range(E - 2)]
    for r in rows:  # the stale bytes are expert e+2's, as the index says
        assert r["online"] == "mismatch" and r["chunk_digests"]
        assert r["digest"] == model.digests[(r["layer"], r["expert"] + 2, r["tensor"])]


def test_fail_closed_raises_before_the_layer_is_used(model, tmp_path):
    """fail-closed: the wrapped load raises GuardMismatch, so the staged experts are never
    computed with; the mismatch rows and the dump are on disk before the exception arrives."""
    tr = _tracer(tmp_path, model.idx_a, guard="fail-closed", dump_max_count=1)
    cls = _context_class()
    raced, clean = cls(model.host_a, race=True), cls(model.host_a, race=False)
    cap = KTLoadCapture(tr, cls).attach()
    try:
        with pytest.raises(GuardMismatch, match=r"layer 0 staged load: 6 tensors do not match the index .*"
                                                 r"w2_weight_scale_inv of experts 0-5"):
            raced.forward_layer(0)
        assert raced.used == []
        on_disk = read_rows(str(tmp_path), "g").to_pylist()  # before any close
        assert [(r["expert"], r["online"]) for r in on_disk] == [(e, "mismatch") for e in range(E - 2)]
        m = read_manifests(str(tmp_path), "g")["0"]
        assert m["guard"]["failed_closed"]["layer"] == 0 and m["dumps"]["count"] == 1
        clean.forward_layer(1)  # a matching load passes
        assert clean.used == [1]
    finally:
        cap.detach()
        tr.close()


def test_unreadable_index_is_unverified_never_ok(model, tmp_path, caplog):
    bad = tmp_path / "index.parquet"
    bad.write_bytes(b"not a parquet file")
    with caplog.at_level(logging.ERROR, "moetrace.guard"):
        tr = _tracer(tmp_path, str(bad), guard="record", metrics_port=0)
    assert any("index unreadable" in r.getMessage() and str(bad) in r.getMessage() for r in caplog.records)
    assert tr.capture(model.host_a[0], layer=0, source="staged", step=0, experts=range(E)) == 0
    g = tr.sink.manifest()["guard"]
    assert g["status"] == "unverified" and g["tensors"]["match"] == 0 and g["tensors"]["unverified"] == ALL
    s = scrape(g["metrics"]["port"])
    assert total(s, "moetrace_guard_status", status="unverified") == 1
    assert total(s, "moetrace_guard_status", status="ok") == 0
    assert total(s, "moetrace_guard_tensors_unverified_total") == ALL
    assert total(s, "moetrace_guard_tensors_verified_total") == 0
    tr.close()
    problems = rank_problems(read_manifests(str(tmp_path), "g")["0"])
    assert any(p.startswith("guard could not verify (index unreadable") for p in problems), problems


def _fake_updater(monkeypatch, modules):
    """A WeightUpdater with 0.5.23's entry-point names and arguments (checked against the
    installed file below), writing through .data as SGLang's loaders do."""
    mod = types.ModuleType(weight_events._WEIGHT_UPDATER)

    class WeightUpdater:
        writes = None  # {layer: params} the next update writes (None: writes nothing)

        def update_weights_from_disk(self, model_path, load_format, weight_name_filter=None,
                                     recapture_cuda_graph=False):
            for L, params in (self.writes or {}).items():
                modules[L].write(params)
            return True, "Succeeded to update model weights."

        def update_weights_from_tensor(self, named_tensors, load_format=None):
            for L, params in (self.writes or {}).items():
                modules[L].write(params)
            return True, "Success"

    mod.WeightUpdater = WeightUpdater
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return WeightUpdater()


def test_weight_updates_reverify_or_report_unverified(model, tmp_path, monkeypatch):
    """After update_weights_from_disk the resident experts are verified against the new
    checkpoint's index (a broken update that wrote nothing is a mismatch); after an update
    from tensors (no index) they are unverified, never matching."""
    modules = {L: Experts(L, p) for L, p in model.host_a.items()}
    updater = _fake_updater(monkeypatch, modules)
    config = {"out": str(tmp_path), "run_id": "upd", "index": model.idx_a, "guard": "record",
              "update_index_dir": model.updates, "tp_rank": 0, "tp_size": 1, "metrics_port": 0}
    hook = sglang_hook.make_hook(config)
    for m in modules.values():
        m.register_forward_hook(hook)

    def forward_pass():
        for m in modules.values():
            m(torch.zeros(1))

    def guard():
        return sglang_hook.get_tracer(TraceConfig.from_dict(config)).sink.manifest()["guard"]

    try:
        forward_pass()
        assert guard()["tensors"] == {"match": 2 * ALL, "mismatch": 0, "unverified": 0, "reused": 0}
        assert updater.update_weights_from_disk(model.b, "auto")[0]  # claims B, writes nothing
        forward_pass()
        g = guard()
        assert g["tensors"]["mismatch"] == 2 * ALL and g["index"] == model.idx_b
        assert g["weight_updates"][0] | {"at": None} == {"at": None, "entry": "update_weights_from_disk",
                                                         "model_path": model.b, "ok": True, "index": model.idx_b}
        updater.writes = model.host_b
        updater.update_weights_from_disk(model_path=model.b, load_format="auto")
        forward_pass()
        assert guard()["tensors"]["match"] == 4 * ALL
        updater.writes = model.host_a
        updater.update_weights_from_tensor([])
        forward_pass()
        g = guard()
        assert g["tensors"] == {"match": 4 * ALL, "mismatch": 2 * ALL, "unverified": 2 * ALL, "reused": 0}
        assert g["status"] == "unverified" and "update_weights_from_tensor" in g["status_reason"]
        s = scrape(g["metrics"]["port"])
        updates = "moetrace_guard_weight_updates_total"
        assert total(s, updates, entry="update_weights_from_disk", result="reverified") == 2
        assert total(s, updates, entry="update_weights_from_tensor", result="unverified") == 1
        assert total(s, "moetrace_guard_status", status="unverified") == 1
        updater.update_weights_from_disk(model.a, "auto")  # the serving checkpoint again: its own index
        forward_pass()
        g = guard()
        assert g["index"] == model.idx_a and g["status_reason"] is None and g["tensors"]["match"] == 6 * ALL
    finally:
        assert sglang_hook.close_all(timeout=10)


def test_update_entry_points_are_sglangs():
    """The names and arguments the fake above mirrors, in the installed SGLang 0.5.23:
    every weight-writing WeightUpdater method is one the guard listens to."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang wheel not installed (make venv installs it with --no-deps)")
    path = Path(spec.origin).parent / "srt" / "model_executor" / "model_runner_components" / "weight_updater.py"
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "WeightUpdater")
    methods = {f.name: [a.arg for a in f.args.args] for f in cls.body if isinstance(f, ast.FunctionDef)}
    writers = {"update_weights_from_disk", "update_weights_from_tensor", "receive_weights_from_distributed",
               "update_weights_from_ipc"}
    assert writers <= set(methods) and all(n.startswith(weight_events._UPDATE_PREFIXES) for n in writers)
    assert methods["update_weights_from_disk"][:3] == ["self", "model_path", "load_format"]
    assert not [n for n in methods if n.startswith(("update_", "receive_", "load_"))
                and not n.startswith(weight_events._UPDATE_PREFIXES)]
    from moetrace.conform.fork import find_fork
    from moetrace.errors import MoetraceError as NoFork

    try:  # the KT fork keeps them on ModelRunner
        fork = find_fork(None).path.parents[3] / "srt" / "model_executor" / "model_runner.py"
    except NoFork:
        return
    cls = next(n for n in ast.parse(fork.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
    methods = {f.name: [a.arg for a in f.args.args] for f in cls.body if isinstance(f, ast.FunctionDef)}
    assert {"update_weights_from_disk", "update_weights_from_distributed", "update_weights_from_tensor",
            "update_weights_from_ipc"} <= set(methods)
    assert methods["update_weights_from_disk"][:3] == ["self", "model_path", "load_format"]


def test_guard_config_refusals(tmp_path):
    base = {"out": str(tmp_path)}
    for bad, words in (({"guard": "block"}, "guard: 'block'"), ({"guard": "record"}, "guard needs an index"),
                       ({"guard_rows": "some", "index": "i"}, "guard_rows: 'some'"),
                       ({"metrics_port": 70000, "guard": "record", "index": "i"}, "metrics_port: 70000"),
                       ({"metrics_port": 9400, "index": "i"}, "metrics are the guard's"),
                       ({"update_index_dir": "d", "index": "i"}, "update_index_dir")):
        with pytest.raises(MoetraceError, match=words):
            TraceConfig.from_dict({**base, **bad})


def test_completeness_of_a_guarded_run():
    """A guard trace holds rows for mismatches only: 0 rows is whole when the guard
    verified something, not when it verified nothing or could not verify."""
    base = {"finished": True, "rows_written": 0, "rows_dropped": 0, "hook_errors": 0, "sink_errors": 0}
    ok = {"rows": "mismatch", "status": "ok", "tensors": {"match": 10, "mismatch": 0}}
    assert rank_problems({**base, "guard": ok}) == []
    assert rank_problems({**base, "guard": {**ok, "tensors": {"match": 0, "mismatch": 0}, "status": "waiting"}}) == [
        "guard verified nothing (no staged load or resident weights reached it)",
        "wrote 0 rows (nothing captured: check the sampling filters and that traffic reached the server)"]
    assert rank_problems({**base, "guard": {**ok, "status": "unverified", "status_reason": "why"}})[0] == \
        "guard could not verify (why)"
    from moetrace.servers.launcher import summary_line

    bad = {**ok, "status": "mismatch", "tensors": {"match": 58, "mismatch": 6}, "loads": {"mismatch": 1}}
    line = summary_line("X", {0: {**base, "guard": ok}, 1: {**base, "rows_written": 6, "guard": bad}}, 2, [])
    assert line.endswith("; guard: 74 tensors verified, 6 mismatched in 1 loads"), line


def test_guard_on_the_emulated_transport(demo_run):
    """The demo's unfenced/fenced pair ran with the guard (record, all rows): rank 1's
    mismatch counter is exactly the stale tensors the analysis finds ((E-2) per staged
    load of rank 1), rank 0's is 0; fenced, every counter is 0 with full coverage."""
    assert demo_run.returncode == 0, demo_run.stderr
    runs, work = demo_run.summary["runs"], demo_run.workdir
    report = json.loads(Path(runs["unfenced"]["reports"]["json"]).read_text())
    stale = report["totals"]["by_verdict"]["stale"]
    rows = read_rows(str(work / "traces"), "unfenced").to_pylist()
    experts = 1 + max(r["expert"] for r in rows)
    staged_loads = {r["capture_seq"] for r in rows if r["tp_rank"] == 1 and r["source"] == "staged"}
    g0, g1 = runs["unfenced"]["guard"]["0"], runs["unfenced"]["guard"]["1"]
    assert g1["tensors"]["mismatch"] == stale == (experts - 2) * len(staged_loads) > 0
    assert g1["loads"]["mismatch"] == len(staged_loads) and g1["status"] == "mismatch"
    assert g0["tensors"]["mismatch"] == 0 and g0["status"] == "ok"
    flagged = {(r["step"], r["layer"], r["expert"], r["tensor"]) for r in rows if r["online"] == "mismatch"}
    assert len(flagged) == stale and all(k[3] == "w2_weight_scale_inv" and k[2] < experts - 2 for k in flagged)
    fenced_rows = read_rows(str(work / "traces"), "fenced").to_pylist()
    for rank, g in runs["fenced"]["guard"].items():
        assert g["status"] == "ok" and g["coverage"] == {"resident": 1.0, "staged": 1.0}
        assert g["tensors"]["mismatch"] == g["tensors"]["unverified"] == g["loads"]["mismatch"] == 0
        assert g["tensors"]["match"] == sum(1 for r in fenced_rows if r["tp_rank"] == int(rank)) > 0


def test_fail_closed_fails_the_emulated_pass(make_ckpt, tmp_path):
    """The emulated TP2 transport, unfenced, guard fail-closed: rank 1's first staged load
    raises GuardMismatch before its experts are used (no snapshot of that load: the
    emulator snapshots a staged layer right before computing with it); no rank returns a
    token; the stale rows were on disk first."""
    import os

    from moetrace.emulator.config import as_config
    from moetrace.emulator.engine import normalize_request
    from moetrace.emulator.launcher import EmulatorError, RankGroup
    from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec

    ckpt = make_ckpt()
    index = write_index(build_index(ckpt, 2), tmp_path / "index.parquet")
    spec = hook_spec({"out": str(tmp_path / "t"), "run_id": "fc", "index": str(index), "guard": "fail-closed",
                      "sources": "staged"}, DEFAULT_TARGETS)
    cfg = as_config(ckpt, tp=2, fence="none", slow_rank=1, forward_hooks=spec, snapshot_dir=str(tmp_path / "snap"))
    group = RankGroup(cfg, "batch", requests=[normalize_request({"prompt": "x" * 24, "max_tokens": 1})])
    try:
        group.start()
        with pytest.raises(EmulatorError, match=r"rank 1: GuardMismatch: moetrace guard: rank 1 step 0 layer 0 "
                                                r"staged load: 6 tensors do not match"):
            group.wait_for(lambda: len(group.of_kind("result")) == group.world, 600, "run")
    finally:
        group.kill()  # rank 0 waits in the all-reduce for rank 1, which is gone
        group.close()
    assert group.of_kind("result") == {}
    assert not os.path.exists(tmp_path / "snap" / "rank1")
    rows = read_rows(str(tmp_path / "t"), "fc", rank=1).to_pylist()
    assert sorted((r["expert"], r["tensor"], r["online"]) for r in rows) == [
        (e, "w2_weight_scale_inv", "mismatch") for e in range(E - 2)]


def test_unchanged_resident_weights_keep_their_verdict_without_device_work(model, tmp_path):
    """With the unchanged-weights cache on, resident weights provably unchanged (same weights
    key) are not verified again and count against the pass's coverage (nothing read them); an
    in-place write is verified; a remembered mismatch still fails every pass under fail-closed."""
    tr = _tracer(tmp_path, model.idx_a, guard="fail-closed")
    params = {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in model.host_a[0].items()}

    def forward(step, epoch=1):
        tr.capture(params, layer=0, source="resident", step=step, experts=range(E), weights_epoch=epoch)

    try:
        for step in range(3):
            forward(step)
        g = tr.sink.manifest()["guard"]
        assert g["tensors"] == {"match": ALL, "mismatch": 0, "unverified": 0, "reused": 2 * ALL}
        assert tr.fingerprinted == 4 and g["loads"]["ok"] == 1 and g["coverage"] == {"resident": 0.0}
        with torch.no_grad():  # expert 3's down-proj scale becomes expert 5's (the version counter moves)
            params["w2_weight_scale_inv"][3] = params["w2_weight_scale_inv"][5]
        for step in (3, 4):
            with pytest.raises(GuardMismatch, match="resident weights: 1 tensor does not match .* expert 3"):
                forward(step)
        g = tr.sink.manifest()["guard"]
        # step 3 re-verifies the written tensor's E rows (one mismatch), reuses the other three
        # tensors; step 4 reuses all four, the mismatch included, and still fails
        assert g["tensors"] == {"match": ALL + E - 1, "mismatch": 1, "unverified": 0, "reused": 3 * ALL + 3 * E}
        assert tr.fingerprinted == 5  # only the written tensor was verified again
    finally:
        tr.close()


def test_hook_spec_guard_options(model, tmp_path):
    from click.testing import CliRunner

    from moetrace.cli import main

    r = CliRunner().invoke(main, ["hook-spec", "--out", str(tmp_path), "--index", model.idx_a, "--guard", "fail-closed",
                                  "--guard-rows", "all", "--metrics-port", "9400", "--update-index-dir", model.updates])
    assert r.exit_code == 0, r.output
    config = json.loads(r.output)[0]["config"]
    assert (config["guard"], config["guard_rows"], config["metrics_port"], config["update_index_dir"]) == (
        "fail-closed", "all", 9400, model.updates)
    r = CliRunner().invoke(main, ["hook-spec", "--out", str(tmp_path), "--guard", "alert"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "moetrace: error: guard needs an index (the expected digests it verifies against): give --index"]
    r = CliRunner().invoke(main, ["hook-spec", "--out", str(tmp_path), "--index", model.idx_a, "--guard", "alert",
                                  "--update-index-dir", str(tmp_path / "none")])
    assert r.exit_code == 2 and "--update-index-dir" in r.output and "no such folder" in r.output


def test_metrics_port_in_use_is_said_and_the_guard_goes_on(model, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        tr = _tracer(tmp_path, model.idx_a, guard="record", metrics_port=taken.getsockname()[1])
        try:
            tr.capture(model.host_a[0], layer=0, source="staged", step=0, experts=range(E))
            g = tr.sink.manifest()["guard"]
        finally:
            tr.close()
    assert g["metrics"]["exporter"] == "none" and "cannot serve metrics on 127.0.0.1:" in g["metrics"]["reason"]
    assert g["status"] == "ok" and g["tensors"]["match"] == ALL
