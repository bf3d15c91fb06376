"""`moetrace launch`: an SGLang or vLLM server with capture on (servers.launcher)."""

from __future__ import annotations

import sys

import click

from moetrace.commands.options import Seconds, capture_options, command, stderr, stop_options

EXAMPLES = (
    "moetrace launch --out /data/traces -- \\\n"
    "  python -m sglang.launch_server --model-path Qwen/Qwen3.5-122B-A10B-FP8 --tp 2",
    "moetrace launch --out /data/traces -- \\\n"
    "  python -m vllm.entrypoints.openai.api_server --model M --tensor-parallel-size 2",
)


@command("launch", EXAMPLES, context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@capture_options
@click.option("--server-flags", type=click.Choice(["auto", "split", "legacy"]), default="auto", show_default=True,
              help="How the server disables CUDA graphs: auto = the KT fork's distribution (sglang-kt) or the server's "
                   "own --help decides; split = --disable-prefill/decode-cuda-graph; legacy = --disable-cuda-graph.")
@click.option("--keep-cuda-graph", is_flag=True,
              help="Do not add the flags that disable CUDA graphs (hooks then miss graph-replayed steps; "
                   "vLLM: no --enforce-eager, so no resident capture under torch.compile).")
@click.option("--close-timeout", type=Seconds(0), default=20.0, show_default=True,
              help="Seconds to wait for the ranks to close their traces before stopping the server.")
@stop_options
@click.argument("server_cmd", nargs=-1, type=click.UNPROCESSED)
def launch_cmd(capture, server_flags, keep_cuda_graph, close_timeout, replace, stop_grace, server_cmd):
    """Run an SGLang or vLLM server with capture on; finalize the trace when it exits.

    SGLang: appends the moetrace --forward-hooks entry and the flags that turn CUDA graphs
    off (as the server spells them: --server-flags). vLLM (-m vllm.<module>, the vllm
    script): hands the hook config to moetrace's plugin in $MOETRACE_VLLM_CONFIG and adds
    --enforce-eager (hooks run only without torch.compile and CUDA graphs). Forwards
    SIGINT/SIGTERM (after asking every rank to close its trace) and writes
    OUT/<run_id>/_run.json. Exits with the server's exit code.
    """
    from moetrace.hooks.spec import DEFAULT_TARGETS
    from moetrace.servers.launcher import Launcher

    config, targets = capture.to_config()
    cmd = list(server_cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    launcher = Launcher(cmd, config, server_flags=server_flags, disable_cuda_graph=not keep_cuda_graph,
                        close_timeout_s=close_timeout, stop_grace_s=stop_grace, replace=replace, echo=stderr,
                        targets=targets or DEFAULT_TARGETS)
    sys.exit(launcher.run())
