"""`moetrace selftest`: proof on this machine that moetrace would catch the race (jobs.selftest)."""

from __future__ import annotations

import sys

import click

from moetrace.commands.options import Seconds, command, progress, stderr

EXAMPLES = (
    "moetrace selftest --device cuda --json > selftest.json",
    "moetrace selftest --server \"python -m sglang.launch_server --model-path M --tp 2 --port 30000\" \\\n"
    "    --index idx.parquet --workdir selftest-server --prompt-tokens 2048",
)


@command("selftest", EXAMPLES)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Device whose fingerprint path, staging transport and throughput are proven.")
@click.option("--quick", is_flag=True,
              help="Smaller sizes: the quick demo pair (8 experts), 32 MiB throughput buffers.")
@click.option("--only", type=click.Choice(["fingerprint", "detector", "throughput"]), multiple=True,
              help="Run only these parts (repeatable; default all).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Keep the synthetic checkpoint, traces and reports here (default: a temp dir, removed).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--server", "server_cmd", default=None, metavar="CMD",
              help="Prove the detector inside this server command instead (SGLang): one launch with injected faults "
                   "that the audit must name exactly, one clean launch that must pass (docs/selftest.md).")
@click.option("--index", default=None, type=click.Path(exists=True, dir_okay=False),
              help="--server: the index to audit against (default: built from the command's --model-path).")
@click.option("--checkpoint", default=None,
              help="--server: the checkpoint the server loads (default: its --model-path).")
@click.option("--requests", type=click.IntRange(min=1), default=3, show_default=True,
              help="--server: fresh prompts per launch.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=100, show_default=True,
              help="--server: words per fresh prompt (a KT server stages only above its threshold).")
@click.option("--replays", type=click.IntRange(min=0), default=1, show_default=True,
              help="--server: times each prompt is replayed with an extension.")
@click.option("--ready-timeout", type=Seconds(1), default=600.0, show_default=True,
              help="--server: seconds to wait for /health.")
def selftest_cmd(device, quick, only, workdir, as_json, server_cmd, index, checkpoint, requests, prompt_tokens,
                 replays, ready_timeout):
    """Prove on this machine that moetrace would catch the FP8 staging race.

    With --server CMD, prove it inside that server: faults injected before
    moetrace's capture (two experts swapped, a scale zeroed, another rank's
    shard, a late write through .data) must be named exactly, and a clean
    launch must pass.

    Exit 0: every proof holds. 1: a proof failed (named). 2: could not run
    (no CUDA, a server that did not serve, ...).
    """
    import json

    from moetrace.jobs import selftest as st
    from moetrace.outputs import check_writable_dir

    check_writable_dir(workdir, "--workdir")
    if server_cmd is not None:
        _server(server_cmd, workdir, index, checkpoint, requests, prompt_tokens, replays, ready_timeout, as_json)
    # each part's line as it ends, the verdict last
    on_proof = None if as_json else (lambda p: click.echo(p.line()))
    code, proofs = st.run_selftest(device, quick, workdir, tuple(only) or st.PARTS, on_proof=on_proof,
                                   progress=progress(as_json))
    if as_json:
        click.echo(json.dumps(st.as_json(code, proofs, device), indent=2))
    else:
        click.echo(st.verdict_line(code, proofs, device))
    sys.exit(code)


def _server(server_cmd, workdir, index, checkpoint, requests, prompt_tokens, replays, ready_timeout, as_json):
    import json
    import tempfile
    from pathlib import Path

    from moetrace.jobs.selftest_server import run_server_selftest
    from moetrace.jobs.traffic import Traffic

    traffic = Traffic(requests=requests, prompt_tokens=prompt_tokens, replays=replays, ready_timeout_s=ready_timeout)
    with tempfile.TemporaryDirectory(prefix="moetrace-selftest-server-") as tmp:
        folder = Path(workdir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        code, doc = run_server_selftest(server_cmd, folder, index, checkpoint, traffic, {}, stderr)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        for name in ("fault_run", "clean_run"):
            run = doc[name]
            mark = {True: "PASS", False: "FAIL", None: "SKIP"}[run["ok"]]
            click.echo(f"[{mark}] {name.replace('_', ' ')}: {run['detail']} (audit exit {run['audit_exit_code']})")
        click.echo(f"selftest --server: exit {int(code)} ({code.words})")
    sys.exit(code)
