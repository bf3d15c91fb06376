"""Launching vLLM with capture on, without vLLM: the command is recognised and made eager,
the hook config reaches the server's environment (moetrace's plugin reads it there), hook-spec
prints the same config, audit --launch talks to vLLM's port, the plugin stays light and
never raises, and a run whose forward captures never came is not a pass."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from support.cli import cli
from support.traces import capture_load, write_scenario

from moetrace.hooks.vllm import plugin
from moetrace.jobs.traffic import base_url_from
from moetrace.servers import vllm_command as command
from moetrace.servers.command import expected_tp
from moetrace.servers.launcher import Launcher

VLLM = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--tensor-parallel-size", "2"]


def launcher(tmp_path, cmd, **kw) -> Launcher:
    return Launcher(cmd, {"out": str(tmp_path / "t"), "run_id": "R"}, echo=lambda m: None, close_timeout_s=0, **kw)


@pytest.mark.parametrize("cmd, is_vllm", [
    (VLLM, True), (["vllm", "serve", "/m"], True), (["/venv/bin/vllm", "serve", "/m"], True),
    (["python", "-m", "vllm.entrypoints.cli.main", "serve", "/m"], True),
    (["python", "-m", "sglang.launch_server", "--model-path", "/m"], False), (["/opt/vllm-tools/run.sh"], False),
])
def test_a_vllm_command_is_recognised(cmd, is_vllm):
    assert command.invokes_vllm(cmd) is is_vllm


def test_launch_adds_enforce_eager_once_and_the_config_goes_through_the_environment(tmp_path):
    lx = launcher(tmp_path, VLLM)
    assert lx.vllm and lx.cmd == VLLM + ["--enforce-eager"] and (lx.flags, lx.flags_found_by) == (("--enforce-eager",), "vllm")
    env = json.loads(lx.server_env()[plugin.CONFIG_ENV])
    assert env == lx.config and env["control_file"] == lx.control_file and env["run_nonce"] == lx.nonce
    assert env["run_id"] == "R" and "--forward-hooks" not in lx.cmd
    assert lx.spec == [{"name": "moetrace", "plugin": "moetrace.hooks.vllm.plugin:register", "env": plugin.CONFIG_ENV,
                        "config": lx.config}]
    assert lx.run_manifest["cuda_graph_flags"] == ["--enforce-eager"] and lx.run_manifest["sglang_version"] is None
    eager = launcher(tmp_path, VLLM + ["--enforce-eager"])
    assert eager.cmd == VLLM + ["--enforce-eager"] and eager.flags_found_by == "command"
    kept = launcher(tmp_path, VLLM, disable_cuda_graph=False)
    assert kept.cmd == VLLM and kept.flags_found_by == "kept"


def test_the_server_process_gets_the_config(tmp_path):
    """A stand-in started as `vllm` (so recognised) writes the environment it was given."""
    seen = tmp_path / "env.json"
    stand_in = ["sh", "-c", f'printf "%s" "$MOETRACE_VLLM_CONFIG" > {seen}; echo "$@" > {seen}.args', "vllm", "serve"]
    lx = launcher(tmp_path, stand_in)
    lx.run()
    assert json.loads(seen.read_text()) == lx.config
    assert (tmp_path / "env.json.args").read_text().split() == ["serve", "--enforce-eager"]


def test_hook_spec_for_vllm_prints_the_config_the_plugin_reads(tmp_path):
    r = cli("hook-spec", "--server", "vllm", "--out", tmp_path / "t", "--run-id", "R", "--layers", "0-1")
    assert r.exit_code == 0, r.output
    conf = json.loads(r.output)
    sglang = json.loads(cli("hook-spec", "--out", tmp_path / "t", "--run-id", "R", "--layers", "0-1").output)[0]["config"]
    assert {k: v for k, v in conf.items() if k != "run_nonce"} == {k: v for k, v in sglang.items() if k != "run_nonce"}
    assert conf["out"] == str(tmp_path / "t") and conf["layers"] == "0-1"
    assert plugin.read_config(r.output) == conf
    path = tmp_path / "conf.json"
    path.write_text(r.output)
    assert plugin.read_config(str(path)) == conf


@pytest.mark.parametrize("value, words", [("{not json", "not JSON"), ("[1]", "neither a JSON object"),
                                          ('{"layers": "0"}', "with 'out'"), ("/no/such/file", "readable file")])
def test_a_bad_config_is_refused_by_name(value, words):
    with pytest.raises(ValueError, match=words):
        plugin.read_config(value)


def test_the_plugin_never_raises_into_vllm(monkeypatch, caplog):
    monkeypatch.setenv(plugin.CONFIG_ENV, "{not json")
    with caplog.at_level(logging.ERROR, "moetrace.hooks"):
        plugin.register()
    assert "tracing is off in this process" in caplog.text and "MOETRACE_VLLM_CONFIG: not JSON" in caplog.text


def test_the_plugin_without_config_loads_nothing():
    """vLLM loads every general plugin in all of its processes: moetrace's costs nothing there."""
    code = ("import sys; before = set(sys.modules); import moetrace.hooks.vllm.plugin as p; p.register(); "
            "new = set(sys.modules) - before; "
            "print(','.join(sorted(m for m in new if m.split('.')[0] in ('torch', 'numpy', 'pyarrow', 'vllm') "
            "or m.startswith(('moetrace.tracer', 'moetrace.checkpoints', 'moetrace.hooks.vllm.loader')))))")
    env = {k: v for k, v in __import__("os").environ.items() if k != plugin.CONFIG_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == ""


def test_audit_launch_talks_to_vllms_port():
    assert base_url_from(VLLM, None) == "http://127.0.0.1:8000"
    assert base_url_from(VLLM + ["--port", "9100"], None) == "http://127.0.0.1:9100"
    assert base_url_from(["python", "-m", "sglang.launch_server"], None) == "http://127.0.0.1:30000"
    assert expected_tp(["vllm", "serve", "/m", "-tp", "2"]) == 2


# ---------------------------------------------------------------- capture points

def _vllm_models(layers):
    return {"models": {"target": {"architecture": "Qwen3MoeForCausalLM", "found_by": "test", "layers": layers,
                                  "steps_found_by": "layer-order", "slot_maps": {}, "server": "vllm",
                                  "capture_points": ["loaded", "resident"]}}}


def test_a_load_boundary_alone_is_not_a_pass(small_model, small_index, tmp_path):
    """Rows of the load boundary only (the forward hooks never ran: torch.compile, no traffic)
    leave the resident weights unchecked: incomplete, exit 2, saying why."""
    m = small_model
    write_scenario(m, str(tmp_path), "r", [0], None, source="loaded", manifest=_vllm_models(m.layer_ids))
    r = cli("audit", tmp_path / "r", "--index", small_index)
    assert r.exit_code == 2, r.output
    assert "captured no resident rows of the target (no forward pass reached the hooks: torch.compile on" in r.output


def test_both_capture_points_pass(small_model, small_index, tmp_path):
    m = small_model

    def forward(sink, rank):
        for seq, layer in enumerate(m.layer_ids):
            capture_load(sink, m, 1, rank, layer, source="resident", capture_seq=100 + seq)

    write_scenario(m, str(tmp_path), "r", [0], None, source="loaded", manifest=_vllm_models(m.layer_ids), extra=forward)
    r = cli("audit", tmp_path / "r", "--index", small_index)
    assert r.exit_code == 0, r.output
