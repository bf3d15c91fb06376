"""`moetrace conform`: the installed sglang-kt's own SharedFullContext.load, kt-kernel's
writer, moetrace's KT hook and analysis, on CPU.

The expectations are independent of moetrace's transport code: which expert's bytes a
late reader holds follows from the fork's double-buffered loop alone (position p reads
the slot after write p+2 refilled it), and which experts the fork stages follows from
its load() (FP8: all, in id order; BF16: the non-GPU-mask ones). One session fixture
runs every real case in one set of rank processes. MOETRACE_REQUIRE_FORK=1 (make test)
turns a missing sglang-kt or kt-kernel into a failure instead of a skip.
"""

from __future__ import annotations

import ast
import copy
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from moetrace.cli import main
from moetrace.conform import fence as fork_fence, source as fork_source, sim_cuda
from moetrace.jobs.conform import Case, result_doc, result_lines, run_conform
from moetrace.schema import COPY_ORDERS

from support.traces import read_rows

REQUIRE = os.environ.get("MOETRACE_REQUIRE_FORK") == "1"
E = 6
MASK = tuple(range(1, E, 4))  # the GPU mask conform hands to load: experts 1 and 5
WRAPPER = Path("sglang/srt/layers/moe/kt_ep_wrapper.py")
# The fork's own reader wait in _prepare_weight_fp8 (0.7.2), and that loop with the seed
# PR's reader fence written in by hand, as a user patching their fork would.
SHIPPED_LOOP = """            if do_write:
                wrapper.sync_write_weight_scale_to_buffer()
                if idx + 1 < len(cpu_expert_ids):
                    next_slot = (idx + 1) % 2
                    # Before writing to next_slot, ensure copy from that slot is complete.
                    if idx > 0:
                        events[idx - 1].synchronize()
                    submit_write_expert(cpu_expert_ids[idx + 1], next_slot)
"""
FENCED_LOOP = """            if do_write:
                wrapper.sync_write_weight_scale_to_buffer()
            if idx > 0 and idx + 1 < len(cpu_expert_ids):
                events[idx - 1].synchronize()
                dist.barrier(group=get_tp_group().device_group)
            if do_write and idx + 1 < len(cpu_expert_ids):
                submit_write_expert(cpu_expert_ids[idx + 1], (idx + 1) % 2)
"""


def installed_fork() -> fork_source.ForkSource:
    try:
        return fork_source.find_fork()
    except fork_source.ForkError as err:
        if REQUIRE:
            pytest.fail(f"MOETRACE_REQUIRE_FORK=1 but {err}")
        pytest.skip(str(err))


def late_reader(staged: list[int]) -> dict[int, int]:
    """Expert -> whose bytes it holds when every copy is read after the next refill of its slot."""
    return {e: staged[p + 2] if p + 2 < len(staged) else e for p, e in enumerate(staged)}


def expected_held(staged: list[int]) -> list[int]:
    late = late_reader(staged)
    return [late.get(e, e) for e in range(E)]


def hand_patched_fork(root: Path) -> Path:
    """The installed file with the reader fence written into _prepare_weight_fp8 only (the PR's scope)."""
    text = (installed_fork().path).read_text()
    assert text.count(SHIPPED_LOOP) == 3, "the fork's staging loop changed: update SHIPPED_LOOP"
    dst = root / WRAPPER
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text.replace(SHIPPED_LOOP, FENCED_LOOP, 1))
    return root


@pytest.fixture(scope="session")
def conform_runs(tmp_path_factory) -> tuple[dict, Path]:
    """Every real case in one set of rank processes, once per session (across xdist
    workers): name -> the --json-out document; and the work folder."""
    from conftest import once_per_session

    installed_fork()

    def run(work: Path) -> dict:
        user_fork = str(hand_patched_fork(work / "user-fork"))
        cases = {
            "shipped": Case("fp8_block", "slow-peer", False, "kt-kernel", E),
            "patched": Case("fp8_block", "slow-peer", True, "kt-kernel", E),
            "channel": Case("fp8_channel", "slow-peer", False, "kt-kernel", E),
            "bf16": Case("bf16", "slow-peer", False, "moetrace", E),
            "bf16_patched": Case("bf16", "slow-peer", True, "moetrace", E),
            "user_fork": Case("fp8_block", "slow-peer", False, "kt-kernel", E, user_fork),
            "user_fork_channel": Case("fp8_channel", "slow-peer", False, "moetrace", E, user_fork),
        }
        results = run_conform(list(cases.values()), tp=2, workdir=str(work / "conform"))
        return {"work": str(work / "conform"), "docs": {k: result_doc(r) for k, r in zip(cases, results)}}

    d = once_per_session(tmp_path_factory, "conform", run)
    return d["docs"], Path(d["work"])


def held(doc: dict, rank: int, tensor: str) -> list:
    return doc["held"][str(rank)][tensor]


def _clean(doc: dict, tp: int = 2):
    t = doc["analysis"]["totals"]
    assert doc["exit_code"] == 0 and doc["status"] == "match", doc["totals"]
    assert t["tensors"] == t["match"] == tp * E * len(COPY_ORDERS[doc["case"]["fmt"]]) and t["missing"] == 0


def test_shipped_fork_is_caught_rank1_holds_e_plus_2(conform_runs):
    """Negative control: the fork as installed, rank 1 reading late, FP8 block TP2."""
    doc = conform_runs[0]["shipped"]
    assert doc["exit_code"] == 1 and doc["status"] == "divergent"
    staged = list(range(E))  # FP8: every expert, id order, although load was handed a GPU mask
    for tensor in COPY_ORDERS["fp8_block"]:
        assert held(doc, 0, tensor) == list(range(E))
        assert held(doc, 1, tensor) == expected_held(staged) == [2, 3, 4, 5, 4, 5]
    first = doc["analysis"]["first_divergence"][0]
    e = first["entries"][0]
    assert (first["ranks"], e["tp_rank"], e["expert"], e["verdict"], e["k"]) == (["1"], 1, 0, "stale", 2)
    assert "rank 1, expert 0: w13_weight holds expert 2 (E+2)" in doc["first_divergence"][0]
    if REQUIRE:
        assert doc["writer_kind"] == "kt-kernel" and doc["writer"].startswith("kt-kernel 0.7.2 FP8 wrapper")


def test_patched_fence_passes_on_the_same_schedule(conform_runs):
    doc = conform_runs[0]["patched"]
    _clean(doc)
    assert "_prepare_weight_fp8" in doc["patched"]
    if REQUIRE:
        assert doc["writer_kind"] == "kt-kernel"


def test_fp8_staging_ignores_the_gpu_mask_bf16_copies_it_first(conform_runs):
    """Transport positions in the trace follow the fork's load(): FP8 stages every
    expert in id order; BF16 copies mask experts device-to-device (-1) first."""
    docs, work = conform_runs
    cpu = [x for x in range(E) if x not in MASK]
    for name, want in (("shipped", {e: e for e in range(E)}),
                       ("bf16", {e: (cpu.index(e) if e in cpu else -1) for e in range(E)})):
        rows = read_rows(str(work / "traces"), docs[name]["run_id"]).to_pylist()
        assert {(r["tp_rank"], r["expert"]): r["transport_position"] for r in rows} == \
            {(rank, e): p for rank in (0, 1) for e, p in want.items()}


def test_fp8_channel_and_bf16_race_too(conform_runs):
    docs = conform_runs[0]
    ch = docs["channel"]
    assert ch["exit_code"] == 1
    assert all(held(ch, 1, t) == expected_held(list(range(E))) for t in COPY_ORDERS["fp8_channel"])
    assert ch["writer_kind"] == "kt-kernel" or "because kt-kernel" in ch["writer"]  # said why not
    bf = docs["bf16"]
    cpu = [e for e in range(E) if e not in MASK]
    assert bf["exit_code"] == 1 and bf["writer_kind"] == "moetrace"
    assert all(held(bf, 1, t) == expected_held(cpu) for t in COPY_ORDERS["bf16"])
    assert all(held(bf, 1, t)[e] == e for t in COPY_ORDERS["bf16"] for e in MASK)  # resident: never staged
    _clean(docs["bf16_patched"])


def test_a_fork_patched_by_hand_validates_without_patch_fence(conform_runs):
    """The user's workflow: their own fenced fork, --fork-path, no --patch-fence: exit 0.
    The PR's scope is _prepare_weight_fp8, so the same fork's FP8-channel path still races."""
    docs = conform_runs[0]
    _clean(docs["user_fork"])
    assert docs["user_fork"]["patched"] == [] and docs["user_fork"]["fork"]["version"] == "unknown"
    assert docs["user_fork_channel"]["exit_code"] == 1


def test_guard_in_the_forks_load_counts_what_the_analysis_finds(conform_runs):
    """The in-server guard ran inside the fork's real load (record, all rows): each rank's
    mismatch counter is exactly its divergent rows in the analysis; the patched fork keeps
    every counter at zero with full coverage."""
    docs = conform_runs[0]
    for name in ("shipped", "channel", "bf16", "patched", "bf16_patched"):
        doc = docs[name]
        rows = doc["analysis"]["divergent_rows"]
        for rank in range(2):
            g = doc["guard"][str(rank)]
            want = sum(1 for r in rows if r["tp_rank"] == rank)
            assert g["tensors"]["mismatch"] == want and g["tensors"]["unverified"] == 0, (name, rank)
            assert g["coverage"] == {"staged": 1.0} and g["loads"]["mismatch"] == (1 if want else 0), (name, rank)
        assert (doc["guard"]["1"]["tensors"]["mismatch"] > 0) == (not doc["case"]["patch_fence"]), name
    assert docs["patched"]["guard"]["0"]["status"] == docs["patched"]["guard"]["1"]["status"] == "ok"


def test_result_lines_name_the_stale_experts(conform_runs):
    doc = conform_runs[0]["shipped"]
    text = "\n".join(result_lines(doc))
    assert "DIVERGENT" in text and "rank 1 w13_weight/w13_weight_scale_inv/w2_weight/w2_weight_scale_inv: " \
                                    "experts 0..5 hold [2, 3, 4, 5, 4, 5]" in text
    assert (doc["schema"], doc["version"], doc["analysis"]["status"]) == ("moetrace.conform", 1, "divergent")
    assert "PASS: every rank holds its shard" in "\n".join(result_lines(conform_runs[0]["patched"]))


# ------------------------------------------------------------ refusals (no processes)


def test_no_fork_or_unsupported_fork_exits_2_naming_what_is_missing(tmp_path):
    r = CliRunner().invoke(main, ["conform", "--fork-path", str(tmp_path / "nowhere")])
    assert r.exit_code == 2 and "no sglang/srt/layers/moe/kt_ep_wrapper.py under it" in r.output
    bad = tmp_path / "bad" / WRAPPER
    bad.parent.mkdir(parents=True)
    bad.write_text("class SharedFullContext:\n    def load(self, layer_idx, wrapper):\n        pass\n")
    r = CliRunner().invoke(main, ["conform", "--fork-path", str(tmp_path / "bad")])
    assert r.exit_code == 2 and "has no method _prepare_weight_fp8" in r.output and len(r.output.splitlines()) == 1


def test_patch_fence_refuses_a_loop_it_does_not_know(tmp_path):
    fixed = hand_patched_fork(tmp_path)  # its _prepare_weight_fp8 has no rank-0-only wait left to replace
    r = CliRunner().invoke(main, ["conform", "--fork-path", str(fixed), "--patch-fence"])
    assert r.exit_code == 2 and "--patch-fence: _prepare_weight_fp8 has no staging loop" in r.output


def test_patch_fence_rewrites_each_staging_loop():
    parsed = fork_source.parse_fork(installed_fork())
    cls = copy.deepcopy(parsed.cls_node)
    assert fork_fence.check_patchable(cls) == list(fork_fence.METHODS)
    ns = {"torch": None, "dist": None, "get_tp_group": None}
    assert fork_fence.patch_fence(cls, ns) == list(fork_fence.METHODS)
    for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in fork_fence.METHODS):
        src = ast.unparse(fn)
        assert src.count(f"{fork_fence.READER_FENCE}(idx, len(cpu_expert_ids), events)") == 1
        assert "events[idx - 1].synchronize()" not in src  # rank 0's own wait became every rank's fence
        assert src.index(f"{fork_fence.FIRST_FENCE}()") < src.index("submit_write_expert(cpu_expert_ids[0], 0)")
    assert "events[idx - 1].synchronize()" in ast.unparse(parsed.cls_node)  # the cached tree stays the file's


# ---------------------------------------------------------- the simulated runtime


def test_streams_are_fifo_and_events_mark_them():
    rt = sim_cuda.SimRuntime(0, timeout_s=10)
    cuda = rt.cuda_module()
    gate = {"open": False}

    class Until(sim_cuda.Hold):
        label = "test hold"

        def releasable(self):
            return gate["open"]

    src, dst = torch.arange(4.0), torch.zeros(3, 4)
    s = cuda.Stream()
    rt.copy_hook = lambda d, x: Until() if d.storage_offset() == 0 else None
    ev0, ev1 = cuda.Event(), cuda.Event()
    with cuda.stream(s):
        dst[0].copy_(src, non_blocking=True)  # held
        ev0.record(s)
        dst[1].copy_(src + 1, non_blocking=True)  # behind the held one
        ev1.record(s)
    dst[2].copy_(src, non_blocking=True)  # default stream: at once
    assert dst[2].tolist() == src.tolist()
    assert dst[1].sum() == 0 and not ev0.query() and not ev1.query()  # FIFO: nothing passed the hold
    gate["open"] = True
    ev1.synchronize()
    assert ev0.query() and dst[0].tolist() == src.tolist() and dst[1].tolist() == (src + 1).tolist()
    with torch.no_grad():  # the copy runs under the issuer's autograd mode
        leaf = torch.nn.Parameter(torch.zeros(2, 4))
        with cuda.stream(s):
            leaf[0].copy_(src, non_blocking=True)
        cuda.synchronize()
    assert leaf[0].tolist() == src.tolist()
    rt.close()
