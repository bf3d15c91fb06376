"""moetrace's command line: one click group, its error contract, and the commands it
registers (each in its own file under commands/, with its options and examples)."""

from __future__ import annotations

import importlib
import os
import sys

import click

from moetrace import __version__
from moetrace.errors import ExitCode, MoetraceError

# name -> ("module:command" under commands/, its summary: the first line of its help), in the
# order of the data flow. A command's module is imported when it runs or shows its help, so
# `moetrace hook-spec` loads hook-spec's options only and `moetrace --help` lists the commands
# from here (tests/test_commands.py holds each summary to its command's help).
COMMANDS = {
    "make-checkpoint": ("make_checkpoint:make_checkpoint_cmd",
                        "Write a small synthetic MoE checkpoint with real names, dtypes and layout."),
    "index": ("index:index_cmd", "Fingerprint the TP shard of every expert a rank may hold, per the checkpoint."),
    "hook-spec": ("hook_spec:hook_spec_cmd",
                  "Print the JSON that turns capture on in an SGLang (--forward-hooks) or vLLM server."),
    "launch": ("launch:launch_cmd", "Run an SGLang or vLLM server with capture on; finalize the trace when it exits."),
    "analyze": ("analyze:analyze_cmd", "Give every captured tensor a verdict and find the first divergence."),
    "diff": ("diff:diff_cmd", "Compare the same (step, layer, rank, source, expert, tensor) across two runs."),
    "audit": ("audit:audit_cmd", "Like analyze, for CI: the exit code is the verdict."),
    "demo": ("demo:demo_cmd", "Find the FP8 staging race and validate its fix, end to end, on this machine."),
    "serve": ("serve:serve_cmd", "Serve an emulated TP KT-staging server (OpenAI /v1/completions) on loopback."),
    "selftest": ("selftest:selftest_cmd", "Prove on this machine that moetrace would catch the FP8 staging race."),
    "conform": ("conform:conform_cmd",
                "Run the installed fork's own staging code on CPU and audit what each rank holds."),
}


# Commands after which the console script may end the process at once (run): no server,
# thread, child process or trace writer outlives them.
QUICK_EXIT = frozenset({"index", "hook-spec"})


class _Group(click.Group):
    """Every failure is one line on stderr and a non-zero exit, never a traceback:
    MoetraceError with its exit code, a usage error with 2, an OSError (disk, permission,
    network) with 2, any unexpected error with 2 (1 is reserved for "divergence found"),
    Ctrl-C with 130. MOETRACE_DEBUG=1 re-raises unexpected errors, for the traceback."""

    @property
    def commands(self) -> dict[str, click.Command]:
        """Every registered command (each module imported on first use)."""
        for name in COMMANDS:
            self._load(name)
        return self._commands

    @commands.setter
    def commands(self, value: dict) -> None:
        self._commands = dict(value)

    def _load(self, name: str) -> click.Command | None:
        if name not in self._commands and name in COMMANDS:
            module, attr = COMMANDS[name][0].split(":")
            self._commands[name] = getattr(importlib.import_module(f"moetrace.commands.{module}"), attr)
        return self._commands.get(name)

    def get_command(self, ctx, cmd_name: str) -> click.Command | None:
        self.ran = cmd_name
        return self._load(cmd_name)

    def list_commands(self, ctx) -> list[str]:
        return sorted(COMMANDS)

    def format_commands(self, ctx, formatter) -> None:
        """The command list from the summaries above: listing imports no command."""
        limit = formatter.width - 6 - max(len(name) for name in COMMANDS)
        # click's own shortening, of a stand-in holding the summary
        rows = [(name, click.Command(name, help=COMMANDS[name][1]).get_short_help_str(limit))
                for name in sorted(COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

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


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="moetrace")
def main() -> None:
    """Trace MoE expert weights from checkpoint to GPU and find where they diverge."""


def run() -> None:
    """The `moetrace` console script: main(); after a QUICK_EXIT command the process ends
    without finalizing the interpreter (tearing down numpy's and pyarrow's modules and three
    GC passes over them cost 35-50 ms, a tenth of a cache-hit `index`). Output is flushed and
    the atexit handlers run first. Python callers of main() get its SystemExit as before."""
    main.ran = None
    try:
        main()
    except SystemExit as done:
        code = 0 if done.code is None else done.code
        if main.ran not in QUICK_EXIT or not isinstance(code, int):
            raise
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # a closed pipe: the normal exit reports it
            raise done from None
        import atexit

        atexit._run_exitfuncs()
        os._exit(code)


if __name__ == "__main__":
    run()
