"""`moetrace analyze`: a verdict for every captured tensor and the first divergence (jobs.audit)."""

from __future__ import annotations

import sys

import click

from moetrace.commands.options import analysis_options, command, progress, stderr

EXAMPLES = ("moetrace analyze /data/traces/unfenced --index index.parquet --plot grid.png",)


@command("analyze", EXAMPLES)
@analysis_options()
def analyze_cmd(analysis):
    """Give every captured tensor a verdict and find the first divergence.

    TRACE is a run folder OUT/<run_id>, an OUT folder of several runs, a glob
    or a pyarrow filesystem URL. Verdicts: match, stale (E+k), wrong_rank,
    wrong_layer, wrong_tensor, zeros, constant, torn, unknown, unexpected, and
    per load missing. Exit 0 when the analysis ran (findings are printed),
    2 on unusable input, 3 when a report file could not be written.
    docs/analysis.md explains every verdict and exit code.
    """
    from moetrace.errors import ExitCode
    from moetrace.jobs.audit import exit_code, run_analysis

    _, written = run_analysis("analyze", analysis, click.echo, warn=stderr, live=progress(analysis.as_json))
    sys.exit(exit_code(ExitCode.PASS, written))
