"""The command layer's own rules: each command sits in its own file under commands/, is
registered by cli.py, shows examples that run real commands with real options, and an
option shared by commands has one spelling (-o/--out); index's earlier --output is
still read."""

from __future__ import annotations

import importlib
import pkgutil

import click
from click.testing import CliRunner
from test_docs import _invocations  # the docs' own check of `moetrace COMMAND --option` lines

import moetrace.commands
from moetrace.cli import main
from moetrace.commands.options import Command


def _command_modules() -> dict[str, click.Command]:
    """{module name: the command it defines} for every file of commands/ but the helpers."""
    found = {}
    for info in pkgutil.iter_modules(moetrace.commands.__path__):
        if info.name == "options":
            continue
        module = importlib.import_module(f"moetrace.commands.{info.name}")
        defined = [v for v in vars(module).values()
                   if isinstance(v, click.Command) and getattr(v.callback, "__module__", None) == module.__name__]
        assert len(defined) == 1, f"commands/{info.name}.py defines {len(defined)} commands, expected one"
        found[info.name] = defined[0]
    return found


def test_every_command_file_is_registered_with_examples():
    modules = _command_modules()
    registered = set(main.commands.values())
    assert {id(c) for c in modules.values()} == {id(c) for c in registered}, "a command file not registered by cli.py"
    for name, cmd in main.commands.items():
        assert isinstance(cmd, Command) and cmd.examples, f"moetrace {name}: no examples"
        help_text = CliRunner().invoke(main, [name, "--help"]).output
        assert all(line in help_text for ex in cmd.examples for line in ex.splitlines()), name


def test_the_command_list_is_each_command_s_own_summary():
    """`moetrace --help` lists the commands from cli.COMMANDS without importing them: each
    summary there is the first paragraph of its command's help, as click would show it."""
    from moetrace.cli import COMMANDS

    for name, cmd in main.commands.items():
        first = " ".join(cmd.help.split("\n\n")[0].split())
        assert COMMANDS[name][1] == first, name
    listed = CliRunner().invoke(main, ["--help"]).output
    assert all(name in listed for name in COMMANDS) and "Commands:" in listed


def test_every_example_names_real_commands_and_options():
    wrong = []
    for name, cmd in main.commands.items():
        for example in cmd.examples:
            for used, options in _invocations(example.replace("\\\n", " ")):
                target = main.commands.get(used)
                if target is None:
                    wrong.append(f"{name}: moetrace {used}")
                    continue
                known = {o for p in target.params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
                wrong += [f"{name}: moetrace {used} {o}" for o in options if o not in known]
    assert not wrong, wrong


def test_out_is_spelled_one_way():
    for name, cmd in main.commands.items():
        for p in cmd.params:
            opts = set(getattr(p, "opts", []))
            if "--out" in opts:
                assert "-o" in opts, f"moetrace {name}: --out without -o"
            if "--output" in opts:
                assert p.hidden, f"moetrace {name}: --output is shown (the spelling is -o/--out)"


def test_index_reads_the_earlier_output_spelling(small_model, tmp_path):
    ckpt = small_model.path
    for flag in ("--output", "-o"):
        out = tmp_path / f"{flag.strip('-')}.parquet"
        r = CliRunner().invoke(main, ["index", str(ckpt), "--tp", "2", flag, str(out)])
        assert r.exit_code == 0 and out.exists(), r.output
    both = CliRunner().invoke(main, ["index", str(ckpt), "--tp", "2", "-o", "a.parquet", "--output",
                                     "b.parquet"])
    assert both.exit_code == 2 and "give -o/--out once" in both.output
    neither = CliRunner().invoke(main, ["index", str(ckpt), "--tp", "2"])
    assert neither.exit_code == 2 and "Missing option '-o' / '--out'" in neither.output


def test_a_command_loads_its_own_module_only():
    """`moetrace hook-spec` (run inside server start-up scripts) imports no other command's module."""
    import json
    import subprocess
    import sys

    code = ("import sys; from moetrace.cli import main\n"
            "try:\n    main(['hook-spec', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(__import__('json').dumps(sorted(m for m in sys.modules if m.startswith('moetrace.commands.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == ["moetrace.commands.hook_spec", "moetrace.commands.options"]
    listing = code.replace("['hook-spec', '--help']", "['--help']")
    out = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []  # the list of commands loads none of them
