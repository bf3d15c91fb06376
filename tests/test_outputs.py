"""Every output option writes only to a new path or a regular file (a directory for
folder options), whole or not at all, and every failure is one line with the exit code
the rule says (docs/analysis.md, "Exit codes"): unwritable and full file systems, an
unwritable MOETRACE_CACHE, a report that cannot be written, an unexpected error."""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import cli, one_line_error
from support.traces import write_scenario


@pytest.fixture(scope="module")
def runs(small_model, tmp_path_factory):
    """A clean run and one whose rank 1 holds expert E+2 in one load."""
    out = tmp_path_factory.mktemp("traces")
    write_scenario(small_model, str(out), "good", [0])
    write_scenario(small_model, str(out), "bad", [0], {(0, 1, small_model.layer_ids[0]): {(0, "w2_weight_scale_inv"): ("expert", 2)}})
    return out


TINY = ["--layers", "1", "--experts", "2", "--hidden", "128", "--intermediate", "128"]  # make-checkpoint, cheap






@pytest.fixture
def unwritable(tmp_path):
    """A folder nobody here may create files in: a read-only mode bit for a normal user;
    as root (who ignores mode bits), a path under /sys, which refuses even root."""
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


# ---------------------------------------------------------------- 2. what an output may replace


def special(tmp_path, kind):
    """A FIFO, a symbolic link to a file that is not ours, or (as root) a character device."""
    path = tmp_path / f"target-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        (tmp_path / "not-ours.txt").write_text("keep me\n")
        path.symlink_to(tmp_path / "not-ours.txt")
    else:
        if os.geteuid() != 0:
            pytest.skip("creating a character device needs root")
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # a /dev/null of our own
    return path


WHAT = {"fifo": "named pipe", "link": "symbolic link", "chr": "character device"}


def unchanged(path, kind, tmp_path):
    mode = os.lstat(path).st_mode
    ok = {"fifo": stat.S_ISFIFO, "link": stat.S_ISLNK, "chr": stat.S_ISCHR}[kind](mode)
    return ok and (kind != "link" or (tmp_path / "not-ours.txt").read_text() == "keep me\n")


@pytest.mark.parametrize("kind", ["fifo", "link", "chr"])
@pytest.mark.parametrize("option", ["index -o", "--json-out", "--markdown", "--junit", "--plot", "make-checkpoint -o",
                                    "launch --out"])
def test_output_options_refuse_what_is_not_a_regular_file(option, kind, small_model, small_index, runs, tmp_path):
    path = special(tmp_path, kind)
    if option == "index -o":
        args = ["index", small_model.path, "--tp", "2", "-o", path]
    elif option == "make-checkpoint -o":
        args = ["make-checkpoint", "-o", path]
    elif option == "launch --out":
        args = ["launch", "--out", path, "--run-id", "X", "--", "touch", tmp_path / "started"]
    else:
        if option == "--plot":  # the name must say the picture's format
            path = path.rename(path.with_suffix(".png"))
        args = ["analyze", runs / "good", "--index", small_index, option, path]
    r = cli(*args)
    one_line_error(r, f"{option.split()[-1]} {path}: is", WHAT[kind])
    assert unchanged(path, kind, tmp_path) and not (tmp_path / "started").exists()


# ---------------------------------------------------------------- 5. exit codes


def test_a_report_that_cannot_be_written_does_not_hide_the_verdict(runs, small_index, tmp_path, unwritable):
    """All of a run's reports or none: the report that could be written is removed again,
    with the earlier run's report at that path, so none is taken for this run's."""
    json_out, junit = tmp_path / "audit.json", unwritable / "junit.xml"
    json_out.write_text('{"schema": "moetrace.analysis", "status": "an earlier run"}')
    r = cli("audit", runs / "good", "--index", small_index, "--json-out", json_out, "--junit", junit)
    assert r.exit_code == 3 and "ALL MATCH" in r.output and "audit: exit 3 (pass, but a report was not written)" in r.output
    assert f"moetrace: error: --junit {junit}: cannot write" in r.output and "no report written" in r.output
    assert not json_out.exists() and not junit.exists()
    r = cli("audit", runs / "bad", "--index", small_index, "--junit", junit)
    assert r.exit_code == 1 and "E+2" in r.output and f"--junit {junit}: cannot write" in r.output  # 1 wins
    r = cli("analyze", runs / "bad", "--index", small_index, "--markdown", junit)
    assert r.exit_code == 3 and "E+2" in r.output


@pytest.mark.parametrize("command", ["audit", "analyze"])
def test_an_unusable_rerun_leaves_no_report_of_the_earlier_run(runs, small_index, tmp_path, command):
    """The nightly command run twice: the second run's trace is unusable. Every report path
    now holds the second run's (unusable) report, the picture included: no DIVERGENT grid
    of the first run is left beside them. analyze keeps the same rule."""
    paths = {"--json-out": tmp_path / "a.json", "--markdown": tmp_path / "a.md", "--junit": tmp_path / "j.xml",
             "--plot": tmp_path / "a.png"}
    options = [str(x) for option, path in paths.items() for x in (option, path)]
    r = cli(command, runs / "bad", "--index", small_index, *options)
    assert r.exit_code == (1 if command == "audit" else 0) and "E+2" in r.output  # analyze reports, audit judges
    divergent_png = paths["--plot"].read_bytes()
    (tmp_path / "empty").mkdir()
    r = cli(command, tmp_path / "empty", "--index", small_index, *options)
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert json.loads(paths["--json-out"].read_text())["status"] == "unusable"
    assert "UNUSABLE" in paths["--markdown"].read_text() and "<error" in paths["--junit"].read_text()
    png = paths["--plot"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png != divergent_png


def test_plot_without_matplotlib_is_refused_before_any_work(runs, small_index, tmp_path):
    """`--plot` on a machine without matplotlib: one line before anything runs (no server
    launched, no report written), exit 2."""
    code = ("import sys; sys.modules['matplotlib'] = None; from moetrace.cli import main; main()")
    report = tmp_path / "a.json"
    proc = subprocess.run([sys.executable, "-c", code, "audit", "--launch", f"touch {tmp_path / 'started'}",
                           "--index", small_index, "--out", str(tmp_path / "t"), "--json-out", str(report),
                           "--plot", str(tmp_path / "a.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"moetrace: error: --plot {tmp_path / 'a.png'}: matplotlib is not installed here "
                                   "(pip install matplotlib); or drop --plot")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_unexpected_error_is_one_line_and_exit_2(runs, small_index, monkeypatch):
    import moetrace.jobs.audit as audit

    def broken(*a, **kw):
        raise ZeroDivisionError("a bug\nwith two lines")

    monkeypatch.setattr(audit, "analyze", broken)
    one_line_error(cli("audit", runs / "good", "--index", small_index), "unexpected ZeroDivisionError: a bug with two lines")


def test_ctrl_c_is_one_line_and_exit_130_never_1(runs, small_index, monkeypatch):
    import moetrace.jobs.audit as audit

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(audit, "analyze", interrupted)
    r = cli("audit", runs / "good", "--index", small_index)
    assert r.exit_code == 130 and r.output.strip() == "moetrace: interrupted"


def test_a_launch_command_that_does_not_split_is_one_line(small_index, tmp_path):
    one_line_error(cli("audit", "--launch", "sh -c 'unterminated", "--index", small_index, "--out", tmp_path),
                   "cannot split the command", "No closing quotation")


# ---------------------------------------------------------------- 7. read-only and full file systems


def test_unwritable_outputs_are_one_line(small_model, unwritable, tmp_path):
    one_line_error(cli("index", small_model.path, "--tp", "2", "-o", unwritable / "x" / "index.parquet"), f"-o {unwritable}")
    one_line_error(cli("make-checkpoint", *TINY, "-o", unwritable / "ckpt"), f"-o {unwritable / 'ckpt'}: cannot write")
    r = cli("index", small_model.path, "--tp", "2", "-o", tmp_path / "i.parquet", env={"MOETRACE_CACHE": str(unwritable)})
    one_line_error(r, f"MOETRACE_CACHE {unwritable}", "--no-cache")
    assert not (tmp_path / "i.parquet").exists()


_DRIVER = """
import json, sys
from moetrace.cli import main
codes = []
for args in json.loads(sys.argv[1]):
    try:
        main(args, standalone_mode=False)
        codes.append(0)
    except SystemExit as e:
        codes.append(e.code)
print(json.dumps(codes))
"""


def _full_disk():
    """In the child: files may not grow past 2 KiB (EFBIG, as a full disk gives ENOSPC)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))


def test_nothing_is_left_half_written_on_a_full_disk(runs, small_index, tmp_path):
    report, ckpt = tmp_path / "audit.json", tmp_path / "ckpt"
    commands = [["audit", str(runs / "good"), "--index", small_index, "--json-out", str(report)],
                ["make-checkpoint", *TINY, "-o", str(ckpt)]]
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(commands)], capture_output=True, text=True,
                          preexec_fn=_full_disk, timeout=300)
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert codes == [3, 2], proc.stdout + proc.stderr
    assert "ALL MATCH" in proc.stdout and f"--json-out {report}: cannot write" in proc.stderr
    assert f"-o {ckpt}: cannot write" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no half report, no folder with only config.json
