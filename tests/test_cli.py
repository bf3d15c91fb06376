"""The CLI's own contract: every command has help with an example, and usage
errors are one line with exit 2, like every other user error."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from moetrace.cli import main

COMMANDS = ["make-checkpoint", "index", "hook-spec", "launch", "serve", "analyze", "audit", "diff", "demo", "selftest"]


def test_every_command_is_listed_and_has_an_example():
    top = CliRunner().invoke(main, ["--help"])
    assert top.exit_code == 0
    for name in COMMANDS:
        assert name in top.output
        r = CliRunner().invoke(main, [name, "--help"])
        assert r.exit_code == 0 and "Example" in r.output, name


@pytest.mark.parametrize(
    "args,needle",
    [
        (["index", "/tmp", "--indx", "3"], "No such option '--indx'"),
        (["index", "/tmp", "--tp", "0"], "Invalid value for '--tp'"),
        (["diff", "a"], "Missing argument 'RUN_B'"),
        (["selftest", "--device", "tpu"], "Invalid value for '--device'"),
    ],
)
def test_usage_errors_are_one_line(args, needle):
    proc = subprocess.run([sys.executable, "-m", "moetrace.cli", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrace: error: ") and needle in lines[0], proc.stderr
