"""Bad input is one plain line and exit 2, checked before any
work (never "a moetrace bug", never an endless wait, never a half-written output)."""

from __future__ import annotations

import json

import pytest
import torch
from support.cli import cli, one_line_error
from support.traces import write_scenario


def plain(r, *words):
    line = one_line_error(r, *words)
    assert "bug" not in line and "unexpected" not in line, line
    return line


@pytest.fixture
def afile(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    return f


@pytest.mark.parametrize("value", ["NaN", "nan", "inf", "-inf", "-1", "1e400"])
@pytest.mark.parametrize("cmd", [["launch", "--out", "t", "--stop-grace", "{}", "--", "true"],
                                 ["launch", "--out", "t", "--close-timeout", "{}", "--", "true"],
                                 ["audit", "--launch", "true", "--ready-timeout", "{}"],
                                 ["serve", "c", "--op-timeout", "{}"],
                                 ["analyze", "r", "--index", "i", "--remote-timeout", "{}"]])
def test_durations_are_finite(cmd, value):
    option = next(a for a in cmd if "{}" not in a and a.startswith("--") and cmd[cmd.index(a) + 1] == "{}")
    plain(cli(*[a.format(value) for a in cmd]), option, "finite number of seconds")


@pytest.mark.parametrize("config,words", [
    ({"close_timeout_s": float("nan")}, "close_timeout_s"),
    ({"flush_interval_s": float("inf")}, "flush_interval_s"),
    ({"queue_size": float("inf")}, "queue_size"),  # what JSON's 1e400 reads as
    ({"queue_size": "8"}, "queue_size"),
    ({"rows_per_part": 1.5}, "rows_per_part"),
])
def test_config_values(tmp_path, config, words):
    f = tmp_path / "c.json"
    f.write_text(json.dumps(config))  # NaN / Infinity: Python's JSON extension, as a hand-edited file may hold
    plain(cli("hook-spec", "--out", tmp_path / "t", "--config", f), words)
    (tmp_path / "big.json").write_text('{"queue_size": 1e400}')
    plain(cli("hook-spec", "--out", tmp_path / "t", "--config", tmp_path / "big.json"), "queue_size")


@pytest.mark.parametrize("run_id", ["rank=0", "a\nb", ".hidden", " x", "a=b", "a\\b"])
def test_run_ids_are_one_plain_folder_name(tmp_path, run_id):
    plain(cli("hook-spec", "--out", tmp_path, "--run-id", run_id), "run_id")


def test_a_plain_run_id_is_accepted(tmp_path):
    r = cli("hook-spec", "--out", tmp_path, "--run-id", "nightly-2026.12.03_01:00")
    assert r.exit_code == 0, r.output


def test_make_checkpoint_sizes_seed_and_files(tmp_path):
    plain(cli("make-checkpoint", "-o", tmp_path / "a", "--hidden", "1000000000"), "GiB", "smaller sizes")
    plain(cli("make-checkpoint", "-o", tmp_path / "a", "--layers", "100000000"), "GiB")
    plain(cli("make-checkpoint", "-o", tmp_path / "a", "--seed", str(10**23)), "--seed")
    plain(cli("make-checkpoint", "-o", tmp_path / "a", "--files", "1000"), "--files 1000", "empty")
    assert not (tmp_path / "a").exists()
    r = cli("make-checkpoint", "-o", tmp_path / "b", "--files", "3", "--seed", "-5")  # the control
    assert r.exit_code == 0, r.output
    r = cli("index", tmp_path / "b", "--tp", "2", "-o", tmp_path / "b.parquet", "--no-cache")
    assert r.exit_code == 0, r.output


def test_serve_refusals(small_model, tmp_path, afile):
    plain(cli("serve", small_model.path, "--seed", "1e26"), "--seed")
    plain(cli("serve", small_model.path, "--seed", str(10**26)), "--seed")
    plain(cli("serve", small_model.path, "--ready-file", afile / "ready.json"), "--ready-file")
    if not torch.cuda.is_available():
        plain(cli("serve", small_model.path, "--device", "cuda"), "--device cuda")


def test_unwritable_folders_are_refused_first(afile):
    plain(cli("demo", "--quick", "--workdir", afile / "w"), "--workdir")
    plain(cli("selftest", "--quick", "--workdir", afile / "w"), "--workdir")
    plain(cli("conform", "--workdir", afile / "w"), "--workdir")
    plain(cli("conform", "--json-out", afile / "r.json"), "--json-out")  # before the 10 s run


def test_report_paths(small_model, small_index, tmp_path, afile):
    write_scenario(small_model, str(tmp_path), "r", [0], None)
    run = tmp_path / "r"
    plain(cli("audit", run, "--index", small_index, "--json-out", ""), "--json-out", "empty")
    same = tmp_path / "report"
    plain(cli("audit", run, "--index", small_index, "--json-out", same, "--markdown", same), "--markdown",
          "--json-out")
    assert not same.exists()
    r = cli("audit", run, "--index", small_index, "--junit", afile / "j.xml")  # verdict, then exit 3
    assert r.exit_code == 3 and "ALL MATCH" in r.output and "bug" not in r.output, r.output
    r = cli("audit", run, "--index", small_index, "--json-out", tmp_path / "a.json", "--markdown", tmp_path / "a.md")
    assert r.exit_code == 0 and (tmp_path / "a.json").exists() and (tmp_path / "a.md").exists(), r.output
