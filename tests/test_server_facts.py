"""The trace says what the server was configured to do, and the audit holds the traffic to
it: the checkpoint the server loaded is read in the server (never the reference's), a
server that stages must have staged, and `audit --launch` holds the reference to the
command's model and TP size, and its prompts to the command's staging threshold, before
anything starts."""

from __future__ import annotations

import json
import sys

import pytest
from support.cli import cli, one_line_error

from moetrace.checkpoints.reader import open_checkpoint
from moetrace.emulator import run_emulation
from moetrace.hooks import sglang_hook
from moetrace.hooks.spec import hook_spec
from moetrace.jobs.staging import command_staging, never_stages, prompt_words
from moetrace.servers.command import model_path_of_command
from moetrace.tracer.manifest import read_manifests

SERVE = [sys.executable, "-m", "moetrace.cli", "serve"]


@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    return make_ckpt(seed=1), make_ckpt(seed=2)


@pytest.fixture(scope="module")
def served_b(ckpts, tmp_path_factory):
    """An emulated TP2 server of checkpoint B whose hook config claims checkpoint A and
    verifies online against A's index; passes of at most 32 tokens, threshold 64: it never
    stages."""
    a, b = ckpts
    out = tmp_path_factory.mktemp("served")
    index_a = str(out / "a.parquet")
    assert cli("index", a, "--tp", "2", "-o", index_a).exit_code == 0
    spec = hook_spec({"out": str(out), "run_id": "b", "flush_interval_s": 0.05, "index": index_a,
                      "checkpoint_id": open_checkpoint(a).identity})
    try:
        run_emulation(b, ["a prompt of more than thirty-two bytes, chunked at 32", "short"], tp=2, fence="all",
                      slow_rank=-1, prefill_threshold=64, chunk_tokens=32, forward_hooks=spec)
    finally:
        sglang_hook.close_all(timeout=10)
    return out, index_a


def test_the_manifest_records_the_checkpoint_the_server_loaded(ckpts, served_b):
    a, b = ckpts
    out, index_a = served_b
    manifests = read_manifests(str(out), "b")
    assert sorted(manifests) == ["0", "1"]
    for m in manifests.values():  # read in the server from its model path: B, whatever config and index say
        assert m["checkpoint_id"] == open_checkpoint(b).identity and m["checkpoint_path"] == str(b)
        assert any("the hook config says checkpoint" in n for n in m["notes"])
    run = json.loads((out / "b" / "_run.json").read_text()) if (out / "b" / "_run.json").exists() else None
    assert run is None  # not launched: the rank manifests alone say it
    # so the analysis refuses the reference of the other checkpoint (exit 2), never blames the server (exit 1)
    one_line_error(cli("audit", out / "b", "--index", index_a), "traced checkpoint", open_checkpoint(b).identity)
    one_line_error(cli("audit", out / "b", "--checkpoint", a), f"--checkpoint {a}", "was captured from checkpoint")


def test_a_server_that_stages_but_never_staged_is_incomplete(ckpts, served_b):
    a, b = ckpts
    out, _ = served_b
    for m in read_manifests(str(out), "b").values():
        assert m["staging"] == {"threshold": 64, "chunked_prefill_size": 32,
                                "found_by": "KTEPWrapperMethod.gpu_prefill_token_threshold"}
    r = cli("audit", out / "b", "--checkpoint", b, "--json-out", out / "b.json")
    assert r.exit_code == 2, r.output
    doc = json.loads((out / "b.json").read_text())
    assert doc["totals"]["divergent"] == 0 and doc["totals"]["by_verdict"]["match"] > 0  # all resident rows match
    (why,) = [p for p in doc["incomplete"] if "stages" in p]
    assert "at least 64 tokens" in why and "holds no staged load" in why and "at most 32 tokens" in why


def test_audit_launch_refuses_a_reference_of_another_checkpoint_or_tp_before_the_launch(ckpts, tmp_path):
    a, b = ckpts
    index_a2 = tmp_path / "a2.parquet"
    assert cli("index", a, "--tp", "2", "-o", index_a2).exit_code == 0
    out = tmp_path / "traces"
    server = " ".join([*SERVE, "{}", "--tp", "{}", "--port", "31999"])
    cases = [
        (["--checkpoint", a], server.format(b, 2), [f"--checkpoint {a} is checkpoint", f"loads {b}"]),
        (["--index", index_a2], server.format(b, 2), ["--index", "does not fit", str(b)]),
        (["--index", index_a2], server.format(a, 1), ["--index", "built for --tp 2, the server runs TP 1"]),
        (["--index", index_a2], " ".join([*SERVE, "--model-path", str(a), "--tp=1", "--port", "31999"]),
         ["built for --tp 2"]),
    ]
    for ref, cmd, words in cases:
        one_line_error(cli("audit", "--launch", cmd, *ref, "--out", out, "--junit", tmp_path / "j.xml"),
                       *words, "nothing was launched")
        assert not out.exists()  # nothing started, no run folder
        assert "<error" in (tmp_path / "j.xml").read_text()


def test_audit_launch_refuses_a_command_whose_passes_never_reach_its_threshold(ckpts, tmp_path, monkeypatch):
    import moetrace.jobs.audit as audit
    from moetrace.errors import MoetraceError

    a, _ = ckpts
    cmd = " ".join([*SERVE, str(a), "--tp", "2", "--fence", "none", "--kt-gpu-prefill-token-threshold", "4096",
                    "--port", "31998"])
    one_line_error(cli("audit", "--launch", cmd, "--checkpoint", a, "--prompt-tokens", "200", "--out",
                       tmp_path / "t"), "at least 4096 tokens", "at most 32", "--prompt-tokens 200", "nothing was launched")
    assert not (tmp_path / "t").exists()
    assert never_stages(command_staging(cmd.split())) is not None
    # staged captures sampled out on purpose (resident only): nothing to refuse
    monkeypatch.setattr(audit, "launch_and_drive", lambda *a, **k: (_ for _ in ()).throw(MoetraceError("launched")))
    hc = tmp_path / "hc.json"
    hc.write_text('{"sources": "resident"}')
    one_line_error(cli("audit", "--launch", cmd, "--checkpoint", a, "--hook-config", hc, "--out", tmp_path / "t"),
                   "launched")


def test_audit_launch_sizes_its_prompts_from_the_threshold(ckpts, tmp_path, monkeypatch):
    import moetrace.jobs.audit as audit
    from moetrace.errors import MoetraceError

    a, _ = ckpts
    sent = []

    def launch_and_drive(cmd, config, traffic, *args, **kw):
        sent.append(traffic)
        raise MoetraceError("launched")

    monkeypatch.setattr(audit, "launch_and_drive", launch_and_drive)
    staging = " ".join([*SERVE, str(a), "--tp", "2", "--kt-gpu-prefill-token-threshold", "4096",
                        "--chunked-prefill-size", "8192", "--port", "31997"])
    sglang = f"python -m sglang.launch_server --model-path {a} --tp 2 --port 31997"
    for cmd, extra, want, source in [
        (staging, [], 4096 + 512, "the staging threshold"),
        (staging, ["--prompt-tokens", "100"], 100, "--prompt-tokens"),
        (" ".join([*SERVE, str(a), "--tp", "2", "--port", "31997"]), [], 8 + 16, "the staging threshold"),
        (sglang, [], 2048, "the default"),
        (sglang + " --kt-weight-path /w --kt-gpu-prefill-token-threshold 10000", [], 10000 + 1250,
         "the staging threshold"),
    ]:
        one_line_error(cli("audit", "--launch", cmd, "--checkpoint", a, "--out", tmp_path / "t", *extra), "launched")
        assert (sent[-1].prompt_tokens, sent[-1].prompt_tokens_from) == (want, source), cmd
    assert prompt_words(None) == (2048, "the default")


def test_the_model_a_command_loads():
    assert model_path_of_command(["moetrace", "serve", "/m", "--tp", "2"]) == "/m"
    assert model_path_of_command(["python", "-m", "moetrace.cli", "serve", "--tp", "2", "--disable-cuda-graph",
                                  "/m"]) == "/m"
    assert model_path_of_command(["python", "-m", "sglang.launch_server", "--model-path=/m"]) == "/m"
    assert model_path_of_command(["vllm", "serve", "--port", "8000", "Qwen/Qwen3"]) == "Qwen/Qwen3"
    assert model_path_of_command(["touch", "x"]) is None
    assert command_staging(["python", "-m", "sglang.launch_server", "--model-path", "/m"]) is None
    assert command_staging(["sglang", "--kt-gpu-prefill-token-threshold", "0"]) is None
    assert command_staging(["x", "moetrace", "serve", "/m"]) == {
        "threshold": 8, "chunked_prefill_size": 32, "found_by": "the command's flags and moetrace serve's defaults"}
