"""End to end on CPU: emulated TP2 KT server + moetrace hooks + analysis.

The unfenced transport must be caught with the E+2 verdict on every run; the
fenced one must pass with full coverage; `audit --launch` exit codes; no
processes or shared-memory segments left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import cli, one_line_error

from moetrace.analysis import analyze
from moetrace.jobs import demo

CLI = [sys.executable, "-m", "moetrace.cli"]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _leaked(before: set[str]) -> list[str]:
    """Emulator segments (mtemu<pid>x...) created since `before` whose creator is gone:
    left behind. Segments of live processes (other runs on this machine) are not ours to judge."""
    out = []
    for name in sorted(_shm() - before):
        m = re.match(r"mtemu(\d+)x", name)
        if m and not _children_alive([int(m.group(1))]):
            out.append(name)
    return out


def _children_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_demo_unfenced_caught_fenced_clean(demo_run):
    """The demo's pair (one injected schedule, `moetrace demo --quick --json`), re-analyzed:
    the unfenced transport is caught as E+2 and the fenced one passes with full coverage."""
    assert demo_run.returncode == 0, demo_run.stderr
    work = demo_run.workdir
    rep = analyze([str(work / "traces" / "unfenced")], index=str(work / "index.parquet"))
    assert rep.exit_code == 1
    first = rep.doc["first_divergence"][0]
    assert first["ranks"] == ["1"] and first["layer"] == 0 and first["step"] == 0
    e = first["entries"][0]
    assert (e["verdict"], e["k"], e["tensor"], e["tp_rank"]) == ("stale", 2, "w2_weight_scale_inv", 1)
    assert e["found"]["expert"] == e["expert"] + 2
    # every staged load on rank 1: all experts but the last two hold E+2 in w2 scales
    n = demo.QUICK.experts
    staged = [s for s in rep.doc["summaries"] if s["source"] == "staged"]
    assert staged and all(s["tp_rank"] == 1 and s["tensor"] == "w2_weight_scale_inv" for s in staged)
    assert all(s["sentence"].endswith(f"{n - 2}/{n} w2_weight_scale_inv are E+2") for s in staged)
    assert rep.doc["totals"]["by_verdict"]["stale"] == rep.doc["totals"]["divergent"] > 0
    # fenced: every expected tensor captured and matching, the reference reproduced exactly
    frep = analyze([str(work / "traces" / "fenced")], index=str(work / "index.parquet"))
    assert frep.exit_code == 0
    t = frep.doc["totals"]
    assert t["missing"] == 0 and t["divergent"] == 0 and t["match"] == t["tensors"] > 0
    unf, fen = demo_run.summary["runs"]["unfenced"], demo_run.summary["runs"]["fenced"]
    assert unf["token0_max_abs_logit_delta_vs_reference"] > 0
    assert fen["token0_max_abs_logit_delta_vs_reference"] == 0 and fen["tokens_equal_reference"]
    assert _leaked(demo_run.shm_before) == []  # the demo's ranks are gone and left no segments


def test_demo_command_json(demo_run):
    assert demo_run.returncode == 0, demo_run.stderr
    s = demo_run.summary
    assert s["race_found"] and s["fix_validated"]
    if os.environ.get("MOETRACE_REQUIRE_FORK") == "1":  # make test: the staged loads were the fork's own code
        assert s["transport"] == "fork" and s["staged_by"].startswith("sglang-kt 0.7.2's own SharedFullContext")
    else:
        assert s["transport"] in ("fork", "emulator") and s["staged_by"]
    unf, fen = s["runs"]["unfenced"], s["runs"]["fenced"]
    assert "(E+2)" in unf["first_divergence"][0] and unf["audit_exit_code"] == 1
    assert fen["audit_exit_code"] == 0 and fen["first_divergence"] == []
    for run in (unf, fen):
        for path in run["reports"].values():
            assert Path(path).stat().st_size > 0
        assert Path(run["reports"]["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_text_output(demo_run):
    lines = []
    demo.print_demo(demo_run.summary, lines.append)
    out = "\n".join(lines) + "\n"
    assert "first divergence: step 0, layer 0, rank 1, expert 0: w2_weight_scale_inv holds expert 2 (E+2)" in out
    assert lines[-1].startswith("race found unfenced; fix validated fenced")  # the verdict comes last
    assert "token 0 vs reference: max |logit delta| 0\n" in out  # fenced is exact
    # no --sglang-python: the second act (the real SGLang server) is skipped in one line that says how to get it
    assert demo_run.summary["server_act"] == {"skipped": "no SGLang environment given (make demo passes "
                                                         "--sglang-python .venv-sglang/bin/python)"}
    assert sum("second act" in line for line in lines) == 1 and "skipped" in out
    # with it, the act's lines and the verdict that names it (the real server's run: by hand and `make demo`)
    act = {"seconds": 1.0, "first_divergence": ["step 1, layer 0, rank 1, expert 0: w2_weight holds expert 2 (E+2)"],
           "summaries": ["rank 1, layer 0, steps 1-17: 1/8 w2_weight are E+2, 1/8 are E-2 (17 loads)"], "ok": True,
           "detail": "every planned fault named exactly", "trace": "t", "log": "l"}
    lines = []
    demo.print_demo({**demo_run.summary, "server_act": act}, lines.append)
    assert lines[-1].startswith("race found unfenced; fix validated fenced; fault named in the real server")


# the CLI in a process where `import matplotlib` fails, as on a machine without it
_NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from moetrace.cli import main; main()"


def _launches(traces: Path) -> dict[str, str]:
    return {str(m.relative_to(traces)): json.loads(m.read_text())["run_nonce"] for m in traces.glob("*/*/_manifest.json")}


def test_demo_runs_again_in_the_same_work_folder_without_matplotlib(demo_run, tmp_path):
    """`moetrace demo` a second time where a first run left everything (the session's run,
    copied), on a machine without matplotlib: a fresh run that reads only its own traces,
    skips the plots in one line, keeps its verdict last, and leaves nothing of the first
    run beside its own outputs (no earlier plot, no refusal record, no earlier trace)."""
    assert demo_run.returncode == 0, demo_run.stderr
    work = shutil.copytree(demo_run.workdir, tmp_path / "demo-out", symlinks=True)
    first = _launches(work / "traces")
    assert len(first) == 4 and (work / "reports" / "fenced.png").exists()
    proc = subprocess.run([sys.executable, "-c", _NO_MATPLOTLIB, "demo", "--quick", "--transport", "emulator",
                           "--workdir", str(work)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("race found unfenced; fix validated fenced"), lines
    assert sum(line.startswith("plots:") for line in lines) == 1
    assert "plots:   skipped (matplotlib is not installed here (pip install matplotlib))" in lines
    # stderr is not a terminal: no progress; the ranks' own output went to the rank logs
    assert proc.stderr == ""
    assert "moetrace guard: rank 1" in (work / "logs" / "unfenced" / "rank1.log").read_text()
    # the emulator has none of SGLang's weight writers, by design: recorded in every rank's
    # manifest, never said as if something were wrong
    for log in (work / "logs").glob("*/rank*.log"):
        assert "were not found" not in log.read_text(), log
    for manifest in (work / "traces").glob("*/*/_manifest.json"):
        assert any("weight-update entry points were not found" in n for n in json.loads(manifest.read_text())["notes"])
    second = _launches(work / "traces")
    assert sorted(second) == sorted(first) and not set(second.values()) & set(first.values())
    assert not list(work.rglob("_refused-*")) and not list(work.rglob("*.png"))
    assert sorted(p.name for p in (work / "reports").iterdir()) == sorted(
        f"{run}.{ext}" for run in ("unfenced", "fenced") for ext in ("json", "md", "junit.xml"))
    codes = {run: json.loads((work / "reports" / f"{run}.json").read_text())["audit_exit_code"]
             for run in ("unfenced", "fenced")}
    assert codes == {"unfenced": 1, "fenced": 0}


def test_demo_refuses_a_work_folder_it_did_not_make(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    one_line_error(cli("demo", "--quick", "--workdir", tmp_path), f"--workdir {tmp_path}: holds notes.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint

    return write_synthetic_checkpoint(tmp_path_factory.mktemp("e2e") / "c", num_layers=2, num_experts=8, hidden=256,
                                      intermediate=256)


def _junit(tmp_path):
    """A report folder that does not exist yet (a fresh CI checkout): made before the launch."""
    return tmp_path / "build" / "reports" / "junit.xml"


def _audit_launch(ckpt, tmp_path, server_args, *extra):
    port = _port()
    server = f"{sys.executable} -m moetrace.cli serve {ckpt} --tp 2 --port {port} {server_args}"
    cmd = [*CLI, "audit", "--launch", server, "--checkpoint", str(ckpt), "--requests", "1", "--prompt-tokens", "20",
           "--out", str(tmp_path / "traces"), "--run-id", "nightly", "--junit", str(_junit(tmp_path)),
           "--json-out", str(tmp_path / "a.json"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_audit_launch_unfenced_exits_1(ckpt, tmp_path):
    before = _shm()
    proc = _audit_launch(ckpt, tmp_path, "--fence none")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "holds expert 2 (E+2)" in proc.stdout and "audit: exit 1 (divergence found)" in proc.stdout
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["audit_exit_code"] == 1
    launch = doc["launch"]  # the traffic that produced the trace travels with the verdict
    assert launch["requests_answered"] == 2 and launch["requests_failed"] == 0 and launch["server_exit_code"] == 0
    assert "<failure" in _junit(tmp_path).read_text()  # the divergent run's JUnit, in the folder made for it
    run = json.loads((tmp_path / "traces" / "nightly" / "_run.json").read_text())
    assert run["complete"] and run["server_exit_code"] == 0
    assert _leaked(before) == []


def test_audit_launch_fenced_exits_0(ckpt, tmp_path):
    proc = _audit_launch(ckpt, tmp_path, "--fence all")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALL MATCH" in proc.stdout and "audit: exit 0 (pass)" in proc.stdout
    assert json.loads((tmp_path / "a.json").read_text())["totals"]["missing"] == 0


def test_audit_launch_of_a_staging_server_whose_prompts_never_stage_exits_2(ckpt, tmp_path):
    """Threshold 512 (passes of up to 512 tokens): prompts of 20 words never stage, so the
    racy server's trace holds resident loads only: exit 2 naming the prompts and the
    threshold, never ALL MATCH. Without --prompt-tokens the prompts are sized from the
    threshold: the staged loads are captured and E+2 is caught."""
    flags = "--fence none --kt-gpu-prefill-token-threshold 512 --chunked-prefill-size 512"
    short = _audit_launch(ckpt, tmp_path, flags)
    assert short.returncode == 2 and "ALL MATCH" not in short.stdout, short.stdout + short.stderr
    why = " ".join(short.stdout.split())
    assert "stages a layer only in a prefill pass of at least 512 tokens" in why and "~20 words" in why
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["audit_exit_code"] == 2 and any("holds no staged load" in p for p in doc["incomplete"])
    port = _port()
    server = f"{sys.executable} -m moetrace.cli serve {ckpt} --tp 2 --port {port} {flags}"
    sized = subprocess.run([*CLI, "audit", "--launch", server, "--checkpoint", str(ckpt), "--requests", "1",
                            "--out", str(tmp_path / "traces"), "--run-id", "sized"],
                           capture_output=True, text=True, timeout=600)
    assert sized.returncode == 1 and "(E+2)" in sized.stdout, sized.stdout + sized.stderr
    run = json.loads((tmp_path / "traces" / "sized" / "_run.json").read_text())
    assert run["traffic"]["prompt_tokens"] >= 512 and run["traffic"]["prompt_tokens_from"] == "the staging threshold"


@pytest.mark.parametrize(
    "server,why",
    [
        ("import sys; sys.exit(3)", "the server exited before"),
        ("import time; time.sleep(60)", "never answered"),
    ],
)
def test_audit_launch_server_never_healthy_exits_2_with_reports(ckpt, tmp_path, server, why):
    r = cli("audit", "--launch", f"{sys.executable} -c '{server}' --port {_port()}", "--checkpoint", ckpt,
            "--out", tmp_path / "traces", "--ready-timeout", "1", "--junit", tmp_path / "j.xml",
            "--json-out", tmp_path / "a.json")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("moetrace: error: audit --launch: ") and why in last and "/health" in last
    # a nightly CI job still gets a failing test case and a JSON verdict
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["status"] == "unusable" and doc["audit_exit_code"] == 2 and why in doc["error"]
    assert '<error message="audit --launch: ' in (tmp_path / "j.xml").read_text()


def test_audit_launch_emulator_without_port_is_refused_at_once(ckpt, tmp_path):
    r = cli("audit", "--launch", f"{sys.executable} -m moetrace.cli serve {ckpt} --tp 2", "--checkpoint", ckpt,
            "--out", tmp_path / "traces", "--junit", tmp_path / "j.xml")
    one_line_error(r, "give it --port N")
    assert (tmp_path / "j.xml").exists()


def test_audit_of_unusable_trace_still_writes_reports(tmp_path, ckpt):
    (tmp_path / "empty").mkdir()
    r = cli("audit", tmp_path / "empty", "--checkpoint", ckpt, "--junit", tmp_path / "j.xml",
            "--json-out", tmp_path / "a.json", "--markdown", tmp_path / "a.md")
    one_line_error(r, str(tmp_path / "empty"))
    assert json.loads((tmp_path / "a.json").read_text())["status"] == "unusable"
    assert "UNUSABLE" in (tmp_path / "a.md").read_text() and "<error" in (tmp_path / "j.xml").read_text()


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "give a TRACE folder"),
        (["--launch", "x", "some/trace"], "not both"),
        (["--launch", "x"], "--index FILE or --checkpoint"),
    ],
)
def test_audit_usage_errors_are_one_line(args, needle):
    from click.testing import CliRunner

    from moetrace.cli import main

    r = CliRunner().invoke(main, ["audit", *args])
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_audit_launch_hands_its_index_to_the_guard(small_index, tmp_path, monkeypatch):
    """`audit --launch --index I --hook-config {"guard": "alert"}`: the hooks get I (the one
    index of the audit), as a config the tracer accepts; a hook config naming another index
    is refused in one line before anything is launched."""
    import moetrace.jobs.audit as audit
    from moetrace.errors import MoetraceError
    from moetrace.tracer.config import TraceConfig

    handed = []

    def launch_and_drive(cmd, config, *args, **kw):
        handed.append(dict(config))
        raise MoetraceError("launched")  # stop here: what matters is the config the server gets

    monkeypatch.setattr(audit, "launch_and_drive", launch_and_drive)
    guard = tmp_path / "guard.json"
    guard.write_text('{"guard": "alert"}')
    args = ["audit", "--launch", f"touch {tmp_path / 'started'}", "--index", small_index, "--out", tmp_path / "t",
            "--hook-config", guard]
    one_line_error(cli(*args), "launched")
    (config,) = handed
    assert config["index"] == os.path.abspath(small_index) and config["guard"] == "alert"
    cfg = TraceConfig.from_dict(config)
    assert cfg.guard == "alert" and cfg.index == os.path.abspath(small_index)
    # without anything that verifies in the server, the hooks are left as configured
    guard.write_text('{"layers": "0"}')
    one_line_error(cli(*args), "launched")
    assert "index" not in handed[-1]
    guard.write_text(json.dumps({"guard": "alert", "index": str(tmp_path / "other.parquet")}))
    one_line_error(cli(*args), "--hook-config names index", "one index per audit")
    assert len(handed) == 2 and not (tmp_path / "started").exists()
