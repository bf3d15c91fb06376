"""`moetrace conform`: the installed sglang-kt's own SharedFullContext.load, kt-kernel's
writer, moetrace's KT hook and analysis, on CPU.

The expectations are independent of moetrace's transport code: which expert's bytes a
late reader holds follows from the fork's double-buffered loop alone (position p reads
the slot after write p+2 refilled it), and which experts the fork stages follows from
its load() (FP8 from 0.6.4 on: all, in id order; BF16 and FP8 before 0.6.4: the
non-GPU-mask ones). This file holds no line of the fork: the forks with a fence written
in by hand (right and wrong) are AST transformations of the installed file, made here,
independently of conform/fence.py. One session job runs every real case in one set of
rank processes. MOETRACE_REQUIRE_FORK=1 (make test) turns a missing sglang-kt, kt-kernel
or the 0.5.2 release (Makefile: kt-releases/) into a failure instead of a skip.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.traces import read_rows

from moetrace.analysis.sentences import guard_sentence
from moetrace.cli import main
from moetrace.conform import fence, releases, requirements, sim_cuda
from moetrace.conform import fork as fork_source
from moetrace.conform.rank import signal_words
from moetrace.jobs.conform import Case, result_doc, result_lines, run_conform
from moetrace.schema import COPY_ORDERS

REQUIRE = os.environ.get("MOETRACE_REQUIRE_FORK") == "1"
E = 6
MASK = tuple(range(1, E, 4))  # the GPU mask conform hands to load: experts 1 and 5
WRAPPER = fork_source.WRAPPER_REL
OLD_RELEASE = Path(sys.prefix) / "kt-releases" / "sglang-kt-0.5.2"  # Makefile: before 0.6.4's all-staged FP8
FP8 = "_prepare_weight_fp8"
INT4 = "_prepare_weight_int4"
# The hand-written fences, right and wrong (moetrace's text, placed by ast below).
READER_WAIT = "if {i} > 0 and {i} + 1 < {n}:\n    {ev}[{i} - 1].synchronize()"
RANK0_WAIT = "if {i} > 0 and {i} + 1 < {n} and get_tensor_model_parallel_rank() == 0:\n    {ev}[{i} - 1].synchronize()"
BARRIER = "dist.barrier(group=get_tp_group().device_group)"
DRAIN = "torch.cuda.synchronize()"
RANK0_DRAIN = "if get_tensor_model_parallel_rank() == 0:\n    torch.cuda.synchronize()"
VARIANTS = {  # name -> (reader fence, where: "before"/"after" the refill, first-write fence)
    "hand": (f"{READER_WAIT}\n    {BARRIER}", "before", f"{DRAIN}\n{BARRIER}"),
    "barrier_after_refill": (f"{READER_WAIT}\n    {BARRIER}", "after", f"{DRAIN}\n{BARRIER}"),
    "rank0_only_drain": (f"{RANK0_WAIT}\nif {{i}} > 0 and {{i}} + 1 < {{n}}:\n    {BARRIER}", "before",
                         f"{RANK0_DRAIN}\n{BARRIER}"),
    "event_sync_without_barrier": (READER_WAIT, "before", DRAIN),
    "first_write_only": ("", "before", f"{DRAIN}\n{BARRIER}"),
}
WRONG = [v for v in VARIANTS if v != "hand"]


def installed_fork() -> fork_source.InstalledFork:
    try:
        return fork_source.find_fork()
    except fork_source.ForkError as err:
        if REQUIRE:
            pytest.fail(f"MOETRACE_REQUIRE_FORK=1 but {err}")
        pytest.skip(str(err))


def old_release() -> Path | None:
    if (OLD_RELEASE / WRAPPER).is_file():
        return OLD_RELEASE
    if REQUIRE:
        pytest.fail(f"MOETRACE_REQUIRE_FORK=1 but {OLD_RELEASE} has no {WRAPPER} (make venv installs it)")
    return None


def late_reader(staged: list[int]) -> dict[int, int]:
    """Expert -> whose bytes it holds when every copy is read after the next refill of its slot."""
    return {e: staged[p + 2] if p + 2 < len(staged) else e for p, e in enumerate(staged)}


def expected_held(staged: list[int]) -> list[int]:
    late = late_reader(staged)
    return [late.get(e, e) for e in range(E)]


# ------------------------------------------------- forks fenced by hand (AST, no fork text)


def _class(tree: ast.Module) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == fork_source.CLASS_NAME)


def _calls(node: ast.AST) -> set[str]:
    return {getattr(n.func, "attr", getattr(n.func, "id", None)) for n in ast.walk(node) if isinstance(n, ast.Call)}


def _stmts(text: str, **names) -> list[ast.stmt]:
    return ast.parse(text.format(**names)).body if text else []


def fence_by_hand(fn: ast.FunctionDef, variant: str) -> None:
    """Write a fence into a staging method as a user patching their fork would: the
    reader fence next to the statement of the loop that refills a slot, the first-write
    fence before the method's first write."""
    reader, where, first = VARIANTS[variant]
    writes = {"submit_write_weight_scale_to_buffer"}
    writes |= {d.name for d in ast.walk(fn) if isinstance(d, ast.FunctionDef) and _calls(d) & writes}
    loop = next(s for s in fn.body if isinstance(s, ast.For) and _calls(s) & writes)
    wait = next(n.func.value for n in ast.walk(loop) if isinstance(n, ast.Call)
                and getattr(n.func, "attr", "") == "synchronize" and isinstance(n.func.value, ast.Subscript))
    i, ev = wait.slice.left.id, wait.value.id
    count = ast.unparse(loop.iter.args[0])
    n = count if loop.iter.func.id == "range" else f"len({count})"  # INT4: for e in range(num_experts)
    refill = next(k for k, s in enumerate(loop.body) if _calls(s) & writes)
    at = refill if where == "before" else refill + 1
    loop.body[at:at] = _stmts(reader, i=i, n=n, ev=ev)
    first_write = next(k for k, s in enumerate(fn.body) if s is not loop and _calls(s) & writes)
    fn.body[first_write:first_write] = _stmts(first)


def write_variant(root: Path, transform) -> Path:
    """The installed file, transformed (transform(class node)), written as a fork folder."""
    tree = ast.parse(installed_fork().path.read_text())
    transform(_class(tree))
    dst = root / WRAPPER
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(ast.unparse(ast.fix_missing_locations(tree)))
    return root


def hand_fenced(root: Path, variant: str, method: str = FP8) -> Path:
    def transform(cls):
        fence_by_hand(next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == method), variant)

    return write_variant(root, transform)


def sigill_fork(root: Path) -> Path:
    """The installed fork beside a kt_kernel whose wrapper dies by SIGILL, as kt-kernel
    0.6.4's FP8 wrapper does on a CPU without AVX-512."""
    dst = root / WRAPPER
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(installed_fork().path, dst)
    (root / "kt_kernel").mkdir()
    (root / "kt_kernel" / "__init__.py").write_text(
        "import os, signal\n__version__ = '0.6.4'\n__cpu_variant__ = 'avx2'\n\n"
        "class KTMoEWrapper:\n    def __init__(self, *a, **k):\n        os.kill(os.getpid(), signal.SIGILL)\n")
    info = root / "kt_kernel-0.6.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kt-kernel\nVersion: 0.6.4\n")
    return root


def run_cases(work: Path) -> dict:
    """Every real case (the session job "conform", support/session_jobs.py): name -> the
    --json-out document, and the work folder. One set of rank processes for the forks
    that share the side kt-kernel, one for the SIGILL writer (which then runs again)."""
    try:
        fork_source.find_fork()
    except fork_source.ForkError as err:
        return {"missing": str(err)}
    old = OLD_RELEASE if (OLD_RELEASE / WRAPPER).is_file() else None
    cases = {
        "shipped": Case("fp8_block", "slow-peer", False, "kt-kernel", E),
        "patched": Case("fp8_block", "slow-peer", True, "kt-kernel", E),
        "channel": Case("fp8_channel", "slow-peer", False, "kt-kernel", E),
        "channel_patched": Case("fp8_channel", "slow-peer", True, "kt-kernel", E),
        "bf16": Case("bf16", "slow-peer", False, "moetrace", E),
        "bf16_patched": Case("bf16", "slow-peer", True, "moetrace", E),
        "user_fork_channel": Case("fp8_channel", "slow-peer", False, "moetrace", E,
                                  str(hand_fenced(work / "fork-hand-channel", "hand"))),
    }
    for v in VARIANTS:
        cases[v] = Case("fp8_block", "slow-peer", False, "kt-kernel", E, str(hand_fenced(work / f"fork-{v}", v)))
    # INT4: kt-kernel's RAWINT4 writer, one more set of rank processes (one per kt-kernel method)
    cases["int4_shipped"] = Case("int4", "slow-peer", False, "kt-kernel", E)
    cases["int4_patched"] = Case("int4", "slow-peer", True, "kt-kernel", E)
    cases["int4_event_sync_without_barrier"] = Case(
        "int4", "slow-peer", False, "kt-kernel", E,
        str(hand_fenced(work / "fork-int4-event-sync", "event_sync_without_barrier", INT4)))
    if old is not None:
        cases["old"] = Case("fp8_block", "slow-peer", False, "kt-kernel", E, str(old))
        cases["old_patched"] = Case("fp8_block", "slow-peer", True, "kt-kernel", E, str(old))
    results = run_conform(list(cases.values()), tp=2, workdir=str(work / "conform"))
    docs = {k: result_doc(r) for k, r in zip(cases, results)}
    (sig,) = run_conform([Case("fp8_block", "slow-peer", False, "kt-kernel", 4, str(sigill_fork(work / "sigill")))],
                         tp=2)
    docs["sigill"] = result_doc(sig)
    return {"work": str(work / "conform"), "docs": json.loads(json.dumps(docs))}


@pytest.fixture(scope="session")
def conform_runs(tmp_path_factory) -> tuple[dict, Path]:
    """run_cases, once per session in the background (conftest.JOB_FIXTURES)."""
    from conftest import session_job

    d = session_job(tmp_path_factory, "conform")
    if "missing" in d:
        if REQUIRE:
            pytest.fail(f"MOETRACE_REQUIRE_FORK=1 but {d['missing']}")
        pytest.skip(d["missing"])
    return d["docs"], Path(d["work"])


def held(doc: dict, rank: int, tensor: str) -> list:
    return doc["held"][str(rank)][tensor]


def _clean(doc: dict, tp: int = 2):
    t = doc["analysis"]["totals"]
    assert doc["exit_code"] == 0 and doc["status"] == "match", (doc["totals"], doc["error"])
    assert t["tensors"] == t["match"] == tp * E * len(COPY_ORDERS[doc["case"]["fmt"]]) and t["missing"] == 0


def test_shipped_fork_is_caught_rank1_holds_e_plus_2(conform_runs):
    """Negative control: the fork as installed, rank 1 reading late, FP8 block TP2."""
    doc = conform_runs[0]["shipped"]
    assert doc["exit_code"] == 1 and doc["status"] == "divergent"
    staged = list(range(E))  # FP8 (0.6.4 on): every expert, id order, although load was handed a GPU mask
    for tensor in COPY_ORDERS["fp8_block"]:
        assert held(doc, 0, tensor) == list(range(E))
        assert held(doc, 1, tensor) == expected_held(staged) == [2, 3, 4, 5, 4, 5]
    first = doc["analysis"]["first_divergence"][0]
    e = first["entries"][0]
    assert (first["ranks"], e["tp_rank"], e["expert"], e["verdict"], e["k"]) == (["1"], 1, 0, "stale", 2)
    assert "rank 1, expert 0: w13_weight holds expert 2 (E+2)" in doc["first_divergence"][0]
    assert doc["e_plus_k"] == [2] and doc["method"] == FP8
    if REQUIRE:
        assert doc["writer_kind"] == "kt-kernel" and doc["writer"].startswith("kt-kernel 0.7.2 FP8 wrapper")


def test_patched_fence_passes_every_format_it_patches(conform_runs):
    """--patch-fence, derived from the class's AST, fences the method load dispatches the
    format to, and each passes on the schedule that catches the shipped code."""
    docs = conform_runs[0]
    for name, method in (("patched", FP8), ("channel_patched", "_prepare_weight_fp8_channel"),
                         ("bf16_patched", "_prepare_weight_bf16")):
        _clean(docs[name])
        assert docs[name]["patched"] == docs[name]["patch"]["methods"] == [method], name
    if REQUIRE:
        assert docs["patched"]["writer_kind"] == "kt-kernel"


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
    assert bf["e_plus_k"] == [2, 3]  # staged positions skip the mask: expert 0 (position 0) holds 3


def test_a_fork_fenced_by_hand_validates_without_patch_fence(conform_runs):
    """The user's workflow: their own fenced fork, --fork-path, no --patch-fence: exit 0.
    Fencing _prepare_weight_fp8 only (the PR's scope) leaves the FP8-channel path racing."""
    docs = conform_runs[0]
    _clean(docs["hand"])
    assert docs["hand"]["patched"] == [] and docs["hand"]["fork"]["version"] == "unknown"
    assert docs["hand"]["fork"]["released"] is None  # no RECORD beside a hand-made file
    assert docs["user_fork_channel"]["exit_code"] == 1


@pytest.mark.parametrize("variant", WRONG)
def test_a_wrong_fence_is_caught(conform_runs, variant):
    """Barrier after the refill, rank-0-only drain, event sync without a barrier, only
    the first-write fence: each leaves rank 1 holding a later expert's bytes."""
    doc = conform_runs[0][variant]
    assert doc["exit_code"] == 1 and doc["status"] == "divergent", (variant, doc["totals"], doc["error"])
    assert doc["e_plus_k"] and all(k > 0 for k in doc["e_plus_k"])


def test_a_release_before_0_6_4_runs_and_holds_e_plus_3(conform_runs):
    """sglang-kt 0.5.2: no initialize_cpu_buffers, no _restore_raw_attrs, FP8 copies the
    GPU-mask experts directly; conform drives what its own __init__ and load reach."""
    docs = conform_runs[0]
    if "old" not in docs:
        pytest.skip(f"{OLD_RELEASE} not installed")
    doc = docs["old"]
    cpu = [e for e in range(E) if e not in MASK]
    assert doc["fork"]["version"] == "0.5.2" and doc["fork"]["released"] is True
    assert doc["exit_code"] == 1 and all(held(doc, 1, t) == expected_held(cpu) for t in COPY_ORDERS["fp8_block"])
    assert "holds expert 3 (E+3)" in doc["first_divergence"][0] and doc["e_plus_k"] == [2, 3]
    _clean(docs["old_patched"])


def test_guard_in_the_forks_load_counts_what_the_analysis_finds(conform_runs):
    """The in-server guard ran inside the fork's real load (record, all rows): each rank's
    mismatch counter is exactly its divergent rows in the analysis; the patched fork keeps
    every counter at zero with full coverage; the line counts loads as the record does."""
    docs = conform_runs[0]
    for name in ("shipped", "channel", "bf16", "patched", "bf16_patched", "int4_shipped", "int4_patched"):
        doc = docs[name]
        rows = doc["analysis"]["divergent_rows"]
        for rank in range(2):
            g = doc["guard"][str(rank)]
            want = sum(1 for r in rows if r["tp_rank"] == rank)
            assert g["tensors"]["mismatch"] == want and g["tensors"]["unverified"] == 0, (name, rank)
            assert g["coverage"] == {"staged": 1.0} and g["loads"]["mismatch"] == (1 if want else 0), (name, rank)
            loads = sum(g["loads"].values())
            assert f"{g['loads']['mismatch']}/{loads} load" in guard_sentence({str(rank): g}), (name, rank)
        assert (doc["guard"]["1"]["tensors"]["mismatch"] > 0) == (not doc["case"]["patch_fence"]), name
    assert docs["patched"]["guard"]["0"]["status"] == docs["patched"]["guard"]["1"]["status"] == "ok"
    assert "0/1 load mismatched" in guard_sentence(docs["patched"]["guard"])


def test_provenance_names_the_file_and_class_that_ran(conform_runs):
    docs = conform_runs[0]
    src = installed_fork()
    f = docs["shipped"]["fork"]
    assert f["file_sha256"] == hashlib.sha256(src.path.read_bytes()).hexdigest() == f["released_sha256"]
    assert f["released"] is True and f["distribution"] == "sglang-kt" and f["version"] == src.version
    assert docs["hand"]["fork"]["file_sha256"] != f["file_sha256"]
    assert docs["hand"]["fork"]["class_sha256"] != f["class_sha256"]
    diff = docs["patched"]["patch"]["diff"].splitlines()
    added = [ln for ln in diff if ln.startswith("+") and not ln.startswith("+++")]
    assert not [ln for ln in diff if ln.startswith("-") and not ln.startswith("---")]  # the fence only adds
    assert any("dist.barrier(" in ln for ln in added) and any(".synchronize()" in ln for ln in added)
    assert docs["shipped"]["patch"] is None
    line = result_lines(docs["patched"])[0]
    assert f["file_sha256"][:12] in line and "the released file" in line and "patched into _prepare_weight_fp8" in line


def test_a_writer_dying_by_sigill_is_named_and_moetraces_writer_stands_in(conform_runs):
    doc = conform_runs[0]["sigill"]
    assert doc["writer_kind"] == "moetrace", doc["error"]
    assert "because kt-kernel 0.6.4's FP8 writer needs " in doc["writer"] and ": illegal instruction" in doc["writer"]
    assert doc["exit_code"] == 1  # the fork as shipped is still caught, with moetrace's writer


def test_int4_shipped_is_caught_patched_passes_wrong_fence_caught(conform_runs):
    """The fork's own _prepare_weight_int4: every expert staged in id order, so the late
    reader holds E+2 in all four tensors; the AST-derived fence passes; a wrong fence
    (each rank syncs its own event, no barrier) is caught. What rank 0 holds equals the
    expected side (transposed shards, the identity's shape, moetrace's own permutation),
    so the fork's transposes and SGLang's marlin_permute_scales reproduce it."""
    docs = conform_runs[0]
    doc = docs["int4_shipped"]
    assert doc["exit_code"] == 1 and doc["method"] == INT4 and doc["e_plus_k"] == [2]
    for tensor in COPY_ORDERS["int4"]:
        assert held(doc, 0, tensor) == list(range(E))
        assert held(doc, 1, tensor) == expected_held(list(range(E))) == [2, 3, 4, 5, 4, 5]
    assert "rank 1, expert 0: w13_weight_packed holds expert 2 (E+2)" in doc["first_divergence"][0]
    m = doc["marlin"]
    assert m["judged"] == "weights judged before the Marlin repack, scales after SGLang's permute"
    assert m["repack"]["stand_in"] == "identity" and m["repack"]["calls"] == 2 * E  # rank 0: w13 and w2 per expert
    # [size_k, size_n, num_bits] of w2 then w13: hidden 256, I_tp 128 (jobs.conform_ranks)
    assert m["repack"]["shapes"] == [[128, 256, 4], [256, 256, 4]]
    assert m["permute"]["path"].endswith("sglang/srt/layers/quantization/marlin_utils.py")
    assert "judged: weights judged before the Marlin repack" in "\n".join(result_lines(doc))
    _clean(docs["int4_patched"])
    assert docs["int4_patched"]["patched"] == [INT4]
    wrong = docs["int4_event_sync_without_barrier"]
    assert wrong["exit_code"] == 1 and wrong["e_plus_k"] and wrong["patched"] == [], (wrong["totals"], wrong["error"])
    if REQUIRE:
        assert doc["writer_kind"] == "kt-kernel" and doc["writer"].startswith("kt-kernel 0.7.2 RAWINT4 wrapper")
        assert m["permute"]["from"] == "sglang-kt 0.7.2's own"


def test_signal_words_name_the_isa():
    assert signal_words(-4, "kt-kernel 0.6.4's FP8 writer", {"avx", "avx2"})[1].startswith(
        "kt-kernel 0.6.4's FP8 writer needs AVX-512: illegal instruction")
    assert "needs AMX" in signal_words(-4, "w", {"avx2", "avx512f"})[1]
    assert signal_words(-11, "", set()) == ("crash", "rank 0 died by SIGSEGV (segmentation fault) in the fork's code")


def test_result_lines_name_the_stale_experts(conform_runs):
    doc = conform_runs[0]["shipped"]
    text = "\n".join(result_lines(doc))
    assert "DIVERGENT" in text and "rank 1 w13_weight/w13_weight_scale_inv/w2_weight/w2_weight_scale_inv: " \
                                    "experts 0..5 hold [2, 3, 4, 5, 4, 5]" in text
    assert (doc["schema"], doc["version"], doc["analysis"]["status"]) == ("moetrace.conform", 3, "divergent")
    assert result_lines(doc)[-1].startswith("DIVERGENT: ")  # the verdict is the last line
    assert result_lines(conform_runs[0]["patched"])[-1].startswith("PASS: every rank holds its shard")


# ------------------------------------------------------------ refusals (no processes)


def test_no_fork_or_unsupported_fork_exits_2_naming_what_is_missing(tmp_path):
    r = CliRunner().invoke(main, ["conform", "--fork-path", str(tmp_path / "nowhere")])
    assert r.exit_code == 2 and "no sglang/srt/layers/moe/kt_ep_wrapper.py under it" in r.output
    bad = tmp_path / "bad" / WRAPPER
    bad.parent.mkdir(parents=True)
    bad.write_text("class SharedFullContext:\n    def load(self, layer_idx, wrapper):\n        pass\n")
    r = CliRunner().invoke(main, ["conform", "--fork-path", str(tmp_path / "bad")])
    assert r.exit_code == 2 and len(r.output.splitlines()) == 1
    assert "SharedFullContext has no method __init__" in r.output


def test_a_missing_method_that_load_reaches_is_named(tmp_path):
    """Requirements come from the class: drop a method the installed load calls, and the
    refusal names it and its caller; drop one nothing reaches, and nothing is required."""
    reach = requirements.derive(fork_source.parse_fork(installed_fork()).cls_node).methods
    assert "_restore_raw_attrs" in reach and "_prepare_weight_fp8" in reach

    def drop(name):
        return lambda cls: cls.body.remove(next(f for f in cls.body if getattr(f, "name", "") == name))

    fork = write_variant(tmp_path / "no-restore", drop("_restore_raw_attrs"))
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["conform", "--fork-path", str(fork), "--json-out", str(out)])
    assert r.exit_code == 2 and len(r.output.splitlines()) == 1, r.output
    assert "SharedFullContext.load calls self._restore_raw_attrs(), which the class does not define" in r.output
    doc = json.loads(out.read_text())  # a document for exit 2 too
    assert doc["exit_code"] == 2 and "_restore_raw_attrs" in doc["error"] and doc["fork"]["released"] is None
    unreached = next(m for m in requirements.methods_of(fork_source.parse_fork(installed_fork()).cls_node)
                     if m not in reach and m not in requirements.PROVIDED and not m.startswith("__"))
    fine = write_variant(tmp_path / "no-unreached", drop(unreached))
    tree = fork_source.parse_fork(fork_source.find_fork(str(fine))).cls_node
    assert not requirements.derive(tree).missing


def test_requirements_of_a_release_before_0_7():
    old = old_release()
    if old is None:
        pytest.skip(f"{OLD_RELEASE} not installed")
    req = requirements.derive(fork_source.parse_fork(fork_source.find_fork(str(old))).cls_node)
    assert not req.missing and "initialize_cpu_buffers" not in req.methods and "_create_cpu_buffers" in req.methods
    assert req.dispatch["fp8_block"] == FP8 and "mxfp4" not in req.dispatch


@pytest.mark.parametrize("fmt, method, words", [("mxfp4", "_prepare_weight_mxfp4", "triton_kernels"),
                                                ("mxfp8", "_prepare_weight_mxfp8", "Triton kernel")])
def test_mxfp4_and_mxfp8_are_refused_by_name_with_a_document(tmp_path, fmt, method, words):
    out = tmp_path / f"{fmt}.json"
    r = CliRunner().invoke(main, ["conform", "--format", fmt, "--json-out", str(out)])
    installed_fork()
    assert r.exit_code == 2 and method in r.output and words in r.output and len(r.output.splitlines()) == 1
    doc = json.loads(out.read_text())
    assert (doc["exit_code"], doc["status"], doc["method"]) == (2, "refused", method)


def test_json_out_is_checked_before_the_run(tmp_path):
    r = CliRunner().invoke(main, ["conform", "--json-out", str(tmp_path)])
    assert r.exit_code == 2 and "--json-out" in r.output and "directory" in r.output and len(r.output.splitlines()) == 1


def test_patch_fence_refuses_a_method_without_the_reader_wait(tmp_path):
    fixed = hand_fenced(tmp_path, "hand")  # a fence written in: still has the wait, so patchable again
    cls = fork_source.parse_fork(fork_source.find_fork(str(fixed))).cls_node

    def no_wait(cls):  # every `<events>[<i> - 1].synchronize()` statement of the method becomes `pass`
        fn = next(f for f in cls.body if getattr(f, "name", "") == FP8)
        for node in ast.walk(fn):
            for field in ("body", "orelse"):
                stmts = getattr(node, field, None)
                if isinstance(stmts, list):
                    setattr(node, field, [ast.Pass() if isinstance(s, ast.Expr) and fence.reader_wait(s) else s
                                          for s in stmts])

    assert fence.patch_fence(cls, [FP8]) == [FP8]
    bare = write_variant(tmp_path / "bare", no_wait)
    r = CliRunner().invoke(main, ["conform", "--fork-path", str(bare), "--patch-fence"])
    assert r.exit_code == 2 and f"--patch-fence: {FP8}: its staging loop has no reader wait" in r.output, r.output


def test_patch_fence_derives_the_fence_from_the_ast():
    """The fence goes before the loop statement that refills a slot, in the loop's own
    names, and before the first write; the cached tree stays the file's."""
    parsed = fork_source.parse_fork(installed_fork())
    req = requirements.derive(parsed.cls_node)
    for fmt in ("fp8_block", "fp8_channel", "bf16", "int4"):
        method = req.dispatch[fmt]
        cls = ast.parse(ast.unparse(parsed.cls_node)).body[0]
        fn = next(f for f in cls.body if getattr(f, "name", "") == method)
        loop, at, first = fence.staging_loop(fn)
        before = len(loop.node.body)
        fence.patch_fence(cls, [method])
        assert len(loop.node.body) == before + 1
        events, i = fence.reader_wait(loop.node)
        inserted = ast.unparse(next(s for s in loop.node.body if "barrier" in ast.unparse(s)
                                    and isinstance(s, ast.If) and f"{i} > 0" in ast.unparse(s.test)))
        assert f"{events}[{i} - 1].synchronize()" in inserted and "dist.barrier(" in inserted, fmt
        assert ast.unparse(fn.body[first]) == "torch.cuda.synchronize()", fmt
    assert "__moetrace" not in ast.unparse(parsed.cls_node) and ast.unparse(parsed.cls_node).count("dist.barrier(") \
        < ast.unparse(cls).count("dist.barrier(")


# ----------------------------------------------------------------- releases (no network)


def test_release_selection_and_matching_kernels():
    have = ["0.5.2", "0.6.1", "0.6.4", "0.7.0", "0.7.0.post2", "0.7.2"]
    assert releases.select("all", have) == have
    assert releases.select("0.6.1..0.7.0", have) == ["0.6.1", "0.6.4", "0.7.0"]
    assert releases.select("..0.6.1", have) == ["0.5.2", "0.6.1"]
    assert releases.select("0.7.2,0.5.2", have) == ["0.5.2", "0.7.2"]
    from moetrace.errors import MoetraceError

    with pytest.raises(MoetraceError, match="no sglang-kt release matches"):
        releases.select("0.8..0.9", have)
    with pytest.raises(MoetraceError, match="expected all, A..B or A,B"):
        releases.select("latest", have)
    kernels = ["0.5.2", "0.6.1.post1", "0.7.0.post1", "0.7.2"]
    assert releases.kernel_for("0.7.2", ["kt-kernel==0.7.2"], kernels) == ("0.7.2", "")
    assert releases.kernel_for("0.5.2", ["tiktoken"], kernels) == ("0.5.2", "")
    assert releases.kernel_for("0.6.2", [], kernels)[0] == "0.6.1.post1"
    got, note = releases.kernel_for("0.7.0.post2", ["kt-kernel==0.7.0.post2"], kernels)
    assert got == "0.7.0.post1" and "its pin kt-kernel==0.7.0.post2 is not on the index" in note


def test_a_release_that_cannot_be_installed_is_a_row():
    from moetrace.jobs.conform_releases import run_release, table

    why = "pip install --target sglang-kt==0.7.0.post3 kt-kernel==0.7.0.post2: ERROR: No matching distribution"
    rows = run_release("0.7.0.post3", releases.Release("0.7.0.post3", None, "0.7.0.post2", why), ("fp8_block",),
                       2, E, "slow-peer", "kt-kernel")
    assert [(r["release"], r["verdict"], r["exit_code"], r["why"]) for r in rows] == \
        [("0.7.0.post3", "NOT INSTALLED", 2, why)]
    lines = table(rows)
    assert lines[0].split() == ["release", "kt-kernel", "format", "fence", "verdict", "E+k", "seconds"]
    assert lines[-1] == f"why 0.7.0.post3 -: {why}"


def test_kt_kernel_writers_of_different_methods_get_their_own_processes():
    from moetrace.jobs.conform_plan import Plan
    from moetrace.jobs.conform_ranks import group_of as _group

    def plan(fmt, writer):
        return Plan(Case(fmt, "slow-peer", False, writer, E), {})

    kt = {_group(plan(f, "kt-kernel")) for f in ("fp8_block", "fp8_channel", "bf16")}
    ours = {_group(plan(f, "moetrace")) for f in ("fp8_block", "fp8_channel", "bf16")}
    assert len(kt) == 3 and len(ours) == 1 and not kt & ours
    assert _group(plan("fp8_block", "kt-kernel")) == _group(Plan(Case("fp8_block", "slow-peer", True), {}))


def test_releases_refuse_the_single_run_options():
    r = CliRunner().invoke(main, ["conform", "--releases", "all", "--fork-path", "x"])
    assert r.exit_code == 2 and "--fork-path does not go with --releases" in r.output and len(r.output.splitlines()) == 1


# ---------------------------------------------------------- the simulated runtime


def test_streams_are_fifo_and_events_mark_them():
    rt = sim_cuda.SimRuntime(0, timeout_s=10)
    cuda = rt.cuda_module()
    gate = {"open": False}

    class Until(sim_cuda.Hold):
        label = "test hold"

        def releasable(self, demanded):
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


def test_a_held_copy_runs_when_its_issuer_waits_for_it():
    """The slow peer's latest point: a copy held until demanded runs once the issuing
    thread waits for it, also through another stream's wait on its event."""
    rt = sim_cuda.SimRuntime(0, timeout_s=10)
    cuda = rt.cuda_module()

    class UntilDemanded(sim_cuda.Hold):
        label = "test hold"

        def releasable(self, demanded):
            return demanded

    src, dst = torch.arange(4.0), torch.zeros(2, 4)
    copy_stream, post_stream = cuda.Stream(), cuda.Stream()
    rt.copy_hook = lambda d, x: UntilDemanded()
    copied, after = cuda.Event(), cuda.Event()
    with cuda.stream(copy_stream):
        dst[0].copy_(src, non_blocking=True)
        copied.record(copy_stream)
    post_stream.wait_event(copied)
    after.record(post_stream)
    assert not copied.query() and not after.query() and dst[0].sum() == 0  # nobody waits: held
    after.synchronize()  # waits for post_stream, which waits for the copy
    assert copied.query() and dst[0].tolist() == src.tolist()
    rt.close()


def test_a_stream_ordered_kernel_and_a_blocking_copy_wait_for_their_stream():
    """INT4's post-processing on the post stream: the transposes are queued copies, the
    Marlin calls and the blocking copies after them must see them done (stream order)."""
    rt = sim_cuda.SimRuntime(0, timeout_s=10)
    cuda = rt.cuda_module()
    gate = {"open": False}

    class Until(sim_cuda.Hold):
        label = "test hold"

        def releasable(self, demanded):
            return gate["open"] or demanded

    src, dst, out = torch.arange(4.0), torch.zeros(4), torch.zeros(4)
    rt.copy_hook = lambda d, x: Until()
    seen = []
    kernel = rt.stream_ordered(lambda t: seen.append(t.tolist()) or t * 2)
    s = cuda.Stream()
    with cuda.stream(s):
        dst.copy_(src, non_blocking=True)  # held until the kernel demands it
        doubled = kernel(dst)
        out.copy_(doubled)  # blocking: at once, after the kernel
    assert seen == [src.tolist()] and out.tolist() == (src * 2).tolist()
    outside = rt.stream_ordered(lambda: "ran")  # on the default stream: at once
    assert outside() == "ran"
    rt.close()


def test_repack_identity_returns_its_input_and_refuses_what_it_cannot_stand_for():
    from moetrace.conform.marlin import RepackIdentity

    rep = RepackIdentity()
    words = torch.arange(32 * 256, dtype=torch.int32).view(32, 256)
    got = rep(words, torch.empty(0, dtype=torch.int32), 256, 256, 4)
    assert torch.equal(got, words) and got.data_ptr() != words.data_ptr()
    assert rep.summary() == {"calls": 1, "shapes": [[256, 256, 4]]}
    for args in ((128, 256, 4), (256, 256, 8)):
        with pytest.raises(fork_source.ForkError, match="gptq_marlin_repack called with words"):
            rep(words, torch.empty(0, dtype=torch.int32), *args)
    with pytest.raises(fork_source.ForkError, match="perm of 3"):
        rep(words, torch.zeros(3, dtype=torch.int32), 256, 256, 4)


def test_marlin_permute_scales_compiled_from_the_fork_or_upstream(tmp_path):
    """conform runs the fork's own marlin_utils.marlin_permute_scales (compiled from its file),
    else the installed sglang's; both equal moetrace's own definition of the permutation."""
    from moetrace.checkpoints.transforms import marlin_permute_scales
    from moetrace.conform import marlin

    src = installed_fork()
    own = marlin.permute_source(src.path, src.version)
    assert own.origin == f"sglang-kt {src.version}'s own" and own.path.name == "marlin_utils.py"
    bare = tmp_path / WRAPPER
    bare.parent.mkdir(parents=True)
    shutil.copyfile(src.path, bare)
    up = marlin.permute_source(bare, "x")
    assert up.path != own.path and up.origin.startswith("sglang ") and "ships no" in up.origin
    s13, s2 = torch.randn(2, 8, 256).to(torch.bfloat16), torch.randn(2, 1, 256).to(torch.bfloat16)
    want = marlin_permute_scales({"w13_weight_scale": s13, "w2_weight_scale": s2})
    for source in (own, up):
        f = marlin.compile_permute(source)
        assert torch.equal(torch.stack([f(e, 256, 256, 32).view(e.shape) for e in s13]), want["w13_weight_scale"])
        assert torch.equal(torch.stack([f(e, 32, 256, 32).view(e.shape) for e in s2]), want["w2_weight_scale"])


def test_a_rank_stopped_after_a_peer_failed_is_not_named_as_the_cause(tmp_path):
    """sglang-kt 0.6.3's INT4 path fails on its first Marlin call on every rank; a rank the
    command stops before it wrote its result was reported as a stall and named first."""
    from moetrace.jobs.conform_ranks import _rank_error, unfinished

    crashed = {"rank": 1, "error": "TypeError: 'module' object is not callable", "error_kind": "crash"}
    kind, line = _rank_error([unfinished(0, [1], 360), crashed], tmp_path, True)
    assert kind == "crash" and "rank 1: TypeError: 'module' object is not callable" in line
    assert unfinished(0, [], 360)["error_kind"] == "timeout"


def test_from_jit_kernel_import_binds_what_the_forks_package_says(tmp_path):
    """`from sglang.jit_kernel import gptq_marlin_repack` (sglang-kt 0.6.3) binds the name its
    package's __init__.py defines, else the submodule, which the fork's INT4 path then calls."""
    from moetrace.conform.marlin import jit_package_binding

    wrapper = tmp_path / WRAPPER
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text("")
    init = tmp_path / "sglang" / "jit_kernel" / "__init__.py"
    with pytest.raises(fork_source.ForkError, match="no sglang/jit_kernel/__init__.py beside the wrapper"):
        jit_package_binding(wrapper, print)(1)
    init.parent.mkdir(parents=True)
    init.write_text("")
    module = jit_package_binding(wrapper, print)
    assert module.gptq_marlin_repack is print and not callable(module)
    init.write_text("from .gptq_marlin_repack import gptq_marlin_repack\n")
    assert jit_package_binding(wrapper, print) is print
