"""`moetrace diff`: the same tensors across two runs (analysis.diff)."""

from __future__ import annotations

import click

from moetrace.commands.options import command

EXAMPLES = ("moetrace diff /data/traces/unfenced /data/traces/fenced --index index.parquet",)


@command("diff", EXAMPLES)
@click.argument("run_a")
@click.argument("run_b")
@click.option("--index", "index_path", default=None, metavar="FILE",
              help="Index Parquet: also compare verdicts (e.g. E+2 -> match).")
@click.option("--checkpoint", default=None, metavar="CKPT", help="Checkpoint folder, as for analyze.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON diff (docs/analysis.md).")
@click.option("--max-lines", type=click.IntRange(min=1), default=20, show_default=True, help="Change groups shown.")
def diff_cmd(run_a, run_b, index_path, checkpoint, as_json, max_lines):
    """Compare the same (step, layer, rank, source, expert, tensor) across two runs."""
    import json

    from moetrace.analysis.diff import diff, diff_text

    doc = diff(run_a, run_b, index=index_path, checkpoint=checkpoint)
    click.echo(json.dumps(doc, indent=1) if as_json else diff_text(doc, max_lines=max_lines))
