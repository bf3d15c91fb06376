"""`moetrace audit`: analyze for CI, the exit code is the verdict; --launch runs the
server and its traffic first (jobs.audit, jobs.traffic)."""

from __future__ import annotations

import sys

import click

from moetrace.commands.options import Seconds, analysis_options, capture_option, command, progress, stderr, stop_options

EXAMPLES = (
    "moetrace audit /data/traces/nightly --checkpoint ./Qwen3.5-122B-A10B-FP8 --junit audit.xml",
    "moetrace audit --launch \"python -m sglang.launch_server --model-path M --tp 2 --port 30000\" \\\n"
    "    --checkpoint M --requests 3 --prompt-tokens 16384 --out /nightly --junit junit.xml --json-out audit.json",
)


@command("audit", EXAMPLES)
@click.option("--launch", "launch_cmd", default=None, metavar="CMD",
              help="Server command to launch with capture hooks (SGLang, the KT fork, vLLM or `moetrace serve`).")
@capture_option("out", default="moetrace-traces", required=False, show_default=True,
                help="Trace output folder or URL (--launch).")
@capture_option("run_id", help="Run id under OUT (--launch; default: a new timestamped id).")
@click.option("--requests", type=click.IntRange(min=1), default=3, show_default=True,
              help="Fresh long prompts to send (--launch).")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=None,
              help="Words per fresh prompt (~tokens; the emulator counts bytes) (--launch). Default: past the staging "
                   "threshold of a server that stages (--kt-gpu-prefill-token-threshold, `moetrace serve`'s), "
                   "else 2048.")
@click.option("--replays", type=click.IntRange(min=0), default=1, show_default=True,
              help="Times each prompt is replayed with an extension: prefix-cache hits (--launch).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=4, show_default=True,
              help="Tokens generated per request (--launch).")
@click.option("--base-url", default=None,
              help="Server URL (default: http://127.0.0.1:<--port of the command, else 30000; vLLM: 8000>).")
@click.option("--ready-timeout", type=Seconds(1), default=600.0, show_default=True,
              help="Seconds to wait for /health (--launch).")
@click.option("--hook-config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSON file of extra hook config keys (sampling etc., docs/capture.md) (--launch).")
@click.option("--server-flags", type=click.Choice(["auto", "split", "legacy"]), default="auto", show_default=True,
              help="How the launched server disables CUDA graphs (see `moetrace launch --help`) (--launch).")
@stop_options
@analysis_options(trace_required=False)
def audit_cmd(analysis, launch_cmd, out, run_id, requests, prompt_tokens, replays, max_tokens, base_url,
              ready_timeout, hook_config, server_flags, replace, stop_grace):
    """Like analyze, for CI: the exit code is the verdict.

    With --launch, the nightly job in one command: start the server with capture
    hooks, wait for health, send fresh long prompts and replayed prefixes, stop
    the server cleanly, analyze the run and write the reports.

    \b
    Exit codes:
      0  every expected entry in scope was captured and matches
      1  at least one captured entry diverges (wins over 2)
      2  incomplete or unusable: nothing captured, rows dropped, hook/sink
         errors, a rank missing, a manifest not finished, an unreadable part,
         an expected entry not captured, a checkpoint/TP/EP mismatch, or (with
         --launch) a server that never became healthy or failed requests; also
         any error, expected or not (one line on stderr)
      3  the verdict was a pass but a report file could not be written
    """
    from moetrace.jobs.audit import LaunchOptions, run_audit
    from moetrace.jobs.traffic import Traffic
    from moetrace.tracer.capture_options import read_config_file

    launch = None
    if launch_cmd:
        traffic = Traffic(requests=requests, prompt_tokens=prompt_tokens, replays=replays, max_tokens=max_tokens,
                          ready_timeout_s=ready_timeout)
        extra = read_config_file(hook_config, "--hook-config") if hook_config else {}
        launch = LaunchOptions(command=launch_cmd, out=out, run_id=run_id, traffic=traffic, base_url=base_url,
                               hook_config=extra, server_flags=server_flags, replace=replace, stop_grace_s=stop_grace)
    live = progress(analysis.as_json)
    lines = (lambda m: None) if analysis.as_json else (lambda m: live.above(m, stderr))
    sys.exit(run_audit(analysis, launch, click.echo, lines, warn=stderr, live=live))
