"""A complete tiny model a real vLLM server serves (tests only): transformers' own
``Qwen3MoeForCausalLM`` with random BF16 weights, saved by ``save_pretrained``, and a
byte-level BPE tokenizer trained here with ``tokenizers`` (no hub access).

Sizes are the smallest vLLM's CPU kernels take: hidden 64 (the MoE kernels want
multiples of 32), head_dim 32 (the smallest head size of its CPU attention), and
moe_intermediate_size 48, so each TP2 rank holds I_tp = 24 rows, which vLLM's CPU
experts zero-pad to 32 after loading (experts/cpu_moe.py ``_pad_moe_intermediate``):
the padding is exercised, not avoided.

    python -m support.vllm_model FOLDER      (what the tests run, in any venv with transformers)
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

VOCAB = 512
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
             moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
             max_position_embeddings=2048, vocab_size=VOCAB, decoder_sparse_step=1, mlp_only_layers=[],
             norm_topk_prob=True, tie_word_embeddings=False)
# Text the tokenizer is trained on: every word traffic.prompt() sends, and a little more.
CORPUS_WORDS = ("expert slot rank layer scale fence copy stream event prefill chunk token shard weight block host "
                "device barrier writer reader the a of and to in is that it for on with as was by an be this "
                "moe tensor parallel kernel pack vector server request answer").split()


def train_tokenizer(folder: Path) -> None:
    """A byte-level BPE of VOCAB tokens, saved as tokenizer.json with its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = [" ".join(CORPUS_WORDS[(i * 7 + j) % len(CORPUS_WORDS)] for j in range(24)) for i in range(400)]
    tok.train_from_iterator(lines, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "model_max_length": SIZES["max_position_embeddings"]}))


def write_model(folder: Path, seed: str = "vllm-tiny", **sizes) -> Path:
    """The tiny Qwen3-MoE in `folder` (created): config, safetensors, tokenizer; `sizes`
    override SIZES."""
    import torch
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(zlib.crc32(seed.encode()))  # the same model in every process
    cfg = transformers.Qwen3MoeConfig(**{**SIZES, **sizes}, bos_token_id=0, eos_token_id=0)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    train_tokenizer(folder)
    return folder


if __name__ == "__main__":
    print(write_model(Path(sys.argv[1])))
