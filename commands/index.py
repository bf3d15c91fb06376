"""`moetrace index`: the expected digests of every shard (checkpoints.index_build)."""

from __future__ import annotations

import sys

import click

from moetrace.commands.options import NullBar, command

EXAMPLES = (
    "moetrace index ./Qwen3.5-122B-A10B-FP8 --tp 2 -o index.parquet",
    "moetrace index ./Qwen3.5-122B-A10B-FP8 --tp 2 --layout-from /data/traces/run1 -o index.parquet",
)


@command("index", EXAMPLES)
@click.argument("checkpoint", type=click.Path(file_okay=False, path_type=str))
@click.option("--tp", "tp_size", type=click.IntRange(min=1), required=True, help="Tensor-parallel size of the server.")
@click.option("--ep", "ep_size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Expert-parallel size.")
@click.option("--moe-dp", "moe_dp_size", type=click.IntRange(min=1), default=1, show_default=True,
              help="The server's --moe-dp-size (moe_tp = tp / ep / moe_dp).")
@click.option("--layers", default=None, help="MoE layers to index, e.g. 0,2,5-7 (default: all MoE layers).")
@click.option("--up-first", is_flag=True, help="w13 holds up rows before gate rows (flashinfer-trtllm runner).")
@click.option("--layout-from", "layout_from", default=None, metavar="TRACE",
              help="Build for the layout a trace recorded (order, padding, reproduced transforms; docs/compat.md).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where to fingerprint (auto: CUDA when present); the digests are bit-identical on both.")
@click.option("-o", "--out", default=None, type=click.Path(dir_okay=False, path_type=str),
              help="Index Parquet file to write.  [required]")
@click.option("--output", "old_out", default=None, type=click.Path(dir_okay=False, path_type=str), hidden=True,
              help="The earlier spelling of --out, still read.")
@click.option("--no-cache", is_flag=True,
              help="Rebuild even if the cache holds this index; the config cache is neither read nor written.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of text; no progress bar.")
def index_cmd(checkpoint, tp_size, ep_size, moe_dp_size, layers, up_first, layout_from, device, out, old_out,
              no_cache, as_json):
    """Fingerprint the TP shard of every expert a rank may hold, per the checkpoint."""
    import contextlib
    import json

    from moetrace.checkpoints.model_config import no_cache as config_cache_off
    from moetrace.outputs import probe_output

    out = _one_out(out, old_out)
    probe_output(out, "-o")  # whether a file there is an index (pyarrow) is asked while the hashing runs: make_index
    with config_cache_off() if no_cache else contextlib.nullcontext():  # neither the index cache nor the config cache
        summary = _index(checkpoint, tp_size, ep_size, moe_dp_size, layers, up_first, layout_from, device, out,
                         not no_cache, as_json)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        how = ("reused cached index" if summary["reused_cache"]
               else f"fingerprinted {summary['bytes_fingerprinted'] / 1e6:.1f} MB")
        click.echo(f"wrote {summary['rows']} rows to {summary['index']} ({how}, {summary['seconds']} s, "
                   f"checkpoint {summary['checkpoint_id']})")


def _index(checkpoint, tp_size, ep_size, moe_dp_size, layers, up_first, layout_from, device, out, use_cache,
           as_json) -> dict:
    from moetrace.checkpoints.index_build import make_index
    from moetrace.checkpoints.layout import ServerLayout
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.shard_cuts import check_split
    from moetrace.errors import MoetraceError
    from moetrace.schema import parse_ids

    ckpt = open_checkpoint(checkpoint)
    spec = ckpt.spec
    wanted = parse_ids(layers, "--layers", bound=spec.num_layers)
    check_split(tp_size, ep_size, moe_dp_size)
    if layout_from and up_first:
        raise MoetraceError("pass --up-first or --layout-from, not both")
    layout = ServerLayout(up_first=up_first)
    if layout_from:  # the trace's layout facts, read as the analysis reads every trace
        from moetrace.analysis.trace_layout import layout_of_trace

        layout = layout_of_trace([layout_from], spec)
    # one unit per (model, layer, moe_tp_rank); +1 layer for a draft model
    n_units = (len(wanted if wanted is not None else spec.moe_layers) + 1) * (tp_size // ep_size // moe_dp_size)
    show_bar = not as_json and sys.stderr.isatty()
    with click.progressbar(length=n_units, label="fingerprinting", file=sys.stderr) if show_bar else NullBar() as bar:
        summary = make_index(checkpoint, out, tp_size, ep_size, wanted, layout, device, use_cache, bar.update,
                             moe_dp_size, opened=ckpt)
    return summary


def _one_out(out: str | None, old_out: str | None) -> str:
    """-o/--out, or --output as scripts written before it was renamed spell it."""
    if out is not None and old_out is not None and out != old_out:
        raise click.UsageError("give -o/--out once (--output is its earlier spelling)")
    if out is None and old_out is None:
        raise click.UsageError("Missing option '-o' / '--out'.")
    return out if out is not None else old_out
