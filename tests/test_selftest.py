"""moetrace selftest: passes on CPU, and fails loudly when any proof is broken."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moetrace import fingerprint as F
from moetrace.analysis import analyze
from moetrace.cli import main
from moetrace.jobs import demo
from moetrace.jobs import selftest as st

ROOT = Path(__file__).resolve().parents[1]


def test_selftest_cpu_quick_passes(gpu_script_dry_run):
    out = Path(gpu_script_dry_run["out"])
    doc = json.loads((out / "selftest.out").read_text())
    assert doc["exit_code"] == 0 and doc["device"] == "cpu", (out / "selftest.err").read_text()
    proofs = {p["name"]: p for p in doc["proofs"]}
    assert set(proofs) == {"fingerprint", "detector", "throughput"}
    assert proofs["fingerprint"]["ok"] and proofs["fingerprint"]["data"]["cases"] > 40
    assert proofs["detector"]["ok"] and "(E+2)" in proofs["detector"]["detail"]
    assert proofs["detector"]["data"]["unfenced_exit"] == 1 and proofs["detector"]["data"]["fenced_exit"] == 0
    if os.environ.get("MOETRACE_REQUIRE_FORK") == "1":  # make test: the proof ran the fork's own staging code
        assert proofs["detector"]["data"]["transport"] == "fork" and "sglang-kt 0.7.2" in proofs["detector"]["detail"]
    data = proofs["throughput"]["data"]
    for key in ("fingerprint_vs_copy", "fingerprint_vs_sha256_host", "capture_vs_load_copies"):
        assert data[key] > 0


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
    assert "| selftest | exit 0" in run["stdout"] and "fingerprint_all_cores" in run["stdout"]


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
