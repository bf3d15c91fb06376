"""moetrace command line: one click group over checkpoints, tracer, hooks and analysis."""

from __future__ import annotations

import functools
import os
import sys

import click

from moetrace import __version__
from moetrace.errors import ExitCode, MoetraceError


class _Group(click.Group):
    """Every failure is one line on stderr and a non-zero exit, never a traceback:
    MoetraceError with its exit code, a usage error with 2, an OSError (disk, permission,
    network) with 2, any unexpected error with 2 (1 is reserved for "divergence found"),
    Ctrl-C with 130. MOETRACE_DEBUG=1 re-raises
    unexpected errors, for the traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MoetraceError as err:
            click.echo(f"moetrace: error: {err}", err=True)
            sys.exit(err.exit_code)
        except click.UsageError as err:  # bad options of a command: one line too
            where = err.ctx.command_path if err.ctx is not None else "moetrace"
            msg = " ".join(err.format_message().split())
            click.echo(f"moetrace: error: {msg} (see '{where} --help')", err=True)
            sys.exit(ExitCode.INCOMPLETE)
        except (click.exceptions.Exit, click.Abort):
            raise
        except click.ClickException as err:
            click.echo(f"moetrace: error: {' '.join(err.format_message().split())}", err=True)
            sys.exit(ExitCode.INCOMPLETE)
        except KeyboardInterrupt:
            click.echo("moetrace: interrupted", err=True)
            sys.exit(ExitCode.INTERRUPTED)
        except OSError as err:  # the machine's or the network's answer (disk, permission, endpoint): not a bug
            if os.environ.get("MOETRACE_DEBUG"):
                raise
            from moetrace.storage import remote_reason

            click.echo(f"moetrace: error: {remote_reason(err)}", err=True)
            sys.exit(ExitCode.INCOMPLETE)
        except Exception as err:
            if os.environ.get("MOETRACE_DEBUG"):
                raise
            why = " ".join(str(err).split()) or "no message"
            click.echo(f"moetrace: error: unexpected {type(err).__name__}: {why} "
                       "(a moetrace bug: please report it; MOETRACE_DEBUG=1 shows the traceback)", err=True)
            sys.exit(ExitCode.INCOMPLETE)


class Seconds(click.ParamType):
    """A duration option: a finite number of seconds >= minimum (NaN or inf would make a
    wait endless or a deadline never reached)."""

    name = "seconds"

    def __init__(self, minimum: float = 0.0):
        self.minimum = minimum

    def convert(self, value, param, ctx):
        from moetrace.storage import finite_seconds

        if isinstance(value, float):
            return value
        try:
            return finite_seconds(value, "/".join(param.opts) if param else "seconds", self.minimum)
        except MoetraceError as err:
            self.fail(str(err).split(": ", 1)[-1], param, ctx)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="moetrace")
def main() -> None:
    """Trace MoE expert weights from checkpoint to GPU and find where they diverge."""


def _stderr(message: str) -> None:
    click.echo(message, err=True)


SEED = click.IntRange(-(2**63), 2**63 - 1)  # what torch.Generator.manual_seed takes


def _writable_dir(path: str | None, option: str) -> None:
    from moetrace.outputs import check_writable_dir

    check_writable_dir(path, option)


def _output_files(pairs: list[tuple[str, str | None]], probe: bool = True) -> None:
    from moetrace.outputs import check_output_files

    check_output_files(pairs, probe)


def _progress(as_json: bool):
    """Live progress lines on stderr: on a terminal only, never with --json."""
    from moetrace.jobs.progress import Progress

    return Progress.off() if as_json else Progress(stream=sys.stderr)


# Commands register themselves below, one section per area of the data flow.
# ---- checkpoints: make-checkpoint ------------------------------------------
@main.command("make-checkpoint")
@click.option("--family", type=click.Choice(["qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3"]),
              default="qwen3_5_moe", show_default=True, help="Model family: sets architecture, config keys and tensor names.")
@click.option("--format", "fmt", type=click.Choice(["fp8_block", "fp8_channel", "fp8_tensor", "bf16"]), default="fp8_block",
              show_default=True, help="Expert weight format: FP8 with block, per-channel or per-tensor scales, or BF16.")
@click.option("--quant-method", type=click.Choice(["fp8", "compressed-tensors"]), default=None,
              help="quantization_config.quant_method [default: compressed-tensors for fp8_channel, else fp8].")
@click.option("--block", default="128", show_default=True,
              help="fp8_block scale block: N (N x N) or N,K (block_n over output rows, block_k over input columns).")
@click.option("--fused", is_flag=True, help="BF16 only: write fused 3-D mlp.experts.gate_up_proj/down_proj (Qwen3.5 BF16 layout).")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True,
              help="num_hidden_layers, dense layers included.")
@click.option("--experts", type=click.IntRange(min=1), default=8, show_default=True, help="Routed experts per MoE layer.")
@click.option("--hidden", type=click.IntRange(min=1), default=256, show_default=True, help="hidden_size.")
@click.option("--intermediate", type=click.IntRange(min=1), default=256, show_default=True,
              help="moe_intermediate_size; I/TP must be a multiple of 128 for fp8_block.")
@click.option("--scale-dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="bfloat16",
              show_default=True, help="Stored dtype of FP8 scales (SGLang holds them as float32).")
@click.option("--files", type=click.IntRange(min=1), default=2, show_default=True,
              help="Safetensors files; >1 writes model.safetensors.index.json.")
@click.option("--dense-layers", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leading dense layers (first_k_dense_replace / mlp_only_layers).")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Changes every value (synthetic_values seed).")
@click.option("-o", "--out", required=True, help="New or empty output directory (written whole or not at all).")
@click.option("--json", "as_json", is_flag=True, help='Print {"path": ..., "identity": ...} instead of the path.')
def make_checkpoint(family, fmt, quant_method, block, fused, layers, experts, hidden, intermediate, scale_dtype, files,
                    dense_layers, seed, out, as_json) -> None:  # fmt: skip
    """Write a small synthetic MoE checkpoint with real names, dtypes and layout.

    Every expert element is a known function of (layer, expert, projection, row,
    column) (moetrace.checkpoints.synthetic.synthetic_values), so expected TP
    shards and wrong-expert bytes can be checked without real weights.

    \b
    Example:
      moetrace make-checkpoint --family qwen3_5_moe --format fp8_block \\
          --experts 16 --intermediate 512 --files 3 -o /tmp/qwen35-tiny
    """
    # Imported here so `moetrace --help` does not pay for torch/safetensors.
    import json

    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint

    try:
        sizes = tuple(int(b) for b in block.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) not in (1, 2):
        raise MoetraceError(f"--block {block!r}: expected N or N,K (positive integers)")
    _fits_in_memory(layers - dense_layers, experts, hidden, intermediate, 2 if fmt == "bf16" else 1)
    path = write_synthetic_checkpoint(
        out, family=family, fmt=fmt, num_layers=layers, num_experts=experts, hidden=hidden, intermediate=intermediate,
        scale_dtype=scale_dtype, num_files=files, dense_layers=dense_layers, seed=seed, fused=fused,
        quant_method=quant_method, block=sizes if len(sizes) == 2 else sizes[0],
    )  # fmt: skip
    if as_json:
        with open_checkpoint(path) as ckpt:
            click.echo(json.dumps({"path": str(path), "identity": ckpt.identity}))
    else:
        click.echo(str(path))


# ---- tracer: index ----------------------------------------------------------


@main.command("index")
@click.argument("checkpoint", type=click.Path(file_okay=False, path_type=str))
@click.option("--tp", "tp_size", type=click.IntRange(min=1), required=True, help="Tensor-parallel size of the server.")
@click.option("--ep", "ep_size", type=click.IntRange(min=1), default=1, show_default=True, help="Expert-parallel size.")
@click.option("--moe-dp", "moe_dp_size", type=click.IntRange(min=1), default=1, show_default=True,
              help="The server's --moe-dp-size (moe_tp = tp / ep / moe_dp).")
@click.option("--layers", default=None, help="MoE layers to index, e.g. 0,2,5-7 (default: all MoE layers).")
@click.option("--up-first", is_flag=True, help="w13 holds up rows before gate rows (flashinfer-trtllm runner).")
@click.option("--layout-from", "layout_from", default=None, metavar="TRACE",
              help="Build for the layout a trace recorded (order, padding, reproduced transforms; docs/compat.md).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where to fingerprint (auto: CUDA when present); the digests are bit-identical on both.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=str), help="Index Parquet file to write.")
@click.option("--no-cache", is_flag=True, help="Rebuild even if the cache holds this index.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of text; no progress bar.")
def index_cmd(checkpoint, tp_size, ep_size, moe_dp_size, layers, up_first, layout_from, device, output, no_cache,
              as_json):
    """Fingerprint the TP shard of every expert a rank may hold, per the checkpoint.

    \b
    Example:
      moetrace index ./Qwen3.5-122B-A10B-FP8 --tp 2 -o index.parquet
    """
    import json

    from moetrace.checkpoints.index_build import make_index
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.schema import parse_ids

    from moetrace.checkpoints.layout import ServerLayout

    spec = open_checkpoint(checkpoint).spec
    wanted = parse_ids(layers, "--layers", bound=spec.num_layers)
    if tp_size % (ep_size * moe_dp_size):
        raise MoetraceError(f"--tp {tp_size} is not divisible by --ep {ep_size} x --moe-dp {moe_dp_size}")
    if layout_from and up_first:
        raise MoetraceError("pass --up-first or --layout-from, not both")
    layout = ServerLayout(up_first=up_first)
    if layout_from:
        from moetrace.analysis.trace_layout import layout_of_trace

        layout = layout_of_trace([layout_from], spec)
    # one unit per (model, layer, moe_tp_rank); +1 layer for a draft model
    n_units = (len(wanted if wanted is not None else spec.moe_layers) + 1) * (tp_size // ep_size // moe_dp_size)
    show_bar = not as_json and sys.stderr.isatty()
    with click.progressbar(length=n_units, label="fingerprinting", file=sys.stderr) if show_bar else _NullBar() as bar:
        summary = make_index(checkpoint, output, tp_size, ep_size, wanted, layout, device, not no_cache, bar.update,
                             moe_dp_size)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        how = "reused cached index" if summary["reused_cache"] else f"fingerprinted {summary['bytes_fingerprinted'] / 1e6:.1f} MB"
        click.echo(f"wrote {summary['rows']} rows to {summary['index']} ({how}, {summary['seconds']} s, "
                   f"checkpoint {summary['checkpoint_id']})")


def _fits_in_memory(moe_layers: int, experts: int, hidden: int, intermediate: int, itemsize: int) -> None:
    """make-checkpoint holds every tensor in memory before writing: refuse sizes past
    half of the machine's memory, in one line, before allocating any."""
    need = max(moe_layers, 1) * (experts + 1) * 3 * hidden * intermediate * itemsize
    try:
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return
    if need > available // 2:
        raise MoetraceError(f"make-checkpoint: --layers/--experts/--hidden/--intermediate need about "
                            f"{need / 2**30:,.1f} GiB of expert weights in memory, more than half of this "
                            f"machine's {available / 2**30:,.1f} GiB; give smaller sizes")


class _NullBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        pass

# ---- hooks: hook-spec, launch -----------------------------------------------
def _capture_options(f):
    """Options shared by hook-spec and launch: they become the hook config."""
    opts = [
        click.option("-o", "--out", required=True, help="Trace output: a folder or a pyarrow/fsspec URL (file://, s3://...)."),
        click.option("--run-id", default=None, help="Run id (folder under OUT); default: a new timestamped id."),
        click.option("--checkpoint-id", default=None, help="Checkpoint identity to record (default: the index's, if --index)."),
        click.option("--layers", default=None, help="MoE layers to capture, e.g. 0,2,40-47 (default: all)."),
        click.option("--experts", default=None, help="Global expert ids to capture, e.g. 0-15 (default: all)."),
        click.option("--tensors", default=None, help="Param names to capture, e.g. w2_weight,w2_weight_scale_inv (default: all)."),
        click.option("--sources", default=None, help="resident, staged or both (default: resident,staged)."),
        click.option("--every", "every_n_steps", type=click.IntRange(min=1), default=None, help="Capture every Nth step (default 1)."),
        click.option("--first", "first_n_steps", type=click.IntRange(min=0), default=None,
                     help="Capture steps 0..N-1 only, then close the trace (default: all steps)."),
        click.option("--index", default=None, help="Index Parquet (moetrace index) for online verification."),
        click.option("--chunk-digests", type=click.Choice(["all", "mismatch", "none"]), default=None,
                     help="Rows that record their chunk digests (default all; mismatch needs --index)."),
        click.option("--dump-max-count", type=click.IntRange(min=0), default=None,
                     help="Dump up to N mismatching tensors as safetensors (needs --index; default 0)."),
        click.option("--dump-max-bytes", type=click.IntRange(min=0), default=None, help="Byte cap of all dumps (default 256 MiB)."),
        click.option("--guard", type=click.Choice(["record", "alert", "fail-closed"]), default=None,
                     help="Verify every staged load and resident weight change on the device against --index; on a "
                          "mismatch record it, also log an ERROR (alert), or fail the forward pass (fail-closed). "
                          "docs/guard.md."),
        click.option("--guard-rows", type=click.Choice(["mismatch", "all"]), default=None,
                     help="Trace rows of guarded captures: mismatches only (default) or all."),
        click.option("--metrics-port", type=click.IntRange(min=0, max=65535), default=None,
                     help="Serve the guard's Prometheus metrics on 127.0.0.1:PORT+tp_rank (0: any free port; "
                          "unneeded with SGLang's --enable-metrics, whose /metrics shows them)."),
        click.option("--update-index-dir", default=None,
                     help="Folder of indexes of checkpoints the server may load with update_weights_from_disk: "
                          "the guard re-verifies against the one built from the new model path."),
        click.option("--queue-size", type=click.IntRange(min=1), default=None, help="Capture batches queued for the writer (default 1024)."),
        click.option("--max-hook-errors", type=click.IntRange(min=1), default=None,
                     help="Disable tracing after N errors (default 10)."),
        click.option("--kt", type=click.Choice(["auto", "on", "off"]), default=None,
                     help="Wrap KT's SharedFullContext.load (default auto: when the server loaded the KT wrapper)."),
        click.option("--target", "targets", multiple=True,
                     help="fnmatch pattern of FusedMoE module names (repeatable; default model.layers.*.mlp.experts "
                          "and model.language_model.layers.*.mlp.experts)."),
        click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="JSON file of hook config keys (docs/capture.md); options given here override it."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _json_object(path: str, option: str) -> dict:
    """A JSON file of hook config keys, or a one-line error naming the option."""
    import json

    try:
        with open(path) as fh:
            config = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise MoetraceError(f"{option} {path}: not a JSON object of hook config keys ({err})") from None
    if not isinstance(config, dict):
        raise MoetraceError(f"{option} {path}: expected a JSON object of hook config keys")
    return config


def _capture_config(kw: dict) -> tuple[dict, tuple[str, ...]]:

    path = kw.pop("config_file", None)
    config = _json_object(path, "--config") if path else {}
    targets = tuple(kw.pop("targets", ()) or ())
    kt = kw.pop("kt", None)
    if kt is not None:
        config["kt"] = {"auto": "auto", "on": True, "off": False}[kt]
    config.update({k: v for k, v in kw.items() if v is not None})
    return config, targets


@main.command("hook-spec")
@_capture_options
@click.option("--pretty", is_flag=True, help="Indent the JSON.")
def hook_spec_cmd(pretty, **kw):
    """Print the --forward-hooks JSON that turns capture on in an SGLang server.

    \b
    Example:
      python -m sglang.launch_server --model-path M --tp 2 \\
        --disable-prefill-cuda-graph --disable-decode-cuda-graph \\
        --forward-hooks "$(moetrace hook-spec --out /data/traces --layers 0-3)"
      # in production: the guard, metrics on SGLang's /metrics
      python -m sglang.launch_server --model-path M --tp 2 --enable-metrics \\
        --forward-hooks "$(moetrace hook-spec --out /data/traces --index idx.parquet --guard alert)"
    """
    import json

    from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec

    config, targets = _capture_config(kw)
    spec = hook_spec(config, targets or DEFAULT_TARGETS)
    click.echo(json.dumps(spec, indent=2 if pretty else None))


def _stop_options(f):
    """Options of every command that launches a server: run-id reuse and how it is stopped."""
    f = click.option("--stop-grace", type=Seconds(0), default=30.0, show_default=True,
                     help="Seconds the server's process group gets after the stop signal before it is killed "
                          "(a second Ctrl-C kills at once).")(f)
    return click.option("--replace", is_flag=True,
                        help="Delete an existing OUT/<run_id> first; without it a used run id is refused.")(f)


@main.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_capture_options
@click.option("--server-flags", type=click.Choice(["auto", "split", "legacy"]), default="auto", show_default=True,
              help="How the server disables CUDA graphs: auto = the KT fork's distribution (sglang-kt) or the server's "
                   "own --help decides; split = --disable-prefill/decode-cuda-graph; legacy = --disable-cuda-graph.")
@click.option("--keep-cuda-graph", is_flag=True,
              help="Do not add the flags that disable CUDA graphs (hooks then miss graph-replayed steps).")
@click.option("--close-timeout", type=Seconds(0), default=20.0, show_default=True,
              help="Seconds to wait for the ranks to close their traces before stopping the server.")
@_stop_options
@click.argument("server_cmd", nargs=-1, type=click.UNPROCESSED)
def launch_cmd(server_flags, keep_cuda_graph, close_timeout, replace, stop_grace, server_cmd, **kw):
    """Run an SGLang server with capture on; finalize the trace when it exits.

    Appends the moetrace --forward-hooks entry and the flags that turn CUDA graphs
    off (as the server spells them: --server-flags), forwards SIGINT/SIGTERM (after asking every rank to close its
    trace) and writes OUT/<run_id>/_run.json. Exits with the server's exit code.

    \b
    Example:
      moetrace launch --out /data/traces -- \\
        python -m sglang.launch_server --model-path Qwen/Qwen3.5-122B-A10B-FP8 --tp 2
    """
    from moetrace.servers.launcher import Launcher
    from moetrace.hooks.spec import DEFAULT_TARGETS

    config, targets = _capture_config(kw)
    cmd = list(server_cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    launcher = Launcher(cmd, config, server_flags=server_flags, disable_cuda_graph=not keep_cuda_graph,
                        close_timeout_s=close_timeout, stop_grace_s=stop_grace, replace=replace, echo=_stderr,
                        targets=targets or DEFAULT_TARGETS)
    sys.exit(launcher.run())


# ---- analysis: analyze, diff, audit -----------------------------------------
def _analysis_options(f, trace_required: bool = True):
    """Options shared by analyze and audit."""
    opts = [
        click.argument("trace", nargs=-1, required=trace_required),
        click.option("--index", "index_path", default=None, metavar="FILE",
                     help="Expected-fingerprint index Parquet (moetrace index)."),
        click.option("--checkpoint", default=None, metavar="CKPT",
                     help="Checkpoint folder: build (or reuse from the cache) the index for the trace's TP/EP."),
        click.option("--json", "as_json", is_flag=True, help="Print the JSON report (docs/analysis.md) instead of text."),
        click.option("--json-out", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                     help="Also write the JSON report to FILE."),
        click.option("--markdown", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                     help="Also write a Markdown report."),
        click.option("--junit", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                     help="Also write JUnit XML: one test case per (run, rank, layer, source)."),
        click.option("--plot", type=click.Path(dir_okay=False), default=None, metavar="FILE.png|.svg|.pdf",
                     help="Also write a picture: per rank, a layer x expert grid coloured by verdict."),
        click.option("--max-lines", type=click.IntRange(min=1), default=20, show_default=True,
                     help="Summary lines shown in the terminal."),
        click.option("--max-rows", type=click.IntRange(min=0), default=1000, show_default=True,
                     help="Divergent entries listed in the JSON/Markdown reports."),
        click.option("--remote-timeout", type=Seconds(0.001), default=None,
                     help="Seconds a remote trace or index (s3://, gs://...) may take to connect or answer one "
                          "request [default: $MOETRACE_REMOTE_TIMEOUT, else 20]."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


@main.command("analyze")
@_analysis_options
def analyze_cmd(**kw):
    """Give every captured tensor a verdict and find the first divergence.

    TRACE is a run folder OUT/<run_id>, an OUT folder of several runs, a glob
    or a pyarrow filesystem URL. Verdicts: match, stale (E+k), wrong_rank,
    wrong_layer, wrong_tensor, zeros, constant, torn, unknown, unexpected, and
    per load missing. Exit 0 when the analysis ran (findings are printed),
    2 on unusable input, 3 when a report file could not be written.
    docs/analysis.md explains every verdict and exit code.

    \b
    Example:
      moetrace analyze /data/traces/unfenced --index index.parquet --plot grid.png
    """
    from moetrace.jobs.audit import exit_code, run_analysis

    opts = _analysis_opts(kw)
    _, written = run_analysis("analyze", opts, click.echo, warn=_stderr, live=_progress(opts.as_json))
    sys.exit(exit_code(ExitCode.PASS, written))


def _analysis_opts(kw: dict):
    """The analysis options of analyze/audit, popped from the command's keyword arguments."""
    from moetrace.jobs.audit import AnalysisOptions, ReportFiles

    from moetrace.storage import set_remote_timeout

    set_remote_timeout(kw.pop("remote_timeout"))
    reports = ReportFiles(**{k: kw.pop(k) for k in ("json_out", "markdown", "junit", "plot")})
    _output_files([("--json-out", reports.json_out), ("--markdown", reports.markdown), ("--junit", reports.junit),
                   ("--plot", reports.plot)], probe=False)
    return AnalysisOptions(trace=tuple(kw.pop("trace")), index=kw.pop("index_path"), checkpoint=kw.pop("checkpoint"),
                           as_json=kw.pop("as_json"), reports=reports, max_lines=kw.pop("max_lines"),
                           max_rows=kw.pop("max_rows"))


def _launch_options(f):
    """audit --launch: run the server with hooks, drive traffic, stop, analyze."""
    opts = [
        click.option("--launch", "launch_cmd", default=None, metavar="CMD",
                     help="Server command to launch with capture hooks (SGLang, the KT fork or `moetrace serve`)."),
        click.option("--out", default="moetrace-traces", show_default=True, help="Trace output folder or URL (--launch)."),
        click.option("--run-id", default=None, help="Run id under OUT (--launch; default: a new timestamped id)."),
        click.option("--requests", type=click.IntRange(min=1), default=3, show_default=True,
                     help="Fresh long prompts to send (--launch)."),
        click.option("--prompt-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
                     help="Words per fresh prompt (~tokens; the emulator counts bytes) (--launch)."),
        click.option("--replays", type=click.IntRange(min=0), default=1, show_default=True,
                     help="Times each prompt is replayed with an extension: prefix-cache hits (--launch)."),
        click.option("--max-tokens", type=click.IntRange(min=1), default=4, show_default=True,
                     help="Tokens generated per request (--launch)."),
        click.option("--base-url", default=None,
                     help="Server URL (default: http://127.0.0.1:<--port of the command, else 30000>)."),
        click.option("--ready-timeout", type=Seconds(1), default=600.0, show_default=True,
                     help="Seconds to wait for /health (--launch)."),
        click.option("--hook-config", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="JSON file of extra hook config keys (sampling etc., docs/capture.md) (--launch)."),
        click.option("--server-flags", type=click.Choice(["auto", "split", "legacy"]), default="auto", show_default=True,
                     help="How the launched server disables CUDA graphs (see `moetrace launch --help`) (--launch)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return _stop_options(f)


@main.command("audit")
@_launch_options
@functools.partial(_analysis_options, trace_required=False)
def audit_cmd(**kw):
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

    \b
    Examples:
      moetrace audit /data/traces/nightly --checkpoint ./Qwen3.5-122B-A10B-FP8 --junit audit.xml
      moetrace audit --launch "python -m sglang.launch_server --model-path M --tp 2 --port 30000" \\
          --checkpoint M --requests 3 --prompt-tokens 16384 --out /nightly --junit junit.xml --json-out audit.json
    """
    from moetrace.jobs.audit import LaunchOptions, run_audit
    from moetrace.jobs.traffic import Traffic

    opts = _analysis_opts(kw)
    launch = None
    if kw["launch_cmd"]:
        traffic = Traffic(**{k: kw[k] for k in ("requests", "prompt_tokens", "replays", "max_tokens")},
                          ready_timeout_s=kw["ready_timeout"])
        hook_config = _json_object(kw["hook_config"], "--hook-config") if kw["hook_config"] else {}
        launch = LaunchOptions(command=kw["launch_cmd"], out=kw["out"], run_id=kw["run_id"], traffic=traffic,
                               base_url=kw["base_url"], hook_config=hook_config, server_flags=kw["server_flags"],
                               replace=kw["replace"], stop_grace_s=kw["stop_grace"])
    live = _progress(opts.as_json)
    progress = (lambda m: None) if opts.as_json else (lambda m: live.above(m, _stderr))
    sys.exit(run_audit(opts, launch, click.echo, progress, warn=_stderr, live=live))


@main.command("diff")
@click.argument("run_a")
@click.argument("run_b")
@click.option("--index", "index_path", default=None, metavar="FILE",
              help="Index Parquet: also compare verdicts (e.g. E+2 -> match).")
@click.option("--checkpoint", default=None, metavar="CKPT", help="Checkpoint folder, as for analyze.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON diff (docs/analysis.md).")
@click.option("--max-lines", type=click.IntRange(min=1), default=20, show_default=True, help="Change groups shown.")
def diff_cmd(run_a, run_b, index_path, checkpoint, as_json, max_lines):
    """Compare the same (step, layer, rank, source, expert, tensor) across two runs.

    \b
    Example:
      moetrace diff /data/traces/unfenced /data/traces/fenced --index index.parquet
    """
    import json

    from moetrace.analysis.diff import diff, diff_text

    doc = diff(run_a, run_b, index=index_path, checkpoint=checkpoint)
    click.echo(json.dumps(doc, indent=1) if as_json else diff_text(doc, max_lines=max_lines))


# ---- emulator: demo, serve ---------------------------------------------------
@main.command("demo")
@click.option("--workdir", type=click.Path(file_okay=False), default="demo-out", show_default=True,
              help="Where the checkpoint, index, traces, reports and plots go.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Run the emulated server's copies on this device.")
@click.option("--quick", is_flag=True, help="Smaller checkpoint (8 experts, H 256).")
@click.option("--transport", type=click.Choice(["auto", "fork", "emulator"]), default="auto", show_default=True,
              help="Who stages the layers: the installed sglang-kt's own code (fork; auto where installed) "
                   "or the emulator's.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary instead of text.")
def demo_cmd(workdir, device, quick, transport, as_json):
    """Find the FP8 staging race and validate its fix, end to end, on this machine.

    Generates a small Qwen3.5-style FP8 checkpoint, builds the index, runs the
    emulated TP2 KT staging server unfenced and fenced on the same requests with
    moetrace's hooks, analyzes both and writes reports and plots (plots skipped,
    said once, without matplotlib). Each run starts afresh: the work folder's
    earlier checkpoint, index, traces, reports and rank logs are replaced. Exit 0
    when the race is found unfenced and the fenced run passes.

    \b
    Example:
      moetrace demo --workdir /tmp/moetrace-demo
    """
    from moetrace.jobs import demo

    _cuda_or_refuse(device)
    _writable_dir(workdir, "--workdir")
    summary = demo.run_demo(workdir, device=device, quick=quick, transport=transport, progress=_progress(as_json))
    if as_json:
        click.echo(demo.to_json(summary))
    else:
        demo.print_demo(summary, click.echo)
    sys.exit(ExitCode.PASS if summary["race_found"] and summary["fix_validated"] else ExitCode.DIVERGENT)


def _cuda_or_refuse(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise MoetraceError("--device cuda: torch sees no CUDA device on this machine; use --device cpu")


@main.command("serve")
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

    \b
    Example:
      moetrace make-checkpoint -o /tmp/ckpt
      moetrace serve /tmp/ckpt --tp 2 --fence none --port 30000 \\
        --forward-hooks "$(moetrace hook-spec --out /tmp/traces)"
      curl -s localhost:30000/v1/completions -d '{"prompt": "hello", "max_tokens": 4}'
      curl -s -X POST localhost:30000/shutdown
    """
    from moetrace.emulator.config import as_config
    from moetrace.emulator.forward_hooks import parse_forward_hooks
    from moetrace.emulator.launcher import serve

    path = checkpoint or model_path
    if not path:
        raise MoetraceError("serve: give the checkpoint directory (CHECKPOINT or --model-path)")
    _cuda_or_refuse(device)
    _output_files([("--ready-file", ready_file)])
    cfg = as_config(path, tp=tp, fence=fence, slow_rank=None if slow_rank < 0 else slow_rank, host=host, port=port,
                    chunk_tokens=chunk_tokens, prefill_threshold=prefill_threshold, device=device, seed=seed,
                    forward_hooks=parse_forward_hooks(forward_hooks), op_timeout_s=op_timeout)
    sys.exit(serve(cfg, echo=lambda m: click.echo(m, err=m.startswith("moetrace serve: rank")), ready_file=ready_file))


# ---- selftest ------------------------------------------------------------------


@main.command("selftest")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Device whose fingerprint path, staging transport and throughput are proven.")
@click.option("--quick", is_flag=True, help="Smaller sizes: the quick demo pair (8 experts), 32 MiB throughput buffers.")
@click.option("--only", type=click.Choice(["fingerprint", "detector", "throughput"]), multiple=True,
              help="Run only these parts (repeatable; default all).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Keep the synthetic checkpoint, traces and reports here (default: a temp dir, removed).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def selftest_cmd(device, quick, only, workdir, as_json):
    """Prove on this machine that moetrace would catch the FP8 staging race.

    Exit 0: every proof holds. 1: a proof failed (named). 2: could not run
    (no CUDA, ...).

    \b
    Example:
      moetrace selftest --device cuda --json > selftest.json
    """
    import json

    from moetrace.jobs import selftest as st

    _writable_dir(workdir, "--workdir")
    # each part's line as it ends, the verdict last
    on_proof = None if as_json else (lambda p: click.echo(p.line()))
    code, proofs = st.run_selftest(device, quick, workdir, tuple(only) or st.PARTS, on_proof=on_proof,
                                   progress=_progress(as_json))
    if as_json:
        click.echo(json.dumps(st.as_json(code, proofs, device), indent=2))
    else:
        click.echo(st.verdict_line(code, proofs, device))
    sys.exit(code)

# ---- the fork's own code: conform ----------------------------------------------
@main.command("conform")
@click.option("--fork-path", default=None, type=click.Path(path_type=str),
              help="sglang-kt to run: a pip --target folder, a site-packages or a source checkout "
                   "(default: the installed sglang-kt, or the one in the venv's kt-side folder).")
@click.option("--format", "fmt", type=click.Choice(["fp8_block", "fp8_channel", "bf16", "int4", "mxfp4", "mxfp8"]),
              default=None, help="Expert format; the fork's load picks its _prepare_weight_* path (default fp8_block; "
                                 "with --releases: every format). int4/mxfp4/mxfp8 are refused by name: moetrace "
                                 "cannot reproduce their post-staging layouts.")
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

    \b
    Examples:
      moetrace conform                       # the fork as shipped: exit 1, rank 1 holds E+2
      moetrace conform --patch-fence         # the seed PR's fence on the same schedule: exit 0
      moetrace conform --fork-path ./my-fork/python --format bf16 --json-out bf16.json
      moetrace conform --releases 0.6.1..0.7.2 --json-out releases.json
    """
    from moetrace.jobs.conform import Case, conform_main

    _output_files([("--json-out", json_out)])
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
    _writable_dir(workdir, "--workdir")
    case = Case(fmt or "fp8_block", schedule, patch_fence, writer, experts, fork_path)
    live = _progress(False)
    with live.step(f"conform: the fork's staging code in {tp} TP ranks, then the analysis"):
        code = conform_main(case, tp, workdir, json_out, echo=lambda m: live.above(m, click.echo))
    sys.exit(code)


if __name__ == "__main__":
    main()
