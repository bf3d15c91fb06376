"""`moetrace demo`: the FP8 staging race found and its fix validated, end to end (jobs.demo)."""

from __future__ import annotations

import sys

import click

from moetrace.commands.options import command, cuda_or_refuse, progress

EXAMPLES = ("moetrace demo --workdir /tmp/moetrace-demo",)


@command("demo", EXAMPLES)
@click.option("--workdir", type=click.Path(file_okay=False), default="demo-out", show_default=True,
              help="Where the checkpoint, index, traces, reports and plots go: a new or empty folder, or one an "
                   "earlier demo made (its .moetrace-demo mark).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Run the emulated server's copies on this device.")
@click.option("--quick", is_flag=True, help="Smaller checkpoint (8 experts, H 256).")
@click.option("--transport", type=click.Choice(["auto", "fork", "emulator"]), default="auto", show_default=True,
              help="Who stages the layers: the installed sglang-kt's own code (fork; auto where installed) "
                   "or the emulator's.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary instead of text.")
@click.option("--sglang-python", default=None, metavar="PYTHON",
              help="Second act: the Python of a venv with SGLang 0.5.23's CPU path (make sglang-venv: "
                   ".venv-sglang/bin/python); the real server then runs at TP2 on this CPU with one fault "
                   "injected, which the audit must name. Without it the act is skipped in one line.")
@click.option("--server-pythonpath", default=None, metavar="DIR",
              help="Second act: folders put first on the server's PYTHONPATH (make demo: the import stand-ins "
                   "SGLang's CPU engine needs on a machine without CUDA, tests/support/sglang_cpu).")
def demo_cmd(workdir, device, quick, transport, as_json, sglang_python, server_pythonpath):
    """Find the FP8 staging race and validate its fix, end to end, on this machine.

    Generates a small Qwen3.5-style FP8 checkpoint, builds the index, runs the
    emulated TP2 KT staging server unfenced and fenced on the same requests with
    moetrace's hooks, analyzes both and writes reports and plots (plots skipped,
    said once, without matplotlib). Each run starts afresh: the work folder's
    earlier checkpoint, index, traces, reports and rank logs are replaced. Exit 0
    when the race is found unfenced and the fenced run passes (and, with
    --sglang-python, the fault injected in the real SGLang server is named).
    """
    from moetrace.errors import ExitCode
    from moetrace.jobs import demo
    from moetrace.outputs import check_writable_dir

    cuda_or_refuse(device)
    check_writable_dir(workdir, "--workdir")
    summary = demo.run_demo(workdir, device=device, quick=quick, transport=transport, progress=progress(as_json),
                            sglang_python=sglang_python, server_pythonpath=server_pythonpath)
    if as_json:
        click.echo(demo.to_json(summary))
    else:
        demo.print_demo(summary, click.echo)
    act = summary["server_act"]
    act_ok = act.get("skipped") is not None or act["ok"]
    sys.exit(ExitCode.PASS if summary["race_found"] and summary["fix_validated"] and act_ok else ExitCode.DIVERGENT)
