"""The moetrace CLI in this process (click's CliRunner), and the one-line error contract."""

from __future__ import annotations

from click.testing import CliRunner

from moetrace.cli import main


def cli(*args, env: dict | None = None):
    """Invoke ``moetrace ARGS``; an exception that escaped the CLI's own handling is raised."""
    r = CliRunner().invoke(main, [str(a) for a in args], env=env)
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


def one_line_error(r, *words: str, code: int = 2) -> str:
    """The result is exit ``code`` with one line of output, ``moetrace: error: ...``, holding
    every one of ``words`` and no traceback; returns that line."""
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == code and len(lines) == 1 and lines[0].startswith("moetrace: error: "), r.output
    assert "Traceback" not in r.output and all(w in lines[0] for w in words), lines[0]
    return lines[0]
