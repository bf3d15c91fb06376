"""`moetrace hook-spec`: the --forward-hooks JSON that turns capture on (hooks.spec), or for
vLLM the hook config object its plugin reads from $MOETRACE_VLLM_CONFIG (hooks.vllm.plugin)."""

from __future__ import annotations

import click

from moetrace.commands.options import capture_options, command

EXAMPLES = (
    "python -m sglang.launch_server --model-path M --tp 2 \\\n"
    "  --disable-prefill-cuda-graph --disable-decode-cuda-graph \\\n"
    "  --forward-hooks \"$(moetrace hook-spec --out /data/traces --layers 0-3)\"",
    "# in production: the guard, metrics on SGLang's /metrics\n"
    "python -m sglang.launch_server --model-path M --tp 2 --enable-metrics \\\n"
    "  --forward-hooks \"$(moetrace hook-spec --out /data/traces --index idx.parquet --guard alert)\"",
    "# vLLM: the plugin reads the config from the environment; hooks need eager mode\n"
    "MOETRACE_VLLM_CONFIG=\"$(moetrace hook-spec --server vllm --out /data/traces)\" \\\n"
    "  python -m vllm.entrypoints.openai.api_server --model M --tensor-parallel-size 2 --enforce-eager",
)


@command("hook-spec", EXAMPLES)
@capture_options
@click.option("--server", type=click.Choice(["sglang", "vllm"]), default="sglang", show_default=True,
              help="sglang: the --forward-hooks list; vllm: the hook config object for $MOETRACE_VLLM_CONFIG "
                   "(moetrace's vLLM plugin reads it in every worker).")
@click.option("--pretty", is_flag=True, help="Indent the JSON.")
def hook_spec_cmd(capture, server, pretty):
    """Print the JSON that turns capture on in an SGLang (--forward-hooks) or vLLM server."""
    import json

    from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec
    from moetrace.outputs import check_output

    config, targets = capture.to_config()
    check_output(config["out"], "--out", kind="dir")  # as launch: never a trace written through a link
    spec = hook_spec(config, targets or DEFAULT_TARGETS)
    click.echo(json.dumps(spec[0]["config"] if server == "vllm" else spec, indent=2 if pretty else None))
