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

from moetrace.jobs import selftest as st
from moetrace.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_selftest_cpu_quick_passes_via_cli(tmp_path):
    # What CI runs: the whole selftest on this machine.
    proc = subprocess.run([sys.executable, "-m", "moetrace.cli", "selftest", "--device", "cpu", "--quick", "--json",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == 0 and doc["device"] == "cpu"
    proofs = {p["name"]: p for p in doc["proofs"]}
    assert set(proofs) == {"fingerprint", "detector", "throughput"}
    assert proofs["fingerprint"]["ok"] and proofs["fingerprint"]["data"]["cases"] > 40
    assert proofs["detector"]["ok"] and "(E+2)" in proofs["detector"]["detail"]
    assert proofs["detector"]["data"]["unfenced_exit"] == 1 and proofs["detector"]["data"]["fenced_exit"] == 0
    data = proofs["throughput"]["data"]
    for key in ("fingerprint_vs_copy", "fingerprint_vs_sha256_host", "capture_vs_load_copies"):
        assert data[key] > 0


def _only(monkeypatch, name, key, tmp_path):
    monkeypatch.setitem(st._SABOTAGE, key, True)
    code, proofs = st.run_selftest("cpu", quick=True, workdir=str(tmp_path), only=(name,))
    return code, proofs[0]


def test_broken_device_fingerprint_fails_the_proof(monkeypatch, tmp_path):
    code, proof = _only(monkeypatch, "fingerprint", "fingerprint", tmp_path)
    assert code == 1 and proof.ok is False and "!= CPU" in proof.detail


def test_disabled_slow_peer_injection_fails_the_detector(monkeypatch, tmp_path):
    code, proof = _only(monkeypatch, "detector", "injection", tmp_path)
    assert code == 1 and proof.ok is False
    assert "unfenced run not caught" in proof.detail


def test_missing_fence_fails_the_detector(monkeypatch, tmp_path):
    code, proof = _only(monkeypatch, "detector", "fence", tmp_path)
    assert code == 1 and proof.ok is False and "fenced run is not a clean" in proof.detail


def test_broken_verdict_path_fails_the_detector(monkeypatch, tmp_path):
    from moetrace.analysis import verdicts

    real = verdicts.relation_score

    def blind_to_experts(*args):
        code, score = real(*args)
        return np.full_like(code, verdicts.WRONG_TENSOR), score  # every content match called "wrong tensor"

    monkeypatch.setattr(verdicts, "relation_score", blind_to_experts)
    code, proofs = st.run_selftest("cpu", quick=True, workdir=str(tmp_path), only=("detector",))
    assert code == 1 and proofs[0].ok is False and "not caught as E+2" in proofs[0].detail


def test_cuda_unavailable_is_exit_2_with_reason():
    r = CliRunner().invoke(main, ["selftest", "--device", "cuda", "--only", "fingerprint"])
    if r.exit_code == 0:
        pytest.skip("a CUDA device is present")
    assert r.exit_code == 2 and "no CUDA device" in r.output and "could not run" in r.output


def test_gpu_script_dry_run(tmp_path):
    # The one-command GPU run, on CPU: every step runs and the table is printed.
    env = dict(os.environ, DRY_RUN="1", QUICK="1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_selftest.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = (tmp_path / "steps.txt").read_text().split("\n")
    assert all(" rc=0 " in line for line in steps if line), steps
    assert "| selftest | exit 0" in proc.stdout and "fingerprint_all_cores" in proc.stdout
    assert json.loads((tmp_path / "selftest.out").read_text())["exit_code"] == 0
