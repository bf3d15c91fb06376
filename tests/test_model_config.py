"""The raw config reader answers as transformers' AutoConfig does (SGLang reads every
config through it): over every supported family, the config.json transformers writes,
each key left out (class defaults), and every alias spelling."""

from __future__ import annotations

import json
import shutil

import pytest

from moetrace.checkpoints import model_config as mc
from moetrace.checkpoints.spec import ARCHITECTURES, spec_from_config
from moetrace.errors import MoetraceError

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, num_hidden_layers=3, moe_intermediate_size=32)
# architecture -> kwargs of the transformers config class (decoder keys)
WRITTEN = {
    "Qwen3MoeForCausalLM": dict(SMALL, num_experts=4, mlp_only_layers=[0], decoder_sparse_step=1),
    "Qwen3NextForCausalLM": dict(SMALL, num_experts=4, shared_expert_intermediate_size=32),
    "Qwen3_5MoeForCausalLM": dict(SMALL, num_experts=4, shared_expert_intermediate_size=32),
    "Qwen3_5MoeForConditionalGeneration": dict(SMALL, num_experts=4, shared_expert_intermediate_size=32),
    "DeepseekV3ForCausalLM": dict(SMALL, n_routed_experts=4, first_k_dense_replace=1, n_shared_experts=1),
}


def written(arch: str) -> dict:
    """config.json as transformers' save_pretrained writes it (the diff to the class defaults)."""
    model_type, decoder_type, nested = mc.MODEL_TYPES[arch]
    cls = transformers.CONFIG_MAPPING[model_type]
    cfg = cls(text_config=WRITTEN[arch]) if nested else cls(**WRITTEN[arch])
    cfg.architectures = [arch]
    return json.loads(cfg.to_json_string(use_diff=True))


def variants(arch: str):
    """(label, config) pairs: as written, each read key dropped, each alias spelling."""
    base = written(arch)
    yield "written", base
    decoder_type, nested = mc.MODEL_TYPES[arch][1:]
    text = base.get("text_config", base) if nested else base
    aliases = mc.ALIASES.get(decoder_type, {})
    keys = {k for key in mc.KEYS[decoder_type] for k in aliases.get(key, (key,))}
    for key in sorted(keys & set(text)):
        yield f"without {key}", _edit(base, nested, lambda t, k=key: t.pop(k))
    for attr, spellings in aliases.items():
        value = text.get(spellings[0], text.get(spellings[-1]))
        for only in spellings:
            yield f"{attr} as {only} only", _edit(base, nested, lambda t, o=only, v=value: (
                [t.pop(s, None) for s in spellings], t.update({o: v})))
        yield f"{attr}: every spelling, different values", _edit(base, nested, lambda t, v=value: t.update(
            {s: v + i for i, s in enumerate(spellings)}))
    if nested:
        yield "no text_config", {k: v for k, v in base.items() if k != "text_config"}


def _edit(base: dict, nested: bool, fn) -> dict:
    cfg = json.loads(json.dumps(base))
    fn(cfg.setdefault("text_config", {}) if nested else cfg)
    return cfg


@pytest.mark.parametrize("arch", sorted(mc.MODEL_TYPES))
def test_raw_reader_answers_as_autoconfig(arch):
    seen = 0
    for label, cfg in variants(arch):
        try:
            want = mc.read_transformers(cfg, arch, "config.json")
        except MoetraceError:  # e.g. layer_types longer than the defaulted num_hidden_layers: SGLang fails too
            continue
        assert want is not None, f"transformers {transformers.__version__} does not know {arch}"
        assert mc.read_raw(cfg, arch, "config.json") == want, f"{arch}, {label}: {json.dumps(cfg)[:300]}"
        seen += 1
    assert seen >= 5  # the written config, and at least four keys dropped or respelled


def test_every_supported_architecture_has_a_reader():
    assert set(ARCHITECTURES) == set(mc.MODEL_TYPES)


def test_qwen3_moe_as_transformers_writes_it():
    """The issue's refusal: save_pretrained keeps num_local_experts only; both readers
    answer num_experts from it, and a plain key lookup would not."""
    cfg = written("Qwen3MoeForCausalLM")
    assert "num_experts" not in cfg and cfg["num_local_experts"] == 4
    for reader in ("raw", "transformers"):
        assert mc.read_decoder_config(cfg, "Qwen3MoeForCausalLM", "config.json", reader)["num_experts"] == 4


def test_spec_without_transformers_equals_spec_with_it(monkeypatch):
    """`pip install moetrace` without transformers reads the same spec."""
    specs = {}
    for arch in sorted(mc.MODEL_TYPES):
        specs[arch] = spec_from_config(written(arch), "config.json")
    monkeypatch.setattr(mc, "_transformers", lambda: None)
    monkeypatch.setattr(mc, "_answer_path", lambda key: None)  # nor its remembered answers
    for arch, want in specs.items():
        assert spec_from_config(written(arch), "config.json") == want, arch
    # DeepSeek's written config leaves nothing out here; its class default for
    # first_k_dense_replace (3) shows when the key is dropped:
    cfg = written("DeepseekV3ForCausalLM")
    cfg.pop("first_k_dense_replace")
    cfg["num_hidden_layers"] = 5
    assert spec_from_config(cfg, "config.json").moe_layers == (3, 4)


def test_transformers_answer_is_remembered_per_config_and_release(tmp_path, monkeypatch):
    """A second process reading the same config gets transformers' answer without
    importing it; another config (or another transformers release) is asked again."""
    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path))
    arch = "Qwen3MoeForCausalLM"
    cfg = written(arch)
    first = mc.read_transformers(cfg, arch, "config.json")
    asked = []
    monkeypatch.setattr(mc, "_ask_transformers", lambda *a: asked.append(a) or {"num_experts": -1})
    assert mc.read_transformers(cfg, arch, "config.json") == first and not asked
    other = dict(cfg, num_local_experts=cfg["num_local_experts"] + 1)
    assert mc.read_transformers(other, arch, "config.json") == {"num_experts": -1} and len(asked) == 1
    monkeypatch.setattr(mc, "installed_release", lambda name: "0.0-another-release")
    assert mc.read_transformers(cfg, arch, "config.json") == {"num_experts": -1} and len(asked) == 2


@pytest.mark.parametrize("dist", ["transformers", "numpy", "pyarrow", "click", "xxhash", "not-installed-dist"])
def test_the_release_is_importlib_metadatas(dist):
    """The release read off the .dist-info folder's name is importlib.metadata's answer."""
    from importlib import metadata

    try:
        want = metadata.version(dist)
    except metadata.PackageNotFoundError:
        want = None
    assert mc.installed_release(dist) == want


def _record(folder, name: str, release: str, kind: str) -> None:
    """A distribution's metadata record on a path entry: {name}-{release}.dist-info/METADATA,
    or an {name}.egg-info/PKG-INFO (whose folder name carries no release)."""
    record = folder / (f"{name}-{release}.dist-info" if kind == "dist-info" else f"{name}.egg-info")
    record.mkdir(parents=True)
    text = f"Metadata-Version: 2.1\nName: {name}\nVersion: {release}\n"
    (record / ("METADATA" if kind == "dist-info" else "PKG-INFO")).write_text(text)


def test_the_first_record_on_sys_path_wins_and_egg_info_asks_importlib(tmp_path, monkeypatch):
    """A .dist-info ahead on sys.path shadows the installed one, as for importlib.metadata;
    where an .egg-info is the record (its name may not carry the release), importlib answers."""
    from importlib import metadata

    for name, release, kind in (("moetrace_probe_dist", "9.8.7", "dist-info"), ("moetrace_probe_egg", "1.2.3",
                                                                                "egg-info")):
        _record(tmp_path / kind, name, release, kind)
        monkeypatch.syspath_prepend(str(tmp_path / kind))
        assert mc.installed_release(name) == metadata.version(name) == release


def _kept(cache) -> list:
    return sorted((cache / "config").glob("*.json"))


def test_a_kept_answer_is_held_to_its_config_and_to_the_raw_reader(make_ckpt, tmp_path, monkeypatch):
    """A file under $MOETRACE_CACHE/config saying num_hidden_layers 1 (edited in place, or
    planted in the format of an earlier release) is ignored: the index still has both layers."""
    from support.cli import cli

    from moetrace.checkpoints.index import index_metadata

    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    ckpt = make_ckpt(num_layers=2, num_experts=4, hidden=128, intermediate=256, seed=11)
    assert cli("index", ckpt, "--tp", "1", "-o", tmp_path / "a.parquet").exit_code == 0
    (kept,) = _kept(tmp_path / "cache")
    doc = json.loads(kept.read_text())
    assert doc["answer"]["num_hidden_layers"] == 2
    for planted in ({**doc, "answer": {**doc["answer"], "num_hidden_layers": 1}},  # edited in place
                    {**doc["answer"], "num_hidden_layers": 1},  # the bare answer an earlier release kept
                    {"for": "0" * 64, "answer": {**doc["answer"], "num_hidden_layers": 1}}):  # another config's
        kept.write_text(json.dumps(planted))
        shutil.rmtree(tmp_path / "cache" / "index")  # the index is built again, from the config as read now
        r = cli("index", ckpt, "--tp", "1", "-o", tmp_path / "b.parquet")
        assert r.exit_code == 0 and index_metadata(str(tmp_path / "b.parquet"))["layers"] == [0, 1], r.output
        kept.write_text(json.dumps(planted))
        assert mc.read_decoder_config(*_cfg(ckpt))["num_hidden_layers"] == 2
    # the control: an honest kept answer is used without asking transformers again
    kept.unlink()
    mc.read_decoder_config(*_cfg(ckpt))
    asked = []
    monkeypatch.setattr(mc, "_ask_transformers", lambda *a: asked.append(a))
    assert mc.read_decoder_config(*_cfg(ckpt))["num_hidden_layers"] == 2 and not asked


def _cfg(ckpt) -> tuple:
    cfg = json.loads((ckpt / "config.json").read_text())
    return cfg, cfg["architectures"][0], "config.json"


def test_no_cache_neither_reads_nor_writes_the_config_cache(make_ckpt, tmp_path, monkeypatch):
    from support.cli import cli

    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    ckpt = make_ckpt(num_layers=2, num_experts=4, hidden=128, intermediate=256, seed=11)
    asked = []
    real = mc._ask_transformers
    monkeypatch.setattr(mc, "_ask_transformers", lambda *a: asked.append(a) or real(*a))
    assert cli("index", ckpt, "--tp", "1", "-o", tmp_path / "a.parquet", "--no-cache").exit_code == 0
    assert asked and _kept(tmp_path / "cache") == []
    n = len(asked)
    mc.read_decoder_config(*_cfg(ckpt))  # without --no-cache: asked, then kept
    assert len(asked) == n + 1 and len(_kept(tmp_path / "cache")) == 1
    assert cli("index", ckpt, "--tp", "1", "-o", tmp_path / "b.parquet", "--no-cache").exit_code == 0
    assert len(asked) > n + 1  # the kept answer was not read
