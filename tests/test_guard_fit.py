"""A guard whose index does not fit the server (another TP size,
checkpoint or w13 order, layers it lacks, a bad file among the update indexes) says
`unverified` once, never `ok`, never kills a clean server with fail-closed; hook-spec
and launch refuse what they can tell does not fit."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from support.cli import cli, one_line_error
from support.guarded import shards

from moetrace.checkpoints.index import INDEX_META_KEY, write_index
from moetrace.checkpoints.index_build import build_index
from moetrace.checkpoints.layout import ServerLayout
from moetrace.tracer import index_fit
from moetrace.tracer.capture import Tracer
from moetrace.tracer.config import TraceConfig

CKPT = dict(num_layers=2, num_experts=8, hidden=128, intermediate=256, seed=3)
E = 8
ALL = E * 4


@pytest.fixture(scope="module")
def fit(make_ckpt, tmp_path_factory):
    a, b = make_ckpt(**CKPT), make_ckpt(**{**CKPT, "seed": 4})
    d = tmp_path_factory.mktemp("fit")
    return SimpleNamespace(
        a=str(a), b=str(b), dir=d,
        tp1=str(write_index(build_index(a, 1), d / "tp1.parquet")),
        tp2=str(write_index(build_index(a, 2), d / "tp2.parquet")),
        up=str(write_index(build_index(a, 1, layout=ServerLayout(up_first=True)), d / "up.parquet")),
        layer0=str(write_index(build_index(a, 1, layers=[0]), d / "layer0.parquet")),
        host1=shards(a), host2=shards(a, rank=0, tp=2))


def _tracer(tmp_path, index, tp_rank=0, tp_size=1, **config) -> Tracer:
    conf = TraceConfig.from_dict({"out": str(tmp_path), "run_id": "g", "index": index, "flush_interval_s": 0.2,
                                  "guard": "fail-closed", **config})
    return Tracer(conf, tp_rank, tp_size)


CANONICAL_FACTS = {"use_flashinfer_trtllm_moe": False, "load_up_proj_weight_first": False,
                   "intermediate_size_per_partition": 256, "params": {}}


def _guard(tr):
    return tr.sink.manifest()["guard"]


def test_tp1_index_on_a_tp2_server_is_unverified_not_fail_closed(fit, tmp_path, caplog):
    with caplog.at_level(logging.ERROR, "moetrace.guard"):
        tr = _tracer(tmp_path, fit.tp1, 0, 2)
        try:
            for step in range(2):  # a clean TP2 rank-0 load: never GuardMismatch
                tr.capture(fit.host2[0], layer=0, source="staged", step=step, experts=range(E))
            g = _guard(tr)
        finally:
            tr.close()
    assert g["status"] == "unverified" and "built for --tp 1, the server runs TP 2" in g["status_reason"]
    assert g["tensors"]["mismatch"] == 0 and g["failed_closed"] is None
    assert len([r for r in caplog.records if "does not fit the server" in r.getMessage()]) == 1
    # the negative control: the same load against the TP2 index is verified, all match
    tr = _tracer(tmp_path / "ok", fit.tp2, 0, 2)
    try:
        tr.capture(fit.host2[0], layer=0, source="staged", step=0, experts=range(E))
        assert _guard(tr)["status"] == "ok" and _guard(tr)["tensors"]["match"] == ALL
    finally:
        tr.close()


def test_up_first_index_on_a_gate_first_layer_is_unverified(fit, tmp_path, caplog):
    tr = _tracer(tmp_path, fit.up)
    try:
        tr.record_layout("staged", 0, CANONICAL_FACTS)
        with caplog.at_level(logging.ERROR, "moetrace.guard"):
            tr.capture(fit.host1[0], layer=0, source="staged", step=0, experts=range(E))
        g = _guard(tr)
    finally:
        tr.close()
    assert g["status"] == "unverified" and "up rows first" in g["status_reason"] and g["failed_closed"] is None
    assert g["tensors"]["mismatch"] == 0
    # the facts say canonical and the index is canonical: verified
    tr = _tracer(tmp_path / "ok", fit.tp1)
    try:
        tr.record_layout("staged", 0, CANONICAL_FACTS)
        tr.capture(fit.host1[0], layer=0, source="staged", step=0, experts=range(E))
        assert _guard(tr)["status"] == "ok"
    finally:
        tr.close()


def test_index_of_another_checkpoint(fit, tmp_path):
    meta = json.loads(__import__("pyarrow.parquet", fromlist=["x"]).read_schema(fit.tp1).metadata[INDEX_META_KEY])
    assert index_fit.checkpoint_misfit(meta, fit.a) is None
    why = index_fit.checkpoint_misfit(meta, fit.b)
    assert why is not None and fit.b in why
    runner = SimpleNamespace(server_args=SimpleNamespace(model_path=fit.b))
    assert index_fit.model_path_of(runner) == fit.b
    tr = _tracer(tmp_path, fit.tp1)
    try:
        tr.guard.misfit(why)
        tr.capture(fit.host1[0], layer=0, source="staged", step=0, experts=range(E))
        g = _guard(tr)
    finally:
        tr.close()
    assert g["status"] == "unverified" and g["tensors"]["unverified"] == ALL and g["failed_closed"] is None


def test_layers_the_index_lacks_are_never_ok(fit, tmp_path):
    """Item 13: an index built --layers 0 on a 2-layer server: half of each pass is
    never verified; status and coverage say so."""
    tr = _tracer(tmp_path, fit.layer0, guard="record")
    try:
        for layer in (0, 1):
            tr.capture(fit.host1[layer], layer=layer, source="staged", step=0, experts=range(E))
        g = _guard(tr)
    finally:
        tr.close()
    assert g["tensors"] == {"match": ALL, "mismatch": 0, "unverified": ALL, "reused": 0}
    assert g["status"] == "unverified" and "layer 1 w13_weight" in g["status_reason"]
    assert g["coverage"] == {"staged": 0.5}


def test_update_index_dir_with_a_bad_file(fit, tmp_path, caplog):
    """Item 12: a file whose metadata is a JSON list is skipped by name; with no valid
    index of the new weights the guard is unverified, never left `waiting`/`ok`."""
    import pyarrow.parquet as pq

    updates = tmp_path / "updates"
    updates.mkdir()
    t = pq.read_table(fit.tp1)
    write_index(t.replace_schema_metadata({INDEX_META_KEY: json.dumps([1]).encode()}), updates / "bad.parquet")
    tr = _tracer(tmp_path, fit.tp1, guard="record", update_index_dir=str(updates))
    try:
        with caplog.at_level(logging.WARNING, "moetrace.guard"):
            tr.guard.weights_updated("update_weights_from_disk", fit.b, True)
        g = _guard(tr)
    finally:
        tr.close()
    assert g["status"] == "unverified" and "no index of" in g["status_reason"]
    assert any("skipped" in r.getMessage() and "bad.parquet" in r.getMessage() for r in caplog.records)


def test_hook_spec_and_launch_refuse_what_does_not_fit(fit, tmp_path):
    one_line_error(cli("hook-spec", "--out", tmp_path, "--index", fit.tp1, "--checkpoint-id", "0123456789abcdef"),
                   "--index", "0123456789abcdef")
    one_line_error(cli("launch", "--out", tmp_path, "--index", fit.tp1, "--guard", "record", "--",
                       "python", "-m", "sglang.launch_server", "--model-path", fit.a, "--tp", "2"),
                   "--index", "--tp 1", "TP 2")
    one_line_error(cli("launch", "--out", tmp_path, "--index", fit.tp1, "--guard", "record", "--",
                       "python", "-m", "sglang.launch_server", "--model-path", fit.b, "--tp", "1"),
                   "--index", fit.b)
    r = cli("hook-spec", "--out", tmp_path, "--index", fit.tp1, "--guard", "record")  # the control: it fits
    assert r.exit_code == 0, r.output


def test_metrics_port_past_65535_for_some_rank(fit, tmp_path):
    """Item 14: rank r serves on port + r; launch (which knows the TP size) and a config
    with tp_size refuse a port that leaves a rank past 65535; a rank that finds itself
    there anyway keeps tracing and says why it exports nothing."""
    line = one_line_error(cli("launch", "--out", tmp_path, "--index", fit.tp2, "--guard", "record", "--metrics-port",
                              "65535", "--", "python", "-m", "sglang.launch_server", "--model-path", fit.a, "--tp", "2"),
                          "--metrics-port 65535", "65536", "65534")
    assert "bug" not in line
    with pytest.raises(Exception, match="past port 65535"):
        TraceConfig.from_dict({"out": str(tmp_path), "index": fit.tp2, "guard": "record", "metrics_port": 65535,
                               "tp_size": 2})
    tr = _tracer(tmp_path, fit.tp2, 1, 2, guard="record", metrics_port=65535)
    try:
        m = _guard(tr)["metrics"]
    finally:
        tr.close()
    assert m["exporter"] == "none" and "past port 65535" in m["reason"]


def test_a_corrupt_index_never_fails_closed(fit, tmp_path, caplog):
    """Item 9: one flipped bit in a digest (its chunk digests intact): the guard refuses
    the index by name and verifies nothing; a clean load is never killed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(fit.tp1)
    d = t.column("digest").to_pylist()
    d[3] = bytes([d[3][0] ^ 1]) + d[3][1:]
    bad = tmp_path / "bad.parquet"
    write_index(t.set_column(t.column_names.index("digest"), "digest", pa.array(d, pa.binary(16)))
                .replace_schema_metadata(t.schema.metadata), bad)
    with caplog.at_level(logging.ERROR, "moetrace.guard"):
        tr = _tracer(tmp_path, str(bad))
    try:
        tr.capture(fit.host1[0], layer=0, source="staged", step=0, experts=range(E))
        g = _guard(tr)
    finally:
        tr.close()
    assert g["status"] == "unverified" and "corrupt" in g["status_reason"] and str(bad) in g["status_reason"]
    assert g["failed_closed"] is None and g["tensors"]["mismatch"] == 0


def test_an_index_copied_from_the_cache_names_the_folder_asked_for(fit, tmp_path, monkeypatch):
    """Two copies of one checkpoint (cp -p: the same cache key): the second `moetrace index`
    is a cache hit, and its index records the second folder; the guard's re-verification
    after update_weights_from_disk of that folder finds it."""
    import shutil

    from moetrace.checkpoints.index import index_metadata

    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    first, second = (shutil.copytree(fit.a, tmp_path / name, copy_function=shutil.copy2) for name in ("a", "b"))
    updates = tmp_path / "updates"
    updates.mkdir()
    assert cli("index", first, "--tp", "1", "-o", tmp_path / "first.parquet").exit_code == 0
    r = cli("index", second, "--tp", "1", "-o", updates / "second.parquet", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["reused_cache"], r.output
    assert index_metadata(str(updates / "second.parquet"))["checkpoint_path"] == str(second.resolve())
    assert index_metadata(str(tmp_path / "first.parquet"))["checkpoint_path"] == str(first.resolve())
    tr = _tracer(tmp_path, str(tmp_path / "first.parquet"), guard="record", update_index_dir=str(updates))
    try:
        tr.guard.weights_updated("update_weights_from_disk", str(second), True)
        tr.capture(fit.host1[0], layer=0, source="staged", step=0, experts=range(E))
        g = _guard(tr)
    finally:
        tr.close()
    assert g["weight_updates"][0]["index"] == str(updates / "second.parquet")
    assert g["status"] == "ok" and g["tensors"]["match"] == ALL
