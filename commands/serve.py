"""`moetrace serve`: the emulated TP KT-staging server on loopback (emulator.launcher)."""

from __future__ import annotations

import sys

import click

from moetrace.commands.options import SEED, Seconds, command, cuda_or_refuse

EXAMPLES = (
    "moetrace make-checkpoint -o /tmp/ckpt",
    "moetrace serve /tmp/ckpt --tp 2 --fence none --port 30000 \\\n"
    "  --forward-hooks \"$(moetrace hook-spec --out /tmp/traces)\"",
    "curl -s localhost:30000/v1/completions -d '{\"prompt\": \"hello\", \"max_tokens\": 4}'",
    "curl -s -X POST localhost:30000/shutdown",
)


@command("serve", EXAMPLES)
@click.argument("checkpoint", required=False, type=click.Path(file_okay=False, path_type=str))
@click.option("--model-path", "model_path", default=None, type=click.Path(file_okay=False, path_type=str),
              help="Checkpoint directory (alternative to the CHECKPOINT argument, as SGLang spells it).")
@click.option("--tp", "--tp-size", "tp", type=click.IntRange(min=1), default=2, show_default=True,
              help="Tensor-parallel ranks (one process each).")
@click.option("--fence", type=click.Choice(["none", "all"]), default="none", show_default=True,
              help="none: the fork as it is (racy); all: the seed PR's reader fences.")
@click.option("--slow-rank", type=int, default=1, show_default=True,
              help="Rank whose last copy of each expert (w2_weight_scale_inv) is held back "
                   "deterministically; -1: no injection (natural timing).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Loopback address to serve on.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=0, show_default=True,
              help="HTTP port; 0 picks a free one (printed).")
@click.option("--chunk-tokens", "--chunked-prefill-size", "chunk_tokens", type=click.IntRange(min=1), default=32,
              show_default=True, help="Prefill chunk size in tokens.")
@click.option("--prefill-threshold", "--kt-gpu-prefill-token-threshold", "prefill_threshold",
              type=click.IntRange(min=1), default=8, show_default=True,
              help="Passes with at least this many tokens stage the full layer (KT long-prefill path).")
@click.option("--forward-hooks", default=None, help="SGLang-style JSON list of hook specs "
              '([{"name", "target_modules", "hook_factory": "pkg.mod:fn", "config"}]).')
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu: threads stand in for copy streams; cuda: copy stream, events, pinned slots.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the synthetic non-expert weights.")
@click.option("--op-timeout", type=Seconds(0.1), default=30.0, show_default=True,
              help="Seconds any staging wait may take before the server fails with a clear error.")
@click.option("--ready-file", default=None, type=click.Path(dir_okay=False, path_type=str),
              help='Write {"url", "port", "pid", "rank_pids", "shm_prefix", "tp", "fence"} here once listening.')
@click.option("--disable-cuda-graph", "--disable-prefill-cuda-graph", "--disable-decode-cuda-graph",
              "cuda_graph_flags", is_flag=True, hidden=True, help="Accepted for SGLang compatibility; no effect.")
def serve_cmd(checkpoint, model_path, tp, fence, slow_rank, host, port, chunk_tokens, prefill_threshold,
              forward_hooks, device, seed, op_timeout, ready_file, cuda_graph_flags):
    """Serve an emulated TP KT-staging server (OpenAI /v1/completions) on loopback.

    Each rank is a process; rank 0 stages every MoE layer's experts through
    POSIX shared-memory host slots exactly like KTransformers' SGLang fork, with
    the reader fence off (--fence none) or on (--fence all). Stops on POST
    /shutdown, SIGTERM or Ctrl-C, and always removes its shared memory.
    """
    from moetrace.emulator.config import as_config
    from moetrace.emulator.forward_hooks import parse_forward_hooks
    from moetrace.emulator.launcher import READY_FILE, serve
    from moetrace.errors import MoetraceError
    from moetrace.outputs import check_output_files

    path = checkpoint or model_path
    if not path:
        raise MoetraceError("serve: give the checkpoint directory (CHECKPOINT or --model-path)")
    cuda_or_refuse(device)
    check_output_files([("--ready-file", ready_file, READY_FILE)])
    cfg = as_config(path, tp=tp, fence=fence, slow_rank=None if slow_rank < 0 else slow_rank, host=host, port=port,
                    chunk_tokens=chunk_tokens, prefill_threshold=prefill_threshold, device=device, seed=seed,
                    forward_hooks=parse_forward_hooks(forward_hooks), op_timeout_s=op_timeout)
    sys.exit(serve(cfg, echo=lambda m: click.echo(m, err=m.startswith("moetrace serve: rank")), ready_file=ready_file))
