"""make-checkpoint writes complete models: every tensor the model class needs, a config
its servers read, a tokenizer.

- SGLang's own loader is the oracle (support.sglang_model_load, in the real server's
  environment): for every family and format, the model class SGLang builds from the folder
  has no parameter row its own load_weights left unwritten; dropping one non-expert tensor
  must be caught.
- transformers' own model classes load every BF16 folder with no missing weight, and a
  forward pass gives finite logits.
- The tokenizer round-trips text with ids inside the vocabulary, with `tokenizers` and
  without it; the writer needs neither transformers nor tokenizers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetrace.checkpoints import synthetic_model
from moetrace.checkpoints.tokenizer import VOCAB_SIZE, _bytes_only, tokenizer_files

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "MOETRACE_REQUIRE_SGLANG_SERVER"
VENV_ENV = "MOETRACE_SGLANG_VENV"
FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3")
# (format, quant_method, fused, shared_expert): every format the writer has; a square block,
# as SGLang's CPU engine requires (update_config.get_moe_padding_size)
FORMATS = [("bf16", None, False, False), ("bf16", None, True, False), ("bf16", None, False, True),
           ("fp8_block", "fp8", False, False), ("fp8_block", "fp8", False, True),
           ("fp8_block", "compressed-tensors", False, False), ("fp8_channel", "compressed-tensors", False, False),
           ("fp8_tensor", "fp8", False, False), ("fp8_tensor", "compressed-tensors", False, False)]
SIZES = dict(num_layers=2, num_experts=4, hidden=64, intermediate=64, block=32, num_files=2)


def cases():
    for family in FAMILIES:
        for fmt, qm, fused, shared in FORMATS:
            if fused and family in ("qwen3_moe", "qwen3_next"):
                continue  # refused by the writer: SGLang's classes for them map no fused names
            if shared and family == "qwen3_moe":
                continue  # no shared expert
            yield family, fmt, qm, fused, shared


def _write(make_ckpt, family, fmt, qm, fused, shared):
    # SGLang 0.5.23 builds every Qwen3-MoE/Next/3.5 layer as MoE whatever mlp_only_layers
    # says (docs/checkpoints.md), so only DeepSeek gets a dense layer here
    return make_ckpt(family=family, fmt=fmt, quant_method=qm, fused=fused, shared_expert=shared,
                     dense_layers=1 if family == "deepseek_v3" else 0, **SIZES)


def sglang_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or ROOT / ".venv-sglang")


def run_sglang_oracle(folders: list[Path]) -> dict[str, dict]:
    py = sglang_venv() / "bin" / "python"
    if not py.exists():
        why = f"no SGLang server environment at {sglang_venv()} (the Makefile's sglang-venv target builds it)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {why}")
        pytest.skip(why)
    tests = ROOT / "tests"
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0", "TORCHDYNAMO_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(tests / "support" / "sglang_cpu"), str(tests)])}
    proc = subprocess.run([str(py), "-m", "support.sglang_model_load", *map(str, folders)], capture_output=True,
                          text=True, timeout=900, env=env, cwd=str(tests), stdin=subprocess.DEVNULL)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            results[doc["path"]] = doc
    assert proc.returncode == 0 and len(results) == len(folders), proc.stderr[-4000:]
    return results


def _drop(src: Path, dst: Path, name: str) -> Path:
    """A copy of checkpoint `src` without tensor `name` (its file rewritten, the index updated)."""
    shutil.copytree(src, dst)
    index = dst / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    file = dst / doc["weight_map"].pop(name)
    tensors = load_file(str(file))
    del tensors[name]
    save_file(tensors, str(file), metadata={"format": "pt"})
    index.write_text(json.dumps(doc))
    return dst


# Non-expert tensors dropped in the negative controls: (family, tensor, parameter SGLang fills from it)
DROPPED = [("qwen3_moe", "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"),
           ("qwen3_5_moe", "model.language_model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.A_log"),
           ("deepseek_v3", "model.norm.weight", "model.norm.weight")]


@pytest.fixture(scope="module")
def sglang_loads(make_ckpt, tmp_path_factory):
    """SGLang's loader over every case and the negative controls, in one process."""
    folders = {case: _write(make_ckpt, *case) for case in cases()}
    dropped = {}
    for family, name, param in DROPPED:
        src = _write(make_ckpt, family, "bf16", None, False, False)
        dropped[(family, name)] = _drop(src, tmp_path_factory.mktemp("dropped") / "c", name)
    results = run_sglang_oracle(list(folders.values()) + list(dropped.values()))
    return ({case: results[str(p)] for case, p in folders.items()},
            {key: results[str(p)] for key, p in dropped.items()})


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: "-".join(str(x) for x in c))
def test_sglang_loads_every_parameter(sglang_loads, case):
    got = sglang_loads[0][case]
    assert got["error"] is None, got.get("traceback")
    assert got["parameters"] > 10 and got["unfilled"] == {}, got["unfilled"]


@pytest.mark.parametrize("family,name,param", DROPPED, ids=[d[0] for d in DROPPED])
def test_sglang_oracle_catches_a_missing_tensor(sglang_loads, family, name, param):
    got = sglang_loads[1][(family, name)]
    assert got["error"] is None, got.get("traceback")
    assert param in got["unfilled"], got["unfilled"]


@pytest.mark.parametrize("family,fused", [("qwen3_moe", False), ("qwen3_next", False), ("qwen3_5_moe", False),
                                          ("qwen3_5_moe", True), ("deepseek_v3", False)])
def test_transformers_loads_and_runs(make_ckpt, family, fused):
    """transformers' own class (from config.json's architecture) finds every weight it
    needs, and one forward pass of the tokenized text gives finite logits."""
    transformers = pytest.importorskip("transformers")
    root = _write(make_ckpt, family, "bf16", None, fused, False)
    arch = json.loads((root / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, arch).from_pretrained(str(root), output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info.get("mismatched_keys"), info["mismatched_keys"]
    # what the checkpoint holds that no module loads: the expert-looking decoys only
    decoys = {k for k in info["unexpected_keys"] if ".experts.0." in k or k.startswith(("mtp.", "model.layers.2."))}
    assert set(info["unexpected_keys"]) == decoys
    tok = transformers.AutoTokenizer.from_pretrained(str(root))
    ids = tok("the expert holds a stale shard", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape[-1] == synthetic_model.VOCAB and torch.isfinite(logits).all()


def test_transformers_names_a_missing_tensor(make_ckpt, tmp_path):
    """The check above can fail: a folder without one norm weight is reported missing."""
    transformers = pytest.importorskip("transformers")
    name = "model.layers.0.post_attention_layernorm.weight"
    root = _drop(_write(make_ckpt, "qwen3_moe", "bf16", None, False, False), tmp_path / "c", name)
    _, info = transformers.Qwen3MoeForCausalLM.from_pretrained(str(root), output_loading_info=True)
    assert name in info["missing_keys"]


@pytest.mark.parametrize("trained", [True, False])
def test_tokenizer_round_trips(trained):
    tokenizers = pytest.importorskip("tokenizers")
    text = tokenizer_files()["tokenizer.json"] if trained else _bytes_only()
    tok = tokenizers.Tokenizer.from_str(text)
    for s in ("expert slot rank layer", "Ünïcode and digits 0123 {json}"):
        ids = tok.encode(s).ids
        assert ids and max(ids) < VOCAB_SIZE and tok.decode(ids) == s
    assert tok.get_vocab_size() <= VOCAB_SIZE
    if trained:  # merges learned: the corpus's words take fewer tokens than bytes
        assert len(tok.encode("expert slot rank layer").ids) < len("expert slot rank layer")


def test_writer_needs_neither_transformers_nor_tokenizers(tmp_path):
    """make-checkpoint in a process where importing either fails: the same tensors and
    config, and a byte-level tokenizer without merges."""
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['tokenizers'] = None\n"
            "from moetrace.cli import main\n"
            f"main(['make-checkpoint', '--family', 'qwen3_5_moe', '--format', 'bf16', '-o', {str(tmp_path / 'c')!r}])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "c" / "tokenizer.json").read_text())
    assert doc["model"]["merges"] == [] and len(doc["model"]["vocab"]) == 256 + 5  # bytes, EOS, 4 vision markers
    assert (tmp_path / "c" / "model.safetensors.index.json").exists()
