"""The side files and the capture options are declared once (dataclasses with a docstring
per field, moetrace.declared): the docs' field tables are generated from the declarations,
the writers write exactly the declared keys, and every field says what it holds."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from moetrace.declared import Count, check_fields, field_docs, field_table, json_type
from moetrace.errors import MoetraceError
from moetrace.tracer import manifest

ROOT = Path(__file__).resolve().parents[1]
DECLARED = {"RankManifest": manifest.RankManifest, "Part": manifest.Part, "RunManifest": manifest.RunManifest,
            "RunRank": manifest.RunRank}
MARKER = re.compile(r"<!-- fields: (\w+) -->\n((?:\|.*\n)+)")


def _tables(text: str) -> dict[str, str]:
    return {name: table.rstrip("\n") for name, table in MARKER.findall(text)}


def test_the_docs_field_tables_are_the_declarations():
    tables = _tables((ROOT / "docs" / "capture.md").read_text())
    assert set(tables) == set(DECLARED)
    for name, cls in DECLARED.items():
        assert tables[name] == field_table(cls), f"docs/capture.md's {name} table: regenerate it with " \
                                                 f"moetrace.declared.field_table(moetrace.tracer.manifest.{name})"


def test_every_declared_field_says_what_it_holds():
    for name, cls in DECLARED.items():
        blank = [f for f, doc in field_docs(cls).items() if not doc]
        assert not blank, f"{name}: fields without a docstring: {blank}"


def test_the_writers_write_the_declared_keys_in_the_declared_order():
    rank = manifest.new_rank_manifest("r", 0, 1, {}, None, "config")
    run = manifest.new_run_manifest("r", "out")
    assert list(rank) == [f.name for f in dataclasses.fields(manifest.RankManifest)]
    assert list(run) == [f.name for f in dataclasses.fields(manifest.RunManifest)]
    assert manifest.check_rank_manifest(rank, "m") is rank and manifest.check_run_manifest(run, "r") is run


def test_a_changed_table_or_an_undocumented_field_is_caught():
    text = (ROOT / "docs" / "capture.md").read_text().replace("| `finished` | bool |", "| `finished` | str |")
    assert _tables(text)["RankManifest"] != field_table(manifest.RankManifest)

    @dataclasses.dataclass
    class Doc:
        said: int
        """a count"""
        silent: str

    assert field_docs(Doc) == {"said": "a count", "silent": ""}


def test_the_json_types_come_from_the_annotations():
    assert json_type("Count | None") == "count|null" and json_type("dict[str, int]") == "dict"
    with pytest.raises(TypeError, match="float"):
        json_type("float")

    @dataclasses.dataclass
    class Doc:
        n: Count
        """rows"""

    with pytest.raises(MoetraceError, match=r"doc: 'n' is an int \(-1\), expected count"):
        check_fields({"n": -1}, Doc, "doc")


def test_the_capture_options_are_the_declaration():
    """hook-spec and launch take every declared capture option, its docstring as its help;
    audit --launch's --out and --run-id are the same options with its own defaults."""
    import click

    from moetrace.cli import main
    from moetrace.tracer.capture_options import CaptureOptions

    docs = field_docs(CaptureOptions)
    assert all(docs.values()), [k for k, v in docs.items() if not v]
    for name in ("hook-spec", "launch"):
        ctx = click.Context(main.commands[name])
        params = {p.name: p for p in main.commands[name].params}
        for field_name, doc in docs.items():
            assert field_name in params, f"moetrace {name}: no option for {field_name}"
            record = params[field_name].get_help_record(ctx)
            assert " ".join(doc.split()) in " ".join(record[1].split()), (name, field_name)
    audit = {p.name: p for p in main.commands["audit"].params}
    assert audit["out"].opts == ["-o", "--out"] and audit["out"].default == "moetrace-traces"
    assert audit["run_id"].default is None


def test_the_config_file_yields_to_the_options_given(tmp_path):
    from moetrace.tracer.capture_options import CaptureOptions

    path = tmp_path / "c.json"
    path.write_text('{"layers": "0", "queue_size": 8, "kt": true}')
    config, targets = CaptureOptions(out="o", layers="1-2", kt="off", config_file=str(path),
                                     targets=("x.*",)).to_config()
    assert config == {"layers": "1-2", "queue_size": 8, "kt": False, "out": "o"} and targets == ("x.*",)
    assert CaptureOptions(out="o").to_config() == ({"out": "o"}, ())
