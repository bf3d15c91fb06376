"""analysis: every verdict, first divergence, summaries and totals, on a synthetic
checkpoint's real TP shards with known corruptions."""

from __future__ import annotations

import numpy as np
import pytest
from support.traces import CheckpointModel, capture_load, open_rank, write_run_json, write_scenario

from moetrace.analysis.report import analyze

STEPS = [0, 1, 2]


@pytest.fixture(scope="module")
def model(make_ckpt):
    # hidden 256, I 512, TP2: w13_weight is 128 KiB (2 chunks) so a torn copy is visible
    return CheckpointModel(make_ckpt(num_layers=2, num_experts=8, hidden=256, intermediate=512), tp_size=2)


@pytest.fixture(scope="module")
def index(model, tmp_path_factory):
    return model.write_index(str(tmp_path_factory.mktemp("index") / "index.parquet"))


def unfenced(s, r, l):
    c = {}
    if (s, r, l) == (1, 1, 0):  # the seed bug: most w2 scales of one rank's load are E+2
        c.update({(e, "w2_weight_scale_inv"): ("expert", e + 2) for e in range(6)})
    if s == 2 and l == 1:  # expert 3's w13 swapped across ranks
        c[(3, "w13_weight")] = ("rank", 1 - r)
    if (s, r, l) == (2, 0, 0):
        c[(4, "w2_weight")] = ("zeros",)
    if (s, r, l) == (2, 1, 1):
        c[(5, "w13_weight")] = ("torn", 7)  # chunk 0 its own, chunk 1 from E+2
        c[(6, "w2_weight")] = None  # not captured
    return c


@pytest.fixture(scope="module")
def traces(model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("traces"))
    write_scenario(model, out, "unfenced", STEPS, unfenced)
    write_scenario(model, out, "fenced", STEPS, None)
    return out


def by(doc, **kw):
    return [r for r in doc["divergent_rows"] if all(r[k] == v for k, v in kw.items())]


def test_fenced_run_matches_everything(traces, index):
    rep = analyze([f"{traces}/fenced"], index=index)
    t = rep.doc["totals"]
    assert rep.doc["status"] == "match" and rep.exit_code == 0, rep.doc["incomplete"]
    assert t["sentence"] == "384/384 tensors match across 3 steps, 2 ranks"
    assert t["match"] == t["tensors"] == 384 and t["divergent"] == 0 and t["missing"] == 0
    assert rep.doc["first_divergence"] == [] and rep.doc["summaries"] == []


def test_unfenced_verdicts(traces, index):
    rep = analyze([f"{traces}/unfenced"], index=index)
    doc = rep.doc
    bv = doc["totals"]["by_verdict"]
    assert bv["stale"] == 6 and bv["wrong_rank"] == 2 and bv["zeros"] == 1 and bv["torn"] == 1
    assert bv["missing"] == 1 and bv["unknown"] == 0
    assert doc["totals"]["sentence"] == (
        "373/384 tensors match across 3 steps, 2 ranks; 6 stale, 2 wrong rank, 1 zeros, 1 torn, 1 missing"
    )
    stale = by(doc, verdict="stale")
    assert {(r["expert"], r["k"], r["found"]["expert"]) for r in stale} == {(e, 2, e + 2) for e in range(6)}
    assert all(r["tp_rank"] == 1 and r["step"] == 1 and r["tensor"] == "w2_weight_scale_inv" for r in stale)
    swapped = by(doc, verdict="wrong_rank")
    assert {(r["tp_rank"], r["found"]["moe_tp_rank"], r["k"]) for r in swapped} == {(0, 1, 0), (1, 0, 0)}
    assert swapped[0]["sentence"] == "step 2, layer 1, rank 0, expert 3: w13_weight holds rank 1's shard"
    (z,) = by(doc, verdict="zeros")
    assert (z["tp_rank"], z["layer"], z["expert"], z["tensor"]) == (0, 0, 4, "w2_weight")
    assert z["sentence"] == "step 2, layer 0, rank 0, expert 4: w2_weight is all zeros"
    (t,) = by(doc, verdict="torn")
    assert [(g["first_chunk"], g["last_chunk"], g["source"], g.get("expert"), g.get("k")) for g in t["chunks"]] == [
        (0, 0, "expected", 5, 0), (1, 1, "index", 7, 2)]
    assert t["sentence"] == "step 2, layer 1, rank 1, expert 5: w13_weight is torn: chunk 0 expert 5 (expected), chunk 1 expert 7 (E+2)"
    (load,) = [x for x in doc["loads"] if x["missing"]]
    assert (load["step"], load["tp_rank"], load["layer"], load["expected"], load["captured"]) == (2, 1, 1, 32, 31)
    assert load["missing_entries"] == [{"slot": 6, "expert": 6, "tensor": "w2_weight"}]


def test_first_divergence_and_summaries(traces, index):
    doc = analyze([f"{traces}/unfenced"], index=index).doc
    (fd,) = doc["first_divergence"]
    assert fd["sentence"] == "step 1, layer 0, rank 1, expert 0: w2_weight_scale_inv holds expert 2 (E+2)"
    assert (fd["step"], fd["layer"], fd["copy_position"], fd["ranks"]) == (1, 0, 3, ["1"])
    sentences = [s["sentence"] for s in doc["summaries"]]
    assert sentences == [
        "rank 1, layer 0, step 1: 6/8 w2_weight_scale_inv are E+2",
        "rank 0, layer 0, step 2: 1/8 w2_weight are zeros",
        "rank 0, layer 1, step 2: 1/8 w13_weight hold rank 1's shard",
        "rank 1, layer 1, step 2: 1/8 w13_weight hold rank 0's shard, 1/8 are torn",
        "rank 1, layer 1, step 2: 1/8 w2_weight are missing",
    ]
    first = doc["summaries"][0]
    assert first["counts"] == [{"verdict": "stale", "detail": 2, "count": 6}] and first["total"] == 8


def test_first_divergence_lists_every_rank_there(model, index, tmp_path):
    """Same (step, layer, transport order, copy order) on both ranks: both are listed."""

    def swap(s, r, l):
        return {(3, "w13_weight"): ("rank", 1 - r)} if (s, l) == (0, 1) else {}

    write_scenario(model, str(tmp_path), "swap", [0, 1], swap)
    (fd,) = analyze([str(tmp_path / "swap")], index=index).doc["first_divergence"]
    assert fd["ranks"] == ["0", "1"]
    assert fd["sentence"] == ("step 0, layer 1, rank 0, expert 3: w13_weight holds rank 1's shard; "
                              "rank 1, expert 3: w13_weight holds rank 0's shard")


def test_order_is_step_layer_transport_then_copy_position(model, index, tmp_path):
    """A later expert's w13 at layer 0 beats an earlier expert's w2 at layer 1; within one
    expert, w13_weight comes before w2_weight_scale_inv."""

    def bad(s, r, l):
        if (s, r, l) == (0, 0, 1):
            return {(0, "w13_weight"): ("expert", 1)}
        if (s, r, l) == (0, 1, 0):
            return {(6, "w2_weight_scale_inv"): ("expert", 7), (6, "w13_weight_scale_inv"): ("expert", 4)}
        return {}

    write_scenario(model, str(tmp_path), "order", [0], bad)
    (fd,) = analyze([str(tmp_path / "order")], index=index).doc["first_divergence"]
    assert fd["sentence"] == "step 0, layer 0, rank 1, expert 6: w13_weight_scale_inv holds expert 4 (E-2)"


def test_other_verdicts(model, index, tmp_path):
    def odd(s, r, l):
        if (r, l) == (0, 0):
            return {(1, "w2_weight"): ("layer", 1), (2, "w13_weight_scale_inv"): ("tensor", "w2_weight_scale_inv"),
                    (3, "w13_weight_scale_inv"): ("fill", 1.0), (5, "w2_weight_scale_inv"): ("bytes", 0xFF)}
        if (r, l) == (0, 1):
            return {(0, "w13_weight"): ("bytes", 0x11)}
        if (r, l) == (1, 0):
            return {(0, "w2_weight"): ("random",)}
        if (r, l) == (1, 1):
            return {(4, "w2_weight_scale_inv"): ("expert", 3)}
        return {}

    write_scenario(model, str(tmp_path), "odd", [0], odd, extra=lambda sink, r: r == 0 and capture_load(
        sink, model, 0, 0, 0, capture_seq=0, experts=[0], claimed=[99]))  # joins the first load
    doc = analyze([str(tmp_path / "odd")], index=index).doc
    got = {(r["tp_rank"], r["layer"], r["expert"], r["tensor"]): r for r in doc["divergent_rows"]}
    wl = got[(0, 0, 1, "w2_weight")]
    assert wl["verdict"] == "wrong_layer" and wl["found"]["layer"] == 1
    assert wl["sentence"] == "step 0, layer 0, rank 0, expert 1: w2_weight holds the tensor of layer 1, expert 1"
    wt = got[(0, 0, 2, "w13_weight_scale_inv")]
    assert wt["verdict"] == "wrong_tensor" and wt["found"]["tensor"] == "w2_weight_scale_inv"
    assert wt["sentence"].endswith("w13_weight_scale_inv holds w2_weight_scale_inv of expert 2")
    c1 = got[(0, 0, 3, "w13_weight_scale_inv")]
    assert c1["verdict"] == "constant" and c1["value"] == "the constant 1 (float32)"
    cff = got[(0, 0, 5, "w2_weight_scale_inv")]
    assert cff["verdict"] == "constant" and cff["value"] == "the byte 0xFF repeated"
    c2 = got[(0, 1, 0, "w13_weight")]
    assert c2["verdict"] == "constant" and "unidentified value" in c2["value"]
    assert got[(1, 0, 0, "w2_weight")]["verdict"] == "unknown"
    st = got[(1, 1, 4, "w2_weight_scale_inv")]
    assert st["verdict"] == "stale" and st["k"] == -1 and "holds expert 3 (E-1)" in st["sentence"]
    ux = got[(0, 0, 99, "w13_weight")]
    assert ux["verdict"] == "unexpected" and ux["sentence"].endswith("w13_weight has no entry in the index")
    assert set(doc["totals"]["by_verdict"]) == {"match", "stale", "wrong_rank", "wrong_layer", "wrong_tensor", "zeros",
                                                "constant", "torn", "unknown", "unexpected", "missing"}


def test_torn_without_chunk_digests_is_unknown_with_a_warning(model, index, tmp_path):
    write_scenario(model, str(tmp_path), "nochunks", [0], lambda s, r, l: {(5, "w13_weight"): ("torn", 7)}
                   if (r, l) == (1, 1) else {}, chunk_digests="none")
    doc = analyze([str(tmp_path / "nochunks")], index=index).doc
    (row,) = doc["divergent_rows"]
    assert row["verdict"] == "unknown" and "no chunk digests" in row["sentence"]
    assert any("no chunk digests" in w for w in doc["warnings"])


def test_chunk_digests_on_every_row_changes_nothing(model, index, tmp_path):
    write_scenario(model, str(tmp_path), "all", STEPS, unfenced, chunk_digests="all", parts=3)
    a = analyze([str(tmp_path / "all")], index=index).doc
    assert a["totals"]["by_verdict"]["torn"] == 1 and a["totals"]["by_verdict"]["stale"] == 6


def test_sampling_restricts_the_expected_set(model, index, tmp_path):
    """A hook config that captured experts 0-3 and the w2 tensors only: the rest is not missing."""
    run = "sampled"
    write_run_json(str(tmp_path), run, model)
    config = {"out": str(tmp_path), "experts": [0, 1, 2, 3], "tensors": ["w2_weight", "w2_weight_scale_inv"]}
    for r in range(2):
        sink = open_rank(model, str(tmp_path), run, r, config=config)
        for l in model.layer_ids:
            capture_load(sink, model, 0, r, l, experts=[0, 1, 2, 3], capture_seq=l,
                         tensors=("w2_weight", "w2_weight_scale_inv"))
        assert sink.close()
    rep = analyze([str(tmp_path / run)], index=index)
    assert rep.doc["totals"]["sentence"] == "32/32 tensors match across 1 step, 2 ranks"
    assert rep.exit_code == 0
    assert rep.doc["runs"][0]["manifests"][0]["sampled_experts"] == [0, 1, 2, 3]


def test_resident_and_staged_loads_are_separate(model, index, tmp_path):
    run = "both"
    write_run_json(str(tmp_path), run, model)
    for r in range(2):
        sink = open_rank(model, str(tmp_path), run, r)
        for l in model.layer_ids:
            bad = {(2, "w2_weight_scale_inv"): ("expert", 4)} if (r, l) == (1, 0) else {}
            capture_load(sink, model, 0, r, l, source="resident", capture_seq=10 + l, corrupt=bad)
            capture_load(sink, model, 0, r, l, source="staged", capture_seq=l)
        assert sink.close()
    doc = analyze([str(tmp_path / run)], index=index).doc
    assert doc["totals"]["loads"] == 8
    assert [s["sentence"] for s in doc["summaries"]] == ["rank 1, layer 0, step 0 (resident): 1/8 w2_weight_scale_inv are E+2"]
    assert doc["first_divergence"][0]["source"] == "resident"


def test_several_runs_in_one_folder(traces, index):
    rep = analyze([traces], index=index)
    runs = {r["run_id"] for r in rep.doc["runs"]}
    assert runs == {"unfenced", "fenced"}
    (fd,) = rep.doc["first_divergence"]
    assert fd["run_id"] == "unfenced" and fd["sentence"].startswith("unfenced: step 1, layer 0, rank 1")
    assert rep.doc["summaries"][0]["sentence"] == "unfenced: rank 1, layer 0, step 1: 6/8 w2_weight_scale_inv are E+2"


def test_url_and_glob_inputs(traces, index):
    a = analyze([f"file://{traces}/unfenced"], index=index).doc
    b = analyze([f"{traces}/unf*"], index=index).doc
    assert a["totals"]["sentence"] == b["totals"]["sentence"]
    assert len(b["runs"]) == 1


def test_checkpoint_mode_uses_the_index_cache(model, traces, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    rep = analyze([f"{traces}/unfenced"], checkpoint=model.path)
    assert rep.doc["first_divergence"][0]["sentence"].endswith("w2_weight_scale_inv holds expert 2 (E+2)")
    assert rep.doc["inputs"]["index"].startswith(str(tmp_path / "cache"))


def test_grid_for_the_plot(traces, index):
    rep = analyze([f"{traces}/unfenced"], index=index)
    g = rep.grid
    assert g.verdict.shape == (1, 2, 2, 8)
    from moetrace.analysis.verdicts import MATCH, MISSING, STALE, TORN, WRONG_RANK, ZEROS

    v, k = g.verdict[0], g.k[0]
    assert (v[1, 0, :6] == STALE).all() and (k[1, 0, :6] == 2).all() and (v[1, 0, 6:] == MATCH).all()
    assert v[0, 0, 4] == ZEROS and v[1, 1, 5] == TORN and v[1, 1, 6] == MISSING
    assert v[0, 1, 3] == WRONG_RANK == v[1, 1, 3]
    assert np.count_nonzero(v != MATCH) == 6 + 1 + 1 + 1 + 2


def test_trace_written_by_the_real_tracer(model, index, tmp_path):
    """End to end with moetrace.tracer: the capture path's Parquet and manifests analyze as expected."""
    from moetrace.tracer.capture import Tracer
    from moetrace.tracer.config import TraceConfig

    for r in range(2):
        cfg = TraceConfig.from_dict({"out": str(tmp_path), "run_id": "live", "checkpoint_id": model.checkpoint_id,
                                     "flush_interval_s": 0.2, "rows_per_part": 50})
        tr = Tracer(cfg, r, 2)
        for step in range(2):
            for layer in model.layer_ids:
                held = {k: v.clone() for k, v in model._layer(layer, r).items()}
                if (step, r, layer) == (1, 1, 0):
                    held["w2_weight_scale_inv"][:6] = model._layer(layer, r)["w2_weight_scale_inv"][2:8]
                tr.capture(held, layer=layer, source="staged", step=step, experts=range(8), positions=range(8))
        assert tr.close()
    rep = analyze([str(tmp_path / "live")], index=index)
    doc = rep.doc
    assert doc["first_divergence"][0]["sentence"] == "step 1, layer 0, rank 1, expert 0: w2_weight_scale_inv holds expert 2 (E+2)"
    assert [s["sentence"] for s in doc["summaries"]] == ["rank 1, layer 0, step 1: 6/8 w2_weight_scale_inv are E+2"]
    assert doc["totals"]["sentence"] == "250/256 tensors match across 2 steps, 2 ranks; 6 stale"
    assert doc["incomplete"] == [] and rep.exit_code == 1


def test_two_swapped_experts_summarise_as_e_plus_and_minus_one(model, index, tmp_path):
    """A swap holds E+1 in one slot and E-1 in the other: the summary says so (the negative
    k of E-1 is not the encoding of a shared expert, which report version 2 mistook it for)."""
    swap = {(0, 1, 0): {(2, "w2_weight"): ("expert", 3), (3, "w2_weight"): ("expert", 2)}}
    write_scenario(model, str(tmp_path), "swap", [0], swap)
    rep = analyze([str(tmp_path / "swap")], index=index)
    assert rep.exit_code == 1
    assert [s["sentence"] for s in rep.doc["summaries"]] == ["rank 1, layer 0, step 0: 1/8 w2_weight are E+1, 1/8 are E-1"]
    assert sorted(r["k"] for r in rep.doc["divergent_rows"]) == [-1, 1]
