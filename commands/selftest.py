"""`moetrace selftest`: proof on this machine that moetrace would catch the race (jobs.selftest)."""

from __future__ import annotations

import sys

import click

from moetrace.commands.options import command, progress

EXAMPLES = ("moetrace selftest --device cuda --json > selftest.json",)


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
def selftest_cmd(device, quick, only, workdir, as_json):
    """Prove on this machine that moetrace would catch the FP8 staging race.

    Exit 0: every proof holds. 1: a proof failed (named). 2: could not run
    (no CUDA, ...).
    """
    import json

    from moetrace.jobs import selftest as st
    from moetrace.outputs import check_writable_dir

    check_writable_dir(workdir, "--workdir")
    # each part's line as it ends, the verdict last
    on_proof = None if as_json else (lambda p: click.echo(p.line()))
    code, proofs = st.run_selftest(device, quick, workdir, tuple(only) or st.PARTS, on_proof=on_proof,
                                   progress=progress(as_json))
    if as_json:
        click.echo(json.dumps(st.as_json(code, proofs, device), indent=2))
    else:
        click.echo(st.verdict_line(code, proofs, device))
    sys.exit(code)
