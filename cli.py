"""moetrace command line: one click group over checkpoints, tracer, hooks and analysis."""

from __future__ import annotations

import sys

import click

from moetrace import __version__
from moetrace.errors import MoetraceError


class _Group(click.Group):
    """Turns MoetraceError into one line on stderr and its exit code: no traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MoetraceError as err:
            click.echo(f"moetrace: error: {err}", err=True)
            sys.exit(err.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moetrace")
def main() -> None:
    """Trace MoE expert weights from checkpoint to GPU and find where they diverge."""


# Commands register themselves below, one section per area of the data flow.
# ---- checkpoints: make-checkpoint ------------------------------------------
# ---- tracer: index ----------------------------------------------------------
# ---- hooks: hook-spec, launch -----------------------------------------------
# ---- analysis: analyze, diff, audit -----------------------------------------
# ---- emulator: demo, serve ---------------------------------------------------
# ---- selftest ------------------------------------------------------------------

if __name__ == "__main__":
    main()
