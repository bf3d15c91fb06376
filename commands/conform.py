"""`moetrace conform`: the installed fork's own staging code, run on CPU and audited (jobs.conform)."""

from __future__ import annotations

import sys

import click

from moetrace.commands.options import command, progress

EXAMPLES = (
    "moetrace conform                       # the fork as shipped: exit 1, rank 1 holds E+2",
    "moetrace conform --patch-fence         # the seed PR's fence on the same schedule: exit 0",
    "moetrace conform --format int4         # _prepare_weight_int4, judged before the Marlin repack: exit 1",
    "moetrace conform --fork-path ./my-fork/python --format bf16 --json-out bf16.json",
    "moetrace conform --releases 0.6.1..0.7.2 --json-out releases.json",
)


@command("conform", EXAMPLES)
@click.option("--fork-path", default=None, type=click.Path(path_type=str),
              help="sglang-kt to run: a pip --target folder, a site-packages or a source checkout "
                   "(default: the installed sglang-kt, or the one in the venv's kt-side folder).")
@click.option("--format", "fmt", type=click.Choice(["fp8_block", "fp8_channel", "bf16", "int4", "mxfp4", "mxfp8"]),
              default=None, help="Expert format; the fork's load picks its _prepare_weight_* path (default fp8_block; "
                                 "with --releases: every format). int4: weights judged before the Marlin repack, "
                                 "scales after SGLang's permute. mxfp4/mxfp8 are refused by name: moetrace cannot "
                                 "reproduce their post-staging layouts.")
@click.option("--tp", type=click.IntRange(2, 8), default=2, show_default=True, help="TP ranks (processes).")
@click.option("--experts", type=click.IntRange(3, 256), default=8, show_default=True, help="Experts in the layer.")
@click.option("--schedule", type=click.Choice(["slow-peer", "none"]), default="slow-peer", show_default=True,
              help="slow-peer: ranks > 0 read each host slot as late as the code allows (same result every run); "
                   "none: no delay (timing decides; a pass proves nothing).")
@click.option("--patch-fence", is_flag=True, help="Patch the seed PR's reader fence into the loaded class first.")
@click.option("--writer", type=click.Choice(["kt-kernel", "moetrace"]), default="kt-kernel", show_default=True,
              help="Rank 0's host-slot writer (kt-kernel: moetrace's when kt-kernel cannot run here, said so).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Keep the checkpoint, index, traces and rank logs here (default: a temp folder, removed).")
@click.option("--json-out", default=None, metavar="FILE",
              help="Write the JSON result (docs/conform.md) here, for every exit code.")
@click.option("--releases", default=None, metavar="SPEC",
              help="Run every sglang-kt release in SPEC (all, A..B, A,B) from the package index, each with its "
                   "kt-kernel, as installed and with --patch-fence; one table and one JSON document.")
@click.option("--cache", type=click.Path(file_okay=False, path_type=str), default=None,
              help="--releases: where the releases are installed (default ~/.cache/moetrace/conform-releases).")
def conform_cmd(fork_path, fmt, tp, experts, schedule, patch_fence, writer, workdir, json_out, releases, cache):
    """Run the installed fork's own staging code on CPU and audit what each rank holds.

    The real SharedFullContext.load of sglang-kt (read from its installed file)
    runs in TP gloo processes under a simulated CUDA runtime, rank 0's writer is
    kt-kernel's, moetrace's KT hook captures, the analysis judges. Exit 1: a rank
    holds wrong bytes; 0: every rank holds its shard; 2: it could not run.
    """
    from moetrace.errors import MoetraceError
    from moetrace.jobs.conform import CONFORM_JSON, Case, conform_main
    from moetrace.outputs import check_output_files, check_writable_dir

    check_output_files([("--json-out", json_out, CONFORM_JSON)])
    if releases is not None:
        from moetrace.jobs.conform_releases import releases_main

        for given, option in ((fork_path, "--fork-path"), (patch_fence or None, "--patch-fence"),
                              (workdir, "--workdir")):
            if given:
                raise MoetraceError(f"{option} does not go with --releases (each release runs as installed "
                                    f"and with --patch-fence, in a temporary folder)")
        sys.exit(releases_main(releases, (fmt,) if fmt else None, tp, experts, schedule, writer, cache, json_out,
                               echo=click.echo))
    if cache is not None:
        raise MoetraceError("--cache goes with --releases")
    check_writable_dir(workdir, "--workdir")
    case = Case(fmt or "fp8_block", schedule, patch_fence, writer, experts, fork_path)
    live = progress(False)
    with live.step(f"conform: the fork's staging code in {tp} TP ranks, then the analysis"):
        code = conform_main(case, tp, workdir, json_out, echo=lambda m: live.above(m, click.echo))
    sys.exit(code)
