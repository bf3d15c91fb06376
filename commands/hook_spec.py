"""`moetrace hook-spec`: the --forward-hooks JSON that turns capture on (hooks.spec)."""

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
)


@command("hook-spec", EXAMPLES)
@capture_options
@click.option("--pretty", is_flag=True, help="Indent the JSON.")
def hook_spec_cmd(capture, pretty):
    """Print the --forward-hooks JSON that turns capture on in an SGLang server."""
    import json

    from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec

    config, targets = capture.to_config()
    click.echo(json.dumps(hook_spec(config, targets or DEFAULT_TARGETS), indent=2 if pretty else None))
