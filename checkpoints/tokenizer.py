"""The tokenizer a synthetic checkpoint ships with: a byte-level BPE, so a real server
(SGLang, vLLM, transformers) can turn any text into ids below the model's vocabulary.

With the `tokenizers` package (a dependency of transformers) the BPE is trained here on a
fixed corpus (no hub access); without it, the same byte-level tokenizer is written with
no merges (one token per byte), which every tokenizers reader loads the same way. Both are
deterministic, and neither is part of the checkpoint's identity (config + tensor headers).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

VOCAB_SIZE = 512  # config.json's vocab_size: the embedding rows; the tokenizer uses at most this many ids
EOS = "<|endoftext|>"  # id 0: the first special token, before the 256 byte tokens
# Ids 1-4: the vision markers a Qwen3.5 processor looks up (config.json's *_token_id say which)
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
SPECIAL = [EOS, *VISION_TOKENS.values()]
MAX_LENGTH = 4096
# Text the BPE is trained on: the words traffic prompts are made of (servers.traffic), and a little more.
CORPUS_WORDS = ("expert slot rank layer scale fence copy stream event prefill chunk token shard weight block host "
                "device barrier writer reader the a of and to in is that it for on with as was by an be this "
                "moe tensor parallel kernel pack vector server request answer").split()


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins GPT-2's byte-level pre-tokenizer maps bytes to, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _bytes_only() -> str:
    """tokenizer.json of a byte-level BPE without merges (what `tokenizers` would train on no text)."""
    vocab = {**{t: i for i, t in enumerate(SPECIAL)}, **{c: i + len(SPECIAL) for i, c in enumerate(_byte_alphabet())}}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(SPECIAL)],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    return json.dumps(doc)


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """tokenizer.json's text: trained once per process (deterministic), or bytes only."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        return _bytes_only()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = [" ".join(CORPUS_WORDS[(i * 7 + j) % len(CORPUS_WORDS)] for j in range(24)) for i in range(400)]
    tok.train_from_iterator(lines, trainer)
    return tok.to_str()


def tokenizer_files(vision: dict | None = None) -> dict[str, str]:
    """File name -> text of the tokenizer files a checkpoint folder holds. vision: the vision
    tower's patch sizes (Qwen3.5), which adds the image processor's preprocessor_config.json."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "bos_token": None,
              "model_max_length": MAX_LENGTH}
    files = {"tokenizer.json": tokenizer_json(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
    if vision is not None:
        image = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                 "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
                 "merge_size": vision["spatial_merge_size"], "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 64, "longest_edge": 65536}}
        files["preprocessor_config.json"] = json.dumps(image, indent=2) + "\n"
    return files


def vision_token_ids() -> dict[str, int]:
    """config.json's vision marker ids (Qwen3.5): where the tokenizer holds them."""
    return {key: SPECIAL.index(token) for key, token in VISION_TOKENS.items()}


def write_tokenizer(folder: str | Path, vision: dict | None = None) -> None:
    for name, text in tokenizer_files(vision).items():
        (Path(folder) / name).write_text(text)
