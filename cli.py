"""moetrace's command line: one click group, its error contract, and the commands it
registers (each in its own file under commands/, with its options and examples)."""

from __future__ import annotations

import importlib
import os
import sys

import click

from moetrace import __version__
from moetrace.errors import ExitCode, MoetraceError

# name -> "module:command" under commands/, in the order of the data flow: checkpoints,
# capture, analysis, the emulator, the proofs. A command's module is imported when it runs
# (or when help lists it), so `moetrace hook-spec` loads hook-spec's options only.
COMMANDS = {
    "make-checkpoint": "make_checkpoint:make_checkpoint_cmd",
    "index": "index:index_cmd",
    "hook-spec": "hook_spec:hook_spec_cmd",
    "launch": "launch:launch_cmd",
    "analyze": "analyze:analyze_cmd",
    "diff": "diff:diff_cmd",
    "audit": "audit:audit_cmd",
    "demo": "demo:demo_cmd",
    "serve": "serve:serve_cmd",
    "selftest": "selftest:selftest_cmd",
    "conform": "conform:conform_cmd",
}


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
            module, attr = COMMANDS[name].split(":")
            self._commands[name] = getattr(importlib.import_module(f"moetrace.commands.{module}"), attr)
        return self._commands.get(name)

    def get_command(self, ctx, cmd_name: str) -> click.Command | None:
        return self._load(cmd_name)

    def list_commands(self, ctx) -> list[str]:
        return sorted(COMMANDS)

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


if __name__ == "__main__":
    main()
