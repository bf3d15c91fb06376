"""config.json as SGLang sees it: the decoder sizes moetrace reads, taken the way
transformers' config classes answer them (SGLang loads every config through
``AutoConfig``), with a raw JSON reader that knows the same aliases and defaults for
machines without transformers.

What differs from plain JSON keys (transformers 5.17-5.24; 5.19 is SGLang 0.5.23's pin):
- ``save_pretrained`` writes Qwen3-MoE's expert count as ``num_local_experts`` only
  (``Qwen3MoeConfig.attribute_map``: num_experts -> num_local_experts); DeepSeek-V3
  maps ``num_local_experts`` onto ``n_routed_experts``. Where both keys are written,
  ``num_local_experts`` wins.
- A key the file leaves out takes the config class's default (``save_pretrained``
  drops values equal to it): DeepSeek-V3's ``first_k_dense_replace`` is 3, not 0.
- Qwen3.5's vision-language config nests the decoder under ``text_config``.

tests/test_model_config.py holds the raw reader to AutoConfig over every family, key
by key, for the installed transformers.

Importing transformers' config classes costs seconds (they load torch._dynamo), paid by
every process that opens a checkpoint. What they answer depends only on the config's
contents and the transformers release, so the answer is kept in
``$MOETRACE_CACHE/config/`` under a hash of both: a second process reads it back
without importing transformers. A kept answer is used only when it names the config it
answers for (the same hash, inside the file) and agrees with the raw reader on every
attribute the raw reader knows (the sizes and the MoE layer rules): a file edited or
planted there is ignored and asked again, never believed. ``--no-cache`` (``no_cache()``)
neither reads nor writes it.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from moetrace.errors import MoetraceError

# architecture -> (model_type of the whole config, model_type of the decoder config,
# whether the decoder keys sit under text_config)
MODEL_TYPES: dict[str, tuple[str, str, bool]] = {
    "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3_moe", False),
    "Qwen3NextForCausalLM": ("qwen3_next", "qwen3_next", False),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "qwen3_5_moe_text", True),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", "qwen3_5_moe_text", False),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "deepseek_v3", False),
}

_QWEN = ("num_hidden_layers", "hidden_size", "moe_intermediate_size", "num_experts", "mlp_only_layers",
         "decoder_sparse_step", "shared_expert_intermediate_size")
_DEEPSEEK = ("num_hidden_layers", "hidden_size", "moe_intermediate_size", "n_routed_experts", "first_k_dense_replace",
             "moe_layer_freq", "n_shared_experts")
# decoder model_type -> the attributes moetrace reads
KEYS: dict[str, tuple[str, ...]] = {"qwen3_moe": _QWEN, "qwen3_next": _QWEN, "qwen3_5_moe_text": _QWEN,
                                     "deepseek_v3": _DEEPSEEK}
# decoder model_type -> attribute -> the JSON keys that set it, first present wins
# (the config class's attribute_map)
ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen3_moe": {"num_experts": ("num_local_experts", "num_experts")},
    "deepseek_v3": {"n_routed_experts": ("num_local_experts", "n_routed_experts")},
}
# decoder model_type -> attribute -> the config class's default (transformers 5.19);
# an attribute with no default here is absent when the file leaves it out.
DEFAULTS: dict[str, dict[str, object]] = {
    "qwen3_moe": {"num_experts": 128, "num_hidden_layers": 24, "hidden_size": 2048, "moe_intermediate_size": 768,
                  "mlp_only_layers": [], "decoder_sparse_step": 1},
    "qwen3_next": {"num_experts": 512, "num_hidden_layers": 48, "hidden_size": 2048, "moe_intermediate_size": 512,
                   "mlp_only_layers": [], "decoder_sparse_step": 1, "shared_expert_intermediate_size": 512},
    "qwen3_5_moe_text": {"num_experts": 256, "num_hidden_layers": 40, "hidden_size": 2048,
                         "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
    "deepseek_v3": {"n_routed_experts": 256, "num_hidden_layers": 61, "hidden_size": 7168,
                    "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "n_shared_experts": 1},
}
_MISSING = object()
_USE_CACHE = contextvars.ContextVar("moetrace_config_cache", default=True)


@contextlib.contextmanager
def no_cache():
    """Within: transformers is asked every time, nothing is read from or kept in the cache."""
    token = _USE_CACHE.set(False)
    try:
        yield
    finally:
        _USE_CACHE.reset(token)


def decoder_json(config: Mapping, arch: str, where: str) -> tuple[Mapping, str]:
    """(the JSON object holding the decoder keys, where it is for messages)."""
    nested = MODEL_TYPES[arch][2]
    if not nested:
        return config, where
    text = config.get("text_config", {})
    if text is None:
        text = {}
    if not isinstance(text, Mapping):
        raise MoetraceError(f"{where}: 'text_config' must be an object, found {text!r}")
    return text, f"{where} (text_config)"


def read_raw(config: Mapping, arch: str, where: str) -> dict[str, object]:
    """The decoder attributes moetrace reads, from the JSON alone: aliases and class
    defaults as transformers applies them. An attribute neither set nor defaulted is
    left out."""
    decoder_type = MODEL_TYPES[arch][1]
    text, _ = decoder_json(config, arch, where)
    aliases, defaults = ALIASES.get(decoder_type, {}), DEFAULTS[decoder_type]
    out: dict[str, object] = {}
    for key in KEYS[decoder_type]:
        value = next((text[k] for k in aliases.get(key, (key,)) if k in text), _MISSING)
        if value is _MISSING:
            value = defaults.get(key, _MISSING)
        if value is not _MISSING:
            out[key] = value
    return out


def _transformers():
    try:
        from transformers import CONFIG_MAPPING
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    return CONFIG_MAPPING, hf_logging


@contextlib.contextmanager
def _quiet(hf_logging):
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def installed_release(dist: str) -> str | None:
    """The installed release of the distribution `dist` (None when it is not installed), as
    importlib.metadata answers it: the first `{dist}-{release}.dist-info` folder on sys.path,
    read off its name; importlib.metadata itself where a path entry holds another kind of
    record (an .egg-info) or none is found. Importing importlib.metadata costs ~17 ms of every
    `index` run, a twentieth of a cache hit."""
    want = re.compile(rf"{re.escape(dist)}-([^-]+)\.(dist-info|egg-info)$", re.IGNORECASE)
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:  # a zip, a missing folder
            continue
        found = [m for m in map(want.match, names) if m]
        if found:
            if len(found) == 1 and found[0].group(2) == "dist-info":
                return found[0].group(1)
            break
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _answer_key(config: Mapping, arch: str) -> str | None:
    """The hash of (transformers release, architecture, the attributes read, the config);
    None without transformers."""
    release = installed_release("transformers")
    if release is None:
        return None
    key = json.dumps([release, arch, KEYS[MODEL_TYPES[arch][1]], config], sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()


def _answer_path(key: str | None) -> Path | None:
    """Where transformers' answer for this key is kept; None without one (or with --no-cache)."""
    if key is None or not _USE_CACHE.get():
        return None
    root = Path(os.environ.get("MOETRACE_CACHE", Path.home() / ".cache" / "moetrace"))
    return root / "config" / f"{key}.json"


def _remembered(path: Path | None, key: str | None, config: Mapping, arch: str, where: str
                ) -> dict[str, object] | None:
    """The kept answer, when it names this config and agrees with the raw reader on every
    attribute the raw reader answers; else None (asked again)."""
    try:
        doc = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("for") != key or not isinstance(doc.get("answer"), dict):
        return None
    answer = doc["answer"]
    try:
        raw = read_raw(config, arch, where)
    except MoetraceError:  # transformers is asked, and says what is wrong in its words
        return None
    if any(answer.get(k, _MISSING) != v for k, v in raw.items()):
        return None
    return answer


def _remember(path: Path | None, key: str | None, answer: dict[str, object]) -> dict[str, object]:
    """Keep the answer with the config it answers for (whole or not at all; a cache that
    cannot be written costs only time) and return it as it reads back, so the first
    process sees what later ones do."""
    try:
        text = json.dumps({"for": key, "answer": answer})
    except (TypeError, ValueError):
        return answer
    if path is not None:
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".config-", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except OSError:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    return json.loads(text)["answer"]


def read_transformers(config: Mapping, arch: str, where: str) -> dict[str, object] | None:
    """The same attributes as transformers' config class answers them; None when
    transformers is not importable or does not know the model type."""
    key = _answer_key(config, arch)
    path = _answer_path(key)
    answer = _remembered(path, key, config, arch, where)
    if answer is None:
        answer = _ask_transformers(config, arch, where)
        if answer is not None:
            answer = _remember(path, key, answer)
    return answer


def _ask_transformers(config: Mapping, arch: str, where: str) -> dict[str, object] | None:
    found = _transformers()
    if found is None:
        return None
    mapping, hf_logging = found
    model_type, decoder_type, nested = MODEL_TYPES[arch]
    if model_type not in mapping:
        return None
    data = {k: v for k, v in config.items() if k != "model_type"}
    try:
        with _quiet(hf_logging):
            cfg = mapping[model_type].from_dict(data)
    except Exception as err:  # transformers validates types (StrictDataclassFieldValidationError, ...)
        first = str(err).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:2])
        raise MoetraceError(f"{where}: transformers cannot read this {model_type} config: {detail}") from None
    text = cfg.text_config if nested else cfg
    out: dict[str, object] = {}
    for key in KEYS[decoder_type]:
        value = getattr(text, key, _MISSING)
        if value is not _MISSING:
            out[key] = value
    return out


def read_decoder_config(config: Mapping, arch: str, where: str, reader: str = "auto") -> dict[str, object]:
    """The decoder attributes moetrace reads (KEYS), as SGLang sees them. reader:
    "auto" (transformers when importable, else the raw reader), "raw", "transformers"."""
    if reader in ("auto", "transformers"):
        got = read_transformers(config, arch, where)
        if got is not None:
            return got
        if reader == "transformers":
            raise MoetraceError(f"{where}: transformers is not installed or does not know {MODEL_TYPES[arch][0]}")
    return read_raw(config, arch, where)
