"""moetrace selftest: passes on CPU, and fails loudly when any proof is broken."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moetrace import fingerprint as F
from moetrace.analysis import analyze
from moetrace.cli import main
from moetrace.jobs import pair as demo
from moetrace.jobs import selftest as st

ROOT = Path(__file__).resolve().parents[1]


def test_selftest_cpu_quick_passes(gpu_script_dry_run):
    """`moetrace selftest --device cpu --quick --json --only fingerprint --only throughput`, as the
    GPU script's dry run runs it (the detector: test_selftest_detector_on_the_demo_pair)."""
    out = Path(gpu_script_dry_run["out"])
    doc = json.loads((out / "selftest.out").read_text())
    assert doc["exit_code"] == 0 and doc["device"] == "cpu", (out / "selftest.err").read_text()
    proofs = {p["name"]: p for p in doc["proofs"]}
    assert set(proofs) == {"fingerprint", "throughput"}
    assert proofs["fingerprint"]["ok"] and proofs["fingerprint"]["data"]["cases"] > 40
    data = proofs["throughput"]["data"]
    for key in ("fingerprint_vs_copy", "fingerprint_vs_sha256_host", "capture_vs_load_copies"):
        assert data[key] > 0
    # a measurement is reported, never judged: it cannot pass, so it is not called a proof
    assert proofs["throughput"]["kind"] == "measurement" and proofs["fingerprint"]["kind"] == "proof"
    assert doc["verdict"] == "selftest PASSED on cpu: every proof holds (throughput: measured, not judged)"


def test_selftest_prints_each_part_as_it_ends_and_the_verdict_last(monkeypatch):
    """Each part's line is printed when that part ends, before the next one starts (no
    silence until the end); the measurement is [INFO], not [PASS]; the verdict comes last."""
    events = []

    def part(name, kind="proof"):
        def run(*args, **kw):
            events.append(f"start {name}")
            return st.Proof(name, True, f"{name} done", 0.1, kind=kind)
        return run

    monkeypatch.setattr(st, "prove_fingerprint", part("fingerprint"))
    monkeypatch.setattr(st, "measure_throughput", part("throughput", "measurement"))
    import click

    echo = click.echo

    def recording_echo(message=None, *args, **kw):
        events.append(f"print {message}")
        return echo(message, *args, **kw)

    monkeypatch.setattr(click, "echo", recording_echo)
    r = CliRunner().invoke(main, ["selftest", "--only", "fingerprint", "--only", "throughput"])
    assert r.exit_code == 0, r.output
    assert events == ["start fingerprint", "print [PASS] fingerprint  fingerprint done (0.1 s)",
                      "start throughput", "print [INFO] throughput   throughput done (0.1 s)",
                      "print selftest PASSED on cpu: every proof holds (throughput: measured, not judged)"]
    assert r.output.splitlines()[-1].startswith("selftest PASSED")


def test_selftest_detector_on_the_demo_pair(demo_run, monkeypatch, tmp_path):
    """The selftest's detector proof, through run_selftest and the CLI's JSON, judging the
    session's demo pair (the same quick emulated pair on CPU that the proof would run: its
    run_pair is handed that pair instead of running it a second time)."""
    from moetrace.jobs.pair import QUICK, guard_records

    work, summary = demo_run.workdir, demo_run.summary
    unf, fen = _demo_reports(demo_run)
    calls = []

    def demo_pair(workdir, size, device="cpu", **kw):
        calls.append((Path(workdir), size, device, kw))
        runs = {run_id: {"report": rep, "guard": guard_records(work / "traces", run_id)}
                for run_id, rep in (("unfenced", unf), ("fenced", fen))}
        return {"runs": runs, "transport": summary["transport"], "staged_by": summary["staged_by"]}

    monkeypatch.setattr(demo, "run_pair", demo_pair)
    code, proofs = st.run_selftest("cpu", quick=True, workdir=str(tmp_path), only=("detector",))
    assert [c[:3] for c in calls] == [(tmp_path / "detector", QUICK, "cpu")]  # what the proof asks for: the quick pair on CPU
    assert set(calls[0][3]) <= {"progress"}
    doc = st.as_json(code, proofs, "cpu")
    assert doc["exit_code"] == 0 and doc["verdict"] == "selftest PASSED on cpu: every proof holds", doc
    (proof,) = doc["proofs"]
    assert proof["name"] == "detector" and proof["ok"] and "(E+2)" in proof["detail"], proof
    assert "in-server guard agrees" in proof["detail"]
    assert proof["data"]["unfenced_exit"] == 1 and proof["data"]["fenced_exit"] == 0
    if os.environ.get("MOETRACE_REQUIRE_FORK") == "1":  # make test: the pair ran the fork's own staging code
        assert proof["data"]["transport"] == "fork" and "sglang-kt 0.7.2" in proof["detail"]
    def unfenced_twice(*args, **kw):  # the fenced run replaced by the unfenced one: the proof must fail
        runs = demo_pair(*args, **kw)["runs"]
        return {**demo_pair(*args, **kw), "runs": {"unfenced": runs["unfenced"], "fenced": runs["unfenced"]}}

    monkeypatch.setattr(demo, "run_pair", unfenced_twice)
    code, proofs = st.run_selftest("cpu", quick=True, workdir=str(tmp_path), only=("detector",))
    assert code == 1 and proofs[0].ok is False and "fenced run is not a clean" in proofs[0].detail


def test_broken_device_fingerprint_fails_the_proof():
    def zero_digest(t):  # a device path that loses the digest but keeps the chunk digests
        good = F.fingerprint(t, "torch")
        return F.Fingerprint(bytes(16), good.chunk_digests, good.nbytes)

    proof = st.prove_fingerprint("cpu", quick=True, on_device=zero_digest)
    assert proof.ok is False and "!= CPU" in proof.detail
    assert st.prove_fingerprint("cpu", quick=True).ok is True  # the real path, for contrast


def _demo_reports(demo_run):
    work = demo_run.workdir
    return [analyze([str(work / "traces" / run)], index=str(work / "index.parquet")) for run in ("unfenced", "fenced")]


def test_detector_verdict_on_the_demo_pair(demo_run):
    res = demo.judge_detector(*_demo_reports(demo_run))
    assert res["ok"] and "(E+2)" in res["detail"], res


def test_missing_fence_fails_the_detector(demo_run):
    """The negative control: the fenced side run without its fence is, on this deterministic
    schedule, the unfenced run. (A run without the slow-peer injection is no control at all:
    on two cores the race shows with no injected delay too.)"""
    unf, _ = _demo_reports(demo_run)
    res = demo.judge_detector(unf, unf)
    assert not res["ok"] and "fenced run is not a clean" in res["detail"]


def test_broken_verdict_path_fails_the_detector(demo_run, monkeypatch):
    from moetrace.analysis import verdicts

    real = verdicts.relation_score

    def blind_to_experts(*args):
        code, score = real(*args)
        return np.full_like(code, verdicts.WRONG_TENSOR), score  # every content match called "wrong tensor"

    monkeypatch.setattr(verdicts, "relation_score", blind_to_experts)
    res = demo.judge_detector(*_demo_reports(demo_run))
    assert not res["ok"] and "not caught as E+2" in res["detail"]


def test_cuda_unavailable_is_exit_2_with_reason():
    r = CliRunner().invoke(main, ["selftest", "--device", "cuda", "--only", "fingerprint"])
    if r.exit_code == 0:
        pytest.skip("a CUDA device is present")
    assert r.exit_code == 2 and "no CUDA device" in r.output and "could not run" in r.output


def test_gpu_script_dry_run(gpu_script_dry_run):
    # Every step of the one-command GPU run runs on CPU and the summary table is printed.
    run, out = gpu_script_dry_run, Path(gpu_script_dry_run["out"])
    assert run["returncode"] == 0, run["stdout"] + run["stderr"]
    steps = (out / "steps.txt").read_text().split("\n")
    assert all(" rc=0 " in line for line in steps if line), steps
    assert "| selftest | exit 0" in run["stdout"] and "fingerprint_1thread_vs_xxh3_128" in run["stdout"]
    assert "| index on cpu (4 experts, TP2, 64 rows) | rows equal the CPU index: n/a (CPU run) |" in run["stdout"]
    assert "--only fingerprint --only throughput --json" in run["stdout"]  # SELFTEST_ONLY reached the command


def test_detector_checks_the_guard_against_the_analysis(demo_run):
    """The detector proof also judges the in-server guard: on the demo pair it agrees with
    the analysis; with the runs' guard records swapped (a guard blind to the race) it fails."""
    unf, fen = _demo_reports(demo_run)
    guards = demo_run.summary["runs"]["unfenced"]["guard"], demo_run.summary["runs"]["fenced"]["guard"]
    res = demo.judge_detector(unf, fen, guards)
    assert res["ok"] and "in-server guard agrees" in res["detail"], res
    res = demo.judge_detector(unf, fen, guards[::-1])
    assert not res["ok"] and "the guard counted 0 mismatching tensors" in res["detail"]
    assert "the guard on fenced rank 1 is not clean" in res["detail"]
