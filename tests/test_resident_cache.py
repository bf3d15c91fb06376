"""Resident weights and the unchanged-weights cache (tracer.unchanged, hooks.weight_events).

Off by default: writes through ``param.data`` move no version counter, so every resident
capture reads its bytes again. On (``resident_cache: true``), a capture whose weights are
provably unchanged is skipped: it writes no rows (nothing claims bytes nobody read) and is
counted in ``resident_reused``; staged loads are fingerprinted every time."""

from __future__ import annotations

import sys
import types

import pyarrow.parquet as pq
import pytest
import torch

from moetrace.hooks import weight_events
from moetrace.hooks.fused_moe import FusedMoECapture
from moetrace.tracer.capture import Tracer
from moetrace.tracer.config import TraceConfig


def _params(experts: int = 4, seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (experts, 64, 32), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    s = torch.rand(experts, 2, 2, generator=g)
    return {"w13_weight": torch.nn.Parameter(w, requires_grad=False),
            "w13_weight_scale_inv": torch.nn.Parameter(s, requires_grad=False)}


@pytest.fixture
def tracer(tmp_path):
    tr = Tracer(TraceConfig.from_dict({"out": str(tmp_path), "run_id": "r"}), 0, 1)
    yield tr
    tr.close()


def _capture(tr, ts, step, epoch, source="resident"):
    tr.capture(ts, layer=3, source=source, step=step, experts=range(4), weights_epoch=epoch)
    assert tr.flush(timeout=30)  # the writer has folded: the cache entry exists


def _digests(tmp_path):
    table = pq.read_table(str(tmp_path / "r" / "rank=0")).to_pandas()
    return {(r.step, r.tensor, r.expert): r.digest for r in table.itertuples()}


def test_unchanged_weights_are_hashed_once_and_write_no_rows_again(tracer, tmp_path):
    ts = _params()
    for step in range(3):
        _capture(tracer, ts, step, epoch=1)
    assert (tracer.resident.hashed, tracer.resident.reused, tracer.fingerprinted) == (2, 4, 2)
    tracer.close()
    d = _digests(tmp_path)
    assert sorted({s for s, _, _ in d}) == [0]  # steps 1 and 2 were not read: no row claims their bytes
    assert len(d) == 2 * 4 and tracer.sink.manifest()["resident_reused"] == 4


def test_any_change_rehashes(tracer, tmp_path):
    ts = _params()
    _capture(tracer, ts, 0, epoch=1)
    with torch.no_grad():
        ts["w13_weight_scale_inv"][2, 0, 0] = 7.0  # in place: the version counter moves
    _capture(tracer, ts, 1, epoch=1)
    assert (tracer.resident.hashed, tracer.resident.reused) == (3, 1)  # only the scale re-hashed
    ts["w13_weight"].data[0, 0, 0] = 0  # through .data: no version bump, so an epoch must tell
    _capture(tracer, ts, 2, epoch=2)
    assert (tracer.resident.hashed, tracer.resident.reused) == (5, 1)
    _capture(tracer, {"w13_weight": ts["w13_weight"][:, :32]}, 3, epoch=2)  # another view: another key
    assert tracer.resident.hashed == 6
    tracer.close()
    d = _digests(tmp_path)
    assert d[(1, "w13_weight_scale_inv", 2)] != d[(0, "w13_weight_scale_inv", 2)]
    assert (1, "w13_weight", 1) not in d  # skipped, not re-claimed
    assert d[(2, "w13_weight", 0)] != d[(0, "w13_weight", 0)]


def test_without_an_epoch_and_for_staged_loads_nothing_is_reused(tracer):
    ts = _params()
    for step in range(2):
        _capture(tracer, ts, step, epoch=None)
    for step in range(2, 4):
        _capture(tracer, ts, step, epoch=1, source="staged")
    assert tracer.resident.reused == 0 and tracer.fingerprinted == 8


def test_inference_tensors_have_no_version_and_are_rehashed(tracer):
    with torch.inference_mode():
        ts = {k: v.detach().clone() for k, v in _params().items()}
    for step in range(2):
        _capture(tracer, ts, step, epoch=1)
    assert tracer.resident.reused == 0 and tracer.fingerprinted == 4


def test_weight_events_count_every_call_through_a_writer(monkeypatch):
    monkeypatch.setattr(weight_events, "_installed", False)
    assert weight_events.epoch() is None  # not every writer is known: never reuse

    class Updater:
        def update_weights_from_disk(self, x):
            return x + 1

    assert weight_events.wrap_methods(Updater, ["update_weights_from_disk", "absent"]) == 1
    weight_events.wrap_methods(Updater, ["update_weights_from_disk"])  # idempotent: wrapped once
    monkeypatch.setattr(weight_events, "_installed", True)
    e0 = weight_events.epoch()
    assert Updater().update_weights_from_disk(1) == 2 and weight_events.epoch() > e0
    p = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
    p.weight_loader = lambda param, w: param.data.copy_(w)
    assert weight_events.watch_params({"w2_weight": p})
    e1 = weight_events.epoch()
    p.weight_loader(p, torch.ones(2, 3))
    assert weight_events.epoch() > e1 and p._version == 0  # the write was invisible to the version counter


def _module(kt: bool):
    m = torch.nn.Module()
    for k, v in _params().items():
        setattr(m, k, v)
        v.weight_loader = lambda param, w: param.data.copy_(w)
    m.layer_id = 3
    if kt:  # KT's wrapper keeps its own slot map: its copies are not counted
        m.quant_method = types.SimpleNamespace(num_gpu_experts=4, gpu_index_to_logical=torch.arange(4))
    return m


@pytest.mark.parametrize("kt", [False, True])
def test_the_forward_hook_reuses_only_where_writes_are_counted(tmp_path, monkeypatch, kt):
    monkeypatch.setattr(weight_events, "_installed", True)
    tracer = Tracer(TraceConfig.from_dict({"out": str(tmp_path), "run_id": "r", "resident_cache": True}), 0, 1)
    try:
        m = _module(kt)
        hook = FusedMoECapture(tracer)
        for _ in range(3):
            hook(m, (), None)
            assert tracer.flush(timeout=30)
        assert tracer.resident.reused == (0 if kt else 4)
        m.w13_weight.weight_loader(m.w13_weight, torch.zeros(4, 64, 32, dtype=torch.uint8).view(torch.float8_e4m3fn))
        before = tracer.fingerprinted
        hook(m, (), None)
        assert tracer.fingerprinted == before + 2  # a counted write: both tensors re-hashed
    finally:
        tracer.close()


def test_by_default_every_forward_reads_the_bytes_again(tracer, tmp_path, monkeypatch):
    """The default (resident_cache off): a write through .data after some forwards, which no
    version counter or counted writer sees, shows in the rows of the very next forward."""
    monkeypatch.setattr(weight_events, "_installed", True)
    m = _module(False)
    hook = FusedMoECapture(tracer)
    for step in range(5):
        if step == 3:
            m.w13_weight.data[0], m.w13_weight.data[2] = m.w13_weight.data[2].clone(), m.w13_weight.data[0].clone()
        hook(m, (), None)
        assert tracer.flush(timeout=30)
    assert tracer.resident.reused == 0 and tracer.fingerprinted == 5 * 2
    tracer.close()
    d = _digests(tmp_path)
    assert d[(3, "w13_weight", 0)] == d[(2, "w13_weight", 2)] and d[(4, "w13_weight", 2)] == d[(0, "w13_weight", 0)]
    assert d[(2, "w13_weight", 0)] == d[(0, "w13_weight", 0)]


def test_install_needs_every_known_writer(monkeypatch):
    monkeypatch.setattr(weight_events, "_installed", False)
    updater_mod, eplb_mod = types.ModuleType("wu"), types.ModuleType("elu")

    class WeightUpdater:
        def update_weights_from_tensor(self):
            return "loaded"

        def init_weights_update_group(self):  # not a writer: left alone
            return "group"

    class ExpertLocationUpdater:
        def update(self):
            return "moved"

    updater_mod.WeightUpdater, eplb_mod.ExpertLocationUpdater = WeightUpdater, ExpertLocationUpdater
    monkeypatch.setitem(sys.modules, weight_events._WEIGHT_UPDATER, updater_mod)
    monkeypatch.delitem(sys.modules, weight_events._EPLB_UPDATER, raising=False)
    assert not weight_events.install() and weight_events.epoch() is None  # EPLB's writer unknown
    monkeypatch.setitem(sys.modules, weight_events._EPLB_UPDATER, eplb_mod)
    assert weight_events.install()
    e = weight_events.epoch()
    assert ExpertLocationUpdater().update() == "moved" and weight_events.epoch() > e
    e = weight_events.epoch()
    assert WeightUpdater().init_weights_update_group() == "group" and weight_events.epoch() == e
    assert WeightUpdater().update_weights_from_tensor() == "loaded" and weight_events.epoch() > e
