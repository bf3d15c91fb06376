"""The completeness rule holds every claim of a trace against its rows:
the demo's real traces, tampered as a hostile sweep did with the side files kept
consistent (parts, rows_written, rows_captured and online counts rewritten to match),
must never pass; the untampered copy (the negative control) must.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from support.traces import set_column, tamper_run

from moetrace.analysis import analyze


@pytest.fixture(scope="module")
def demo(demo_run):
    assert demo_run.returncode == 0, demo_run.stderr[-2000:]
    w = demo_run.workdir
    return w / "traces" / "unfenced", w / "traces" / "fenced", str(w / "index.parquet")


def audit(path, index):
    rep = analyze([str(path)], index=index)
    return rep.exit_code, rep.doc["incomplete"], rep.doc


def reasons(incomplete, *words):
    return [p for p in incomplete if all(w in p for w in words)]


def test_untampered_copies_keep_their_verdicts(demo, tmp_path):
    """Negative control: the tamper helper alone changes nothing the audit judges."""
    unf, fen, index = demo
    code, inc, _ = audit(tamper_run(fen, tmp_path / "fenced"), index)
    assert (code, inc) == (0, [])
    code, inc, doc = audit(tamper_run(unf, tmp_path / "unfenced"), index)
    assert (code, inc) == (1, []) and doc["totals"]["by_verdict"]["stale"] == 108


def test_a_rank_copied_under_another_label_is_refused(demo, tmp_path):
    """Item 1: rank=0 copied as rank=1 (manifest label, tp_rank, moe_tp_rank and the rows'
    tp_rank set to 1): the rows still say shard 0, which is not the capturing process's."""
    _, fen, index = demo

    def rows(label, t):
        return set_column(t, "tp_rank", [1] * t.num_rows) if label == "1" else t

    def manifest(label, m):
        if label == "1":
            m.update(rank_label="1", tp_rank=1, moe_tp_rank=1)

    run = tamper_run(fen, tmp_path / "copied", rows, manifest, copies={"1": "0"})
    code, inc, _ = audit(run, index)
    assert code == 2 and reasons(inc, "rank 1 holds rows of moe_tp_rank 0 but its process was moe_tp_rank 1"), inc

    # The rows' shard relabelled too: rank 0's bytes under shard 1 are rank 0's shard (a divergence),
    # and the server's own online verdicts ("match") disagree with the index.
    def rows_all(label, t):
        if label != "1":
            return t
        return set_column(set_column(t, "tp_rank", [1] * t.num_rows), "moe_tp_rank", [1] * t.num_rows)

    run = tamper_run(fen, tmp_path / "copied2", rows_all, manifest, copies={"1": "0"})
    code, inc, doc = audit(run, index)
    assert code == 1 and doc["totals"]["by_verdict"]["wrong_rank"] == 1600
    assert reasons(inc, "rank 1", "verified online as 'match' diverge from the index"), inc


def test_a_manifest_naming_another_ranks_shard_is_refused(demo, tmp_path):
    """Item 1: a module reporting the wrong moe_tp_rank (manifest and rows both say 0 on tp_rank 1)."""
    _, fen, index = demo

    def rows(label, t):
        return set_column(t, "moe_tp_rank", [0] * t.num_rows) if label == "1" else t

    def manifest(label, m):
        if label == "1":
            m["moe_tp_rank"] = 0

    code, inc, _ = audit(tamper_run(fen, tmp_path / "t", rows, manifest), index)
    assert code in (1, 2) and reasons(inc, "rank 1 manifest says moe_tp_rank 0, but tp_rank 1"), inc


def _drop(t, mask):
    return t.filter(pa.array(~np.asarray(mask)))


def test_coverage_cannot_shrink_below_the_recorded_layout(demo, tmp_path):
    """Item 2: slot 7 dropped everywhere with slot_count 7 (the layouts still hold 8)."""
    _, fen, index = demo

    def rows(label, t):
        t = _drop(t, t.column("slot").to_numpy() == 7)
        return set_column(t, "slot_count", [7] * t.num_rows)

    code, inc, _ = audit(tamper_run(fen, tmp_path / "t", rows), index)
    assert code == 2 and reasons(inc, "layer 0 (staged) report 7 slots but its recorded layout holds 8"), inc


def test_hidden_bad_slots_are_refused(demo, tmp_path):
    """Item 2: the unfenced run's 6 bad slots per staged load dropped and slot_count lowered."""
    unf, _, index = demo

    def rows(label, t):
        staged = pc.equal(t.column("source"), "staged").to_numpy(zero_copy_only=False)
        t = _drop(t, staged & (t.column("slot").to_numpy() < 6) if label == "1" else np.zeros(t.num_rows, bool))
        staged = pc.equal(t.column("source"), "staged").to_numpy(zero_copy_only=False)
        sc = np.where(staged & (label == "1"), 2, t.column("slot_count").to_numpy())
        return set_column(t, "slot_count", sc)

    code, inc, _ = audit(tamper_run(unf, tmp_path / "t", rows), index)
    assert code == 2 and reasons(inc, "rank 1 loads of layer 0 (staged) report 2 slots"), inc
    assert reasons(inc, "guard counts 108 mismatching tensors"), inc


@pytest.mark.parametrize("experts,missing", [("0-7", 108), ("0-5", 108), ("0-1", 36)])
def test_expert_sampling_cannot_turn_coverage_off(demo, tmp_path, experts, missing):
    """Item 3: the unfenced run's 108 bad rows (slots 0-5's w2 scales of rank 1's staged
    loads) deleted, then config.experts naming all experts, or fewer (the rows of the
    others deleted too, as a sampled capture writes them)."""
    unf, _, index = demo
    from moetrace.schema import parse_ids

    kept = set(parse_ids(experts, "experts"))

    def rows(label, t):
        bad = pc.equal(t.column("online"), "mismatch").to_numpy(zero_copy_only=False)
        return _drop(t, bad | ~np.isin(t.column("expert").to_numpy(), list(kept)))

    def manifest(label, m):
        m["config"]["experts"] = experts

    code, inc, _ = audit(tamper_run(unf, tmp_path / "t", rows, manifest), index)
    assert code == 2 and reasons(inc, f"{missing} expected entries not captured in their loads"), inc


def test_rows_the_sampling_excluded_are_refused(demo, tmp_path):
    """A manifest whose sampling excludes experts its rows still hold contradicts itself."""
    _, fen, index = demo

    def manifest(label, m):
        m["config"]["experts"] = "0-5"

    code, inc, _ = audit(tamper_run(fen, tmp_path / "t", manifest=manifest), index)
    assert code == 2 and reasons(inc, "rank 0 holds rows of expert(s) 6, 7 that its sampling (config) excluded"), inc


def test_rows_moved_out_of_scope_are_refused(demo, tmp_path):
    """Item 4: staged rows relabelled to layers 7 and 8 of the 2-layer model."""
    _, fen, index = demo

    def rows(label, t):
        staged = pc.equal(t.column("source"), "staged").to_numpy(zero_copy_only=False)
        layer = t.column("layer").to_numpy()
        return set_column(t, "layer", np.where(staged, layer + 7, layer))

    code, inc, doc = audit(tamper_run(fen, tmp_path / "t", rows), index)
    assert code == 2 and doc["totals"]["rows_out_of_scope"] == 1152
    assert reasons(inc, "holds rows of target layer(s) 7, 8, which its manifest's model does not have"), inc
    assert reasons(inc, "records the layout of layer 0 (staged) but holds no row of it"), inc


def test_the_manifests_own_verdicts_must_agree_with_the_rows(demo, tmp_path):
    """Item 5: every staged row deleted (the guard says mismatch, 108 tensors); the bad
    digests replaced by the expected ones, with and without the rows' online words."""
    unf, fen, index = demo

    def no_staged(label, t):
        return _drop(t, pc.equal(t.column("source"), "staged").to_numpy(zero_copy_only=False))

    code, inc, _ = audit(tamper_run(unf, tmp_path / "a", no_staged), index)
    assert code == 2 and reasons(inc, "rank 1 guard counts 108 mismatching tensors (status mismatch)"), inc
    assert reasons(inc, "records the layout of layer 0 (staged) but holds no row of it"), inc

    # The fenced run's digests are what the unfenced rows should have held (same loads, same order).
    good = {}
    for label in ("0", "1"):
        t = pa.concat_tables([pa.parquet.read_table(p) for p in sorted((fen / f"rank={label}").glob("part-*.parquet"))])
        good[label] = {k: d for k, d in zip(zip(*(t.column(c).to_pylist() for c in ("source", "layer", "expert", "tensor"))),
                                            t.column("digest").to_pylist())}

    def healed(words):
        def rows(label, t):
            keys = zip(*(t.column(c).to_pylist() for c in ("source", "layer", "expert", "tensor")))
            t = set_column(t, "digest", [good[label][k] for k in keys])
            return set_column(t, "online", ["match"] * t.num_rows) if words else t
        return rows

    code, inc, _ = audit(tamper_run(unf, tmp_path / "b", healed(False)), index)
    assert code == 2 and reasons(inc, "rank 1 108 rows verified online as 'mismatch' match the index"), inc
    code, inc, _ = audit(tamper_run(unf, tmp_path / "c", healed(True)), index)
    assert code == 2 and reasons(inc, "rank 1 guard counts 108 mismatching tensors (status mismatch) but the rows hold 0")


def test_a_slot_naming_two_experts_is_refused(demo, tmp_path):
    """Item 6: the E+2 rows' expert set to the expert whose bytes they hold."""
    unf, _, index = demo

    def rows(label, t):
        bad = pc.equal(t.column("online"), "mismatch").to_numpy(zero_copy_only=False)
        return set_column(t, "expert", np.where(bad, t.column("expert").to_numpy() + 2, t.column("expert").to_numpy()))

    code, inc, _ = audit(tamper_run(unf, tmp_path / "t", rows), index)
    assert code == 2 and reasons(inc, "rank 1 step 0 layer 0 (staged): slot 0 names experts 0, 2 within one load"), inc


def test_a_vanished_step_is_refused(demo, tmp_path):
    """Item 7: step 5 deleted on every rank."""
    _, fen, index = demo

    def rows(label, t):
        return _drop(t, t.column("step").to_numpy() == 5)

    code, inc, _ = audit(tamper_run(fen, tmp_path / "t", rows), index)
    assert code == 2 and reasons(inc, "rank 0 manifest counts 16 steps (steps_seen) but no row holds step(s) 5"), inc
    assert reasons(inc, "rank 1 manifest counts 200 captures but its rows hold 1"), inc


# ---------------------------------------------------------------- guarded traces


def guarded(src, dst):
    """The demo run as the production guard (guard_rows: mismatch) writes it: rows of the
    tensors the guard found mismatching only, the captures that submitted them, the rest
    the guard's verdicts in the manifest."""
    captures = {}

    def rows(label, t):
        t = _drop(t, ~pc.equal(t.column("online"), "mismatch").to_numpy(zero_copy_only=False))
        keys = zip(*(t.column(c).to_pylist() for c in ("model", "step", "source", "capture_seq", "layer", "tensor")))
        captures[label] = len(set(keys))
        return t

    def manifest(label, m):
        m["guard"]["rows"] = "mismatch"
        m["captures"] = captures[label]

    return tamper_run(src, dst, rows, manifest)


def test_a_clean_guarded_run_passes_on_the_guards_verdicts(demo, tmp_path):
    """A clean guard_rows=mismatch run holds no rows: its guard verified every tensor, so the
    audit passes with full coverage; a guard that left tensors unverified or covered less does not."""
    _, fen, index = demo
    code, inc, doc = audit(guarded(fen, tmp_path / "g"), index)
    t = doc["totals"]
    assert (code, inc, doc["status"]) == (0, [], "match")
    assert (t["rows_read"], t["match"], t["tensors"], t["missing"], t["guard_verified"]) == (0, 3200, 3200, 0, 3200)
    assert t["ranks"] == ["0", "1"] and "3,200 verified by the in-server guard" in t["sentence"]
    # negative controls: the guard's own record says it did not see everything
    for edit, words in (({"coverage": {"staged": 0.5, "resident": 1.0}}, "guard verified 50.0% of the expected staged"),
                        ({"tensors": {"match": 3200, "mismatch": 0, "unverified": 4, "reused": 0}},
                         "guard left 4 tensors unverified")):
        run = tamper_run(tmp_path / "g", tmp_path / f"g{len(words)}", manifest=lambda label, m: m["guard"].update(edit))
        code, inc, _ = audit(run, index)
        assert code == 2 and reasons(inc, words), inc


def test_a_divergent_guarded_run_is_divergent_and_whole(demo, tmp_path):
    """The unfenced run guarded: the guard's 108 mismatch rows are the divergences (exit 1),
    its matching tensors count as verified, nothing is missing (rank 0 has no rows at all)."""
    unf, _, index = demo
    code, inc, doc = audit(guarded(unf, tmp_path / "g"), index)
    t = doc["totals"]
    assert (code, inc, doc["status"]) == (1, [], "divergent")
    assert (t["rows_read"], t["match"], t["divergent"], t["missing"], t["tensors"]) == (108, 3092, 108, 0, 3200)
    assert t["by_verdict"]["stale"] == 108 and doc["missing_loads"] == []
    assert doc["first_divergence"][0]["sentence"].startswith("step 0, layer 0, rank 1")


def test_dtype_shape_and_size_must_be_the_indexs(demo, tmp_path):
    """Item 10: rows whose dtype, nbytes or shape contradict the index (digests untouched)."""
    _, fen, index = demo

    def rows(label, t):
        if label != "0":
            return t
        scale = pc.equal(t.column("tensor"), "w2_weight_scale_inv").to_numpy(zero_copy_only=False)
        t = set_column(t, "dtype", np.where(scale, "bfloat16", t.column("dtype").to_numpy(zero_copy_only=False)))
        t = set_column(t, "nbytes", np.where(scale, 4, t.column("nbytes").to_numpy()))
        w13 = pc.equal(t.column("tensor"), "w13_weight").to_numpy(zero_copy_only=False)
        shapes = t.column("shape").to_pylist()
        return set_column(t, "shape", [[128, 512] if w else s for w, s in zip(w13, shapes)])

    code, inc, _ = audit(tamper_run(fen, tmp_path / "t", rows), index)
    assert code == 2, inc
    assert reasons(inc, "400 w2_weight_scale_inv rows hold bfloat16, 4 bytes, where the index holds float32, 8 bytes"), inc
    assert reasons(inc, "w13_weight rows of shape [128, 512]", "where the index holds [256, 256]"), inc


def test_row_keys_do_not_collide():
    """The folded keys the rule counts captures and slot conflicts with: every distinct tuple
    of small ids (the common case, where a weak hash collides) keeps a distinct key."""
    from moetrace.analysis.row_facts import _key

    a, b = (x.ravel() for x in np.meshgrid(np.arange(600), np.arange(600)))
    keys = _key(np.zeros_like(a), a, b)
    assert len(np.unique(keys)) == len(a)
    assert (_key(a, b) == _key(a.copy(), b.copy())).all() and (_key(a, b) != _key(b, a))[a != b].all()


@pytest.mark.parametrize("race", [False, True])
def test_a_trace_the_guard_wrote_is_audited_on_its_verdicts(make_ckpt, tmp_path, race):
    """The guarded trace with the real guard (in this process, guard_rows: mismatch): two staged
    loads of a clean server pass with every tensor verified by the guard and no row; with
    the race the guard's E+2 rows are the divergences and the rest count as verified."""
    from support.guarded import StagedContext, shards

    from moetrace.checkpoints.index import write_index
    from moetrace.checkpoints.index_build import build_index
    from moetrace.hooks.kt import KTLoadCapture
    from moetrace.tracer.capture import Tracer
    from moetrace.tracer.config import TraceConfig

    ckpt = make_ckpt(num_layers=2, num_experts=8, hidden=128, intermediate=256, seed=3)
    index = str(write_index(build_index(ckpt, 1), tmp_path / "index.parquet"))
    tr = Tracer(TraceConfig.from_dict({"out": str(tmp_path / "traces"), "run_id": "g", "index": index,
                                       "guard": "record", "sources": ["staged"]}), 0, 1)
    cls = type("SharedFullContext", (StagedContext,), {"load": StagedContext.load})
    cap = KTLoadCapture(tr, cls).attach()
    try:
        ctx = cls(shards(ckpt), race=race)
        ctx.forward_layer(0)
        ctx.forward_layer(1)
    finally:
        cap.detach()
    assert tr.close()
    rep = analyze([str(tmp_path / "traces" / "g")], index=index)
    t = rep.doc["totals"]
    stale = 2 * 6 if race else 0
    assert (rep.exit_code, rep.doc["incomplete"]) == ((1 if race else 0), [])
    assert (t["rows_read"], t["match"], t["missing"], t["tensors"]) == (stale, 64 - stale, 0, 64)
    assert (t["guard_verified"], t["by_verdict"]["stale"]) == (64 - stale, stale)
