"""What the commands share: the command class that shows examples, option types, the
option groups several commands take, and the small helpers every command body uses.

A command's own options sit in its file, in its signature; an option several commands
take is declared here once, spelled the same everywhere (``-o/--out``). Imports stay
light: ``moetrace --help`` loads every command module, and each command imports the
library inside its body.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import fields

import click

from moetrace.declared import field_docs
from moetrace.errors import MoetraceError
from moetrace.tracer.capture_options import CaptureOptions


class Command(click.Command):
    """A command with its examples: shown under its help text ("Example:" or "Examples:"),
    one invocation per entry (continuation lines indented), never re-wrapped."""

    def __init__(self, *args, examples: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.examples = tuple(examples)

    def format_help_text(self, ctx, formatter) -> None:
        super().format_help_text(ctx, formatter)
        if self.examples:
            formatter.write_paragraph()
            formatter.write_text("Example:" if len(self.examples) == 1 else "Examples:")
            with formatter.indentation():
                for example in self.examples:
                    for line in example.splitlines():
                        formatter.write(f"{'':>{formatter.current_indent}}{line}\n")


def command(name: str, examples: tuple[str, ...], **settings):
    """``@command("index", EXAMPLES)``: a click command that shows its examples (registered by cli.py)."""
    return click.command(name, cls=Command, examples=examples, **settings)


# ---------------------------------------------------------------- option types


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


SEED = click.IntRange(-(2**63), 2**63 - 1)  # what torch.Generator.manual_seed takes


# ---------------------------------------------------------------- option groups


class DeclaredOption(click.Option):
    """An option declared as a dataclass field: its help is the field's docstring, read
    when help is shown (reading the declaration's source costs milliseconds at start-up)."""

    def __init__(self, *args, declared: tuple[type, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.declared = declared

    def get_help_record(self, ctx):
        if self.help is None:
            cls, name = self.declared
            self.help = field_docs(cls)[name]
        return super().get_help_record(ctx)


def _declared_option(cls: type, name: str, **override):
    f = next(f for f in fields(cls) if f.name == name)
    meta = f.metadata
    kind = click.Choice(list(meta["choices"])) if meta["choices"] else None
    if meta["min"] is not None or meta["max"] is not None:
        kind = click.IntRange(min=meta["min"], max=meta["max"])
    if meta["existing_file"]:
        kind = click.Path(exists=True, dir_okay=False)
    settings = {"type": kind, "default": f.default, "required": meta["required"], "multiple": meta["multiple"],
                **override}
    return click.option(*(meta["flags"] or (f"--{name.replace('_', '-')}",)), name, cls=DeclaredOption,
                        declared=(cls, name), **settings)


def capture_options(func):
    """The capture options (tracer.capture_options.CaptureOptions, declared once), handed
    to the command as one ``capture`` argument."""
    names = [f.name for f in fields(CaptureOptions)]

    @functools.wraps(func)
    def wrapper(**kwargs):
        capture = CaptureOptions(**{name: kwargs.pop(name) for name in names})
        return func(capture=capture, **kwargs)

    for name in reversed(names):
        wrapper = _declared_option(CaptureOptions, name)(wrapper)
    return wrapper


def capture_option(name: str, **override):
    """One capture option with other settings (audit --launch's --out and --run-id)."""
    return _declared_option(CaptureOptions, name, **override)


def stop_options(func):
    """Options of every command that launches a server: run-id reuse and how it is stopped."""
    func = click.option("--stop-grace", type=Seconds(0), default=30.0, show_default=True,
                        help="Seconds the server's process group gets after the stop signal before it is killed "
                             "(a second Ctrl-C kills at once).")(func)
    return click.option("--replace", is_flag=True,
                        help="Delete an existing OUT/<run_id> first; without it a used run id is refused.")(func)


def analysis_options(trace_required: bool = True):
    """The options of analyze and audit, handed to the command as one ``analysis`` argument
    (jobs.audit.AnalysisOptions), after the report files are checked."""
    opts = [
        click.argument("trace", nargs=-1, required=trace_required),
        click.option("--index", "index_path", default=None, metavar="FILE",
                     help="Expected-fingerprint index Parquet (moetrace index)."),
        click.option("--checkpoint", default=None, metavar="CKPT",
                     help="Checkpoint folder: build (or reuse from the cache) the index for the trace's TP/EP."),
        click.option("--json", "as_json", is_flag=True,
                     help="Print the JSON report (docs/analysis.md) instead of text."),
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
    keys = ("trace", "index_path", "checkpoint", "as_json", "json_out", "markdown", "junit", "plot", "max_lines",
            "max_rows", "remote_timeout")

    def decorate(func):
        @functools.wraps(func)
        def wrapper(**kwargs):
            return func(analysis=_analysis({k: kwargs.pop(k) for k in keys}), **kwargs)

        for opt in reversed(opts):
            wrapper = opt(wrapper)
        return wrapper

    return decorate


def _analysis(given: dict):
    from moetrace.jobs.audit import AnalysisOptions, ReportFiles
    from moetrace.outputs import check_output_files
    from moetrace.storage import set_remote_timeout

    set_remote_timeout(given["remote_timeout"])
    reports = ReportFiles(given["json_out"], given["markdown"], given["junit"], given["plot"])
    check_output_files(reports.outputs(), probe=False)
    return AnalysisOptions(trace=tuple(given["trace"]), index=given["index_path"], checkpoint=given["checkpoint"],
                           as_json=given["as_json"], reports=reports, max_lines=given["max_lines"],
                           max_rows=given["max_rows"])


# ---------------------------------------------------------------- helpers


def stderr(message: str) -> None:
    click.echo(message, err=True)


def progress(as_json: bool):
    """Live progress lines on stderr: on a terminal only, never with --json."""
    from moetrace.jobs.progress import Progress

    return Progress.off() if as_json else Progress(stream=sys.stderr)


def cuda_or_refuse(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise MoetraceError("--device cuda: torch sees no CUDA device on this machine; use --device cpu")


class NullBar:
    """click.progressbar's interface, showing nothing (--json, or stderr not a terminal)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        pass
