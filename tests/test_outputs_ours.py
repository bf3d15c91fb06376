"""A file moetrace did not write is never deleted or overwritten, whatever option names
it: moetrace recognizes its own outputs by content (the index's Parquet metadata, a
report's header, a JSON document's own fields, the demo's mark) and refuses anything
else in one line naming the option and the path, before any work; a failed run removes
only its own reports; trace folders are never written through links; and every report
path is probed (its folder made) before `audit --launch` starts a server."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
from support.cli import cli, one_line_error
from support.traces import write_scenario

from moetrace.errors import MoetraceError


@pytest.fixture(scope="module")
def runs(small_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    write_scenario(small_model, str(out), "good", [0])
    return out


@pytest.fixture
def ckpt(ckpt_copy):
    """A private copy of the small checkpoint (two shards and model.safetensors.index.json)."""
    from support.traces import SMALL_MOE

    return ckpt_copy(**SMALL_MOE)


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _refused(r, option: str, path) -> None:
    one_line_error(r, f"{option} {path}: holds a file moetrace did not write", "give a new path")


# ---------------------------------------------------------------- overwrite: index -o, report options


def test_index_out_never_replaces_a_checkpoint_file(ckpt, tmp_path):
    """`index CKPT -o CKPT/model.safetensors.index.json` (both are "index") and `-o` onto a
    shard: refused before any fingerprinting, the checkpoint byte for byte as it was; an
    index at -o is replaced (a rebuild), and so is an empty file (nothing is lost)."""
    before = _digests(ckpt)
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    for target in (ckpt / "model.safetensors.index.json", shard, ckpt / "config.json"):
        _refused(cli("index", ckpt, "--tp", "2", "-o", target), "-o", target)
        _refused(cli("index", ckpt, "--tp", "2", "--no-cache", "-o", target), "-o", target)
    assert _digests(ckpt) == before
    index = tmp_path / "index.parquet"
    assert cli("index", ckpt, "--tp", "2", "-o", index).exit_code == 0
    assert cli("index", ckpt, "--tp", "1", "-o", index).exit_code == 0  # our own index: replaced
    _refused(cli("index", ckpt, "--tp", "2", "-o", shard), "-o", shard)  # a cache hit now: the copy refuses it too
    assert _digests(ckpt) == before
    import pyarrow.parquet as pq

    assert pq.read_table(index).column("tp_size").to_pylist()[0] == 1
    empty = tmp_path / "empty.parquet"
    empty.touch()
    assert cli("index", ckpt, "--tp", "2", "-o", empty).exit_code == 0 and empty.stat().st_size > 0


@pytest.mark.parametrize("option,name,content", [
    ("--json-out", "config.json", '{"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2}\n'),
    ("--json-out", "other.json", '{"schema": "someone.else", "status": "pass"}\n'),
    ("--markdown", "notes.md", "# My notes\n\nkeep me\n"),
    ("--junit", "results.xml", '<?xml version="1.0"?>\n<testsuites name="pytest"><testsuite/></testsuites>\n'),
    ("--plot", "photo.png", "\x89PNG not a moetrace picture"),
])
@pytest.mark.parametrize("command", ["analyze", "audit"])
def test_report_options_never_replace_a_file_moetrace_did_not_write(runs, small_index, tmp_path, command, option,
                                                                    name, content):
    target = tmp_path / name
    target.write_text(content)
    _refused(cli(command, runs / "good", "--index", small_index, option, target), option, target)
    assert target.read_text() == content
    # its own report is replaced: the same command twice
    ours = tmp_path / f"ours{Path(name).suffix}"
    for _ in range(2):
        r = cli(command, runs / "good", "--index", small_index, option, ours)
        assert r.exit_code == 0 and ours.stat().st_size > 0, r.output


def test_other_file_options_never_replace_a_file_moetrace_did_not_write(tmp_path):
    """serve --ready-file and conform --json-out: refused before a server or a rank starts."""
    mine = tmp_path / "mine.json"
    mine.write_text('{"mine": true}\n')
    _refused(cli("serve", tmp_path / "no-ckpt", "--ready-file", mine), "--ready-file", mine)
    _refused(cli("conform", "--json-out", mine), "--json-out", mine)
    assert mine.read_text() == '{"mine": true}\n'


# ---------------------------------------------------------------- delete: a failed report run


@pytest.fixture
def unwritable(tmp_path):
    """A folder nobody here may create files in (as root, a path under /sys)."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o500)
        yield d
        d.chmod(0o700)
        return
    d = "/sys/moetrace-unwritable"
    try:
        os.mkdir(d)
    except OSError:
        yield Path(d)
        return
    os.rmdir(d)
    pytest.skip("no unwritable folder on this system")


def test_a_failed_report_removes_only_moetraces_reports(runs, small_index, tmp_path, unwritable, monkeypatch):
    """--junit cannot be written: the reports this run wrote and an earlier moetrace report
    at another path are removed (none is taken for this run's), but a user's file that
    appeared at a report path while the trace was analyzed is left as it was."""
    import moetrace.jobs.audit as audit

    notes, md, junit = tmp_path / "notes.md", tmp_path / "a.md", unwritable / "j.xml"
    md.write_text("# moetrace analysis: DIVERGENT\n\nan earlier run\n")
    real = audit.analyze

    def analyze_then_a_user_writes(*a, **kw):
        rep = real(*a, **kw)
        notes.write_text("my notes, written during the audit\n")  # after the up-front check
        return rep

    monkeypatch.setattr(audit, "analyze", analyze_then_a_user_writes)
    r = cli("audit", runs / "good", "--index", small_index, "--json-out", notes, "--markdown", md, "--junit", junit)
    assert r.exit_code == 3 and "no report written" in r.output, r.output
    assert notes.read_text() == "my notes, written during the audit\n"  # not ours: never removed
    assert not md.exists()  # ours (an earlier run's): removed


# ---------------------------------------------------------------- folders: the demo's, run folders, links


def test_demo_never_empties_a_folder_it_did_not_mark(tmp_path):
    """A user's folder holding exactly the names the README's recipes produce (traces/,
    index.parquet, checkpoint/): refused, every file kept; a mark file that is not the
    demo's (empty, or a link) does not make it the demo's."""
    for sub in ("traces/run1/rank=0", "checkpoint"):
        (tmp_path / sub).mkdir(parents=True)
    (tmp_path / "traces" / "run1" / "rank=0" / "part-00000.parquet").write_bytes(b"mine")
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    (tmp_path / "index.parquet").write_bytes(b"mine too")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    one_line_error(cli("demo", "--quick", "--workdir", tmp_path), f"--workdir {tmp_path}: holds checkpoint")
    (tmp_path / ".moetrace-demo").write_text("")
    one_line_error(cli("demo", "--quick", "--workdir", tmp_path), f"--workdir {tmp_path}:", "no .moetrace-demo mark")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == sorted(before + [".moetrace-demo"])
    assert (tmp_path / "index.parquet").read_bytes() == b"mine too"


def test_launch_replace_deletes_only_a_moetrace_run_folder(small_model, tmp_path):
    from moetrace.servers.launcher import Launcher

    write_scenario(small_model, str(tmp_path), "X", [0])
    (tmp_path / "X" / "notes.txt").write_text("mine\n")
    lch = Launcher(["true"], {"out": str(tmp_path), "run_id": "X"}, server_flags="split", replace=True,
                   close_timeout_s=0, echo=lambda m: None)
    with pytest.raises(MoetraceError, match=r"--replace: run folder .*X holds notes.txt, which moetrace did not"):
        lch.run()
    assert lch.server is None and (tmp_path / "X" / "notes.txt").read_text() == "mine\n"
    assert (tmp_path / "X" / "rank=0" / "_manifest.json").exists()


@pytest.mark.parametrize("planted", ["rank=0", "run"])
def test_a_rank_never_writes_its_trace_through_a_planted_link(tmp_path, planted):
    """hook-spec's ranks: OUT/RUN/rank=0 (or OUT/RUN) planted as a link to another folder:
    the rank refuses to trace (one line naming the link), the link's target untouched."""
    from moetrace.tracer.capture import Tracer
    from moetrace.tracer.config import TraceConfig

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep\n")
    out = tmp_path / "out"
    (out / "R").mkdir(parents=True)
    link = out / "R" / "rank=0" if planted == "rank=0" else out / "R"
    if planted == "run":
        (out / "R").rmdir()
    link.symlink_to(elsewhere, target_is_directory=True)
    conf = TraceConfig.from_dict({"out": str(out), "run_id": "R"})
    with pytest.raises(MoetraceError, match=r"is a symbolic link .* never writes a trace through a link"):
        Tracer(conf, 0, 1)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("option", ["launch --out", "audit --launch --out", "hook-spec --out", "make-checkpoint -o",
                                    "demo --workdir", "selftest --workdir", "conform --workdir"])
def test_a_trailing_slash_names_the_link_itself(tmp_path, small_index, option):
    """`--out link/` (or `--workdir link/`) names the link, as `--out link` does: refused
    in one line before anything starts, nothing written through it."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    started = tmp_path / "started"
    command, flag = option.rsplit(" ", 1)
    for out in (f"{tmp_path / 'link'}", f"{tmp_path / 'link'}/"):
        if command == "launch":
            r = cli("launch", "--out", out, "--run-id", "X", "--", "touch", started)
        elif command == "audit --launch":
            r = cli("audit", "--launch", f"touch {started}", "--index", small_index, "--out", out, "--run-id", "X")
        elif command == "make-checkpoint":
            r = cli("make-checkpoint", "--layers", "1", "--experts", "2", "--hidden", "128", "--intermediate", "128",
                    "-o", out)
        elif command == "hook-spec":
            r = cli("hook-spec", "--out", out)
        else:
            r = cli(command, *(["--quick"] if command != "conform" else []), flag, out)
        one_line_error(r, f"{flag} ", "is a symbolic link")
    assert not started.exists() and list((tmp_path / "real").iterdir()) == []


# ---------------------------------------------------------------- probed before a launch


def test_audit_launch_refuses_an_unwritable_report_folder_before_the_server_starts(small_index, tmp_path, unwritable):
    started = tmp_path / "started"
    junit = unwritable / "reports" / "junit.xml"
    r = cli("audit", "--launch", f"touch {started}", "--index", small_index, "--out", tmp_path / "t",
            "--junit", junit)
    one_line_error(r, f"--junit {junit}: cannot write")
    assert not started.exists() and not (tmp_path / "t").exists()


def test_audit_launch_makes_a_report_folder_before_the_server_starts(small_index, tmp_path):
    """`--junit build/reports/junit.xml` where build/ does not exist: the folder is there
    when the server starts (the server command checks), and the report is written."""
    junit = tmp_path / "build" / "reports" / "junit.xml"
    seen = tmp_path / "seen"
    server = f"{sys.executable} -c 'import os, sys; open(sys.argv[1], \"w\").write(str(os.path.isdir(sys.argv[2])))' "
    r = cli("audit", "--launch", server + f"{seen} {junit.parent}", "--index", small_index, "--out", tmp_path / "t",
            "--junit", junit, "--ready-timeout", "1")
    assert r.exit_code == 2 and seen.read_text() == "True", r.output  # the server never became healthy: exit 2
    assert '<testsuites name="moetrace"' in junit.read_text()  # ... and CI still gets its failing test case


def test_reports_of_analyze_are_written_into_a_new_folder(runs, small_index, tmp_path):
    paths = [tmp_path / "a" / "r.json", tmp_path / "b" / "r.md", tmp_path / "c" / "j.xml"]
    r = cli("analyze", runs / "good", "--index", small_index, "--json-out", paths[0], "--markdown", paths[1],
            "--junit", paths[2])
    assert r.exit_code == 0 and all(p.stat().st_size for p in paths), r.output
    assert json.loads(paths[0].read_text())["schema"] == "moetrace.analysis"
