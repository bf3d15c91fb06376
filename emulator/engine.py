"""Request execution on one rank: byte tokens, chunked prefill, prefix cache, greedy decode.

Every rank runs the same ``Engine.generate`` on the same request in lockstep
(the MoE all-reduce is the only cross-rank step), so the ranks' state (prefix
cache included) stays identical without extra messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moetrace.emulator.config import VOCAB_SIZE
from moetrace.emulator.model import EmulatedMoeForCausalLM, KVCache
from moetrace.errors import MoetraceError


def encode(text: str) -> list[int]:
    """Byte-level tokens: UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def normalize_request(req) -> dict:
    """str | list[int] | {"prompt": str | list[int], "max_tokens": int} -> {"prompt_ids", "max_tokens"}."""
    if isinstance(req, (str, list, tuple)):
        req = {"prompt": req}
    if not isinstance(req, dict) or "prompt" not in req:
        raise MoetraceError(f"a request is a prompt string, a list of token ids or {{'prompt': ..., 'max_tokens': n}}, "
                            f"got {req!r:.80}")
    prompt = req["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI allows a batch of one
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise MoetraceError(f"token ids must be in [0, {VOCAB_SIZE}), got {bad[:3]}")
    else:
        raise MoetraceError("prompt must be a string or a list of token ids")
    if not ids:
        raise MoetraceError("prompt is empty: need at least one token")
    max_tokens = req.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 0 <= max_tokens <= 4096:
        raise MoetraceError(f"max_tokens must be an integer in [0, 4096], got {max_tokens!r}")
    return {"prompt_ids": ids, "max_tokens": max_tokens}


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]
    token0_logits: torch.Tensor  # logits that chose output token 0 (last prompt position), float32 CPU
    cached_tokens: int
    chunks: list[int] = field(default_factory=list)  # prefill chunk sizes

    @property
    def text(self) -> str:
        return decode(self.output_ids)


class Engine:
    def __init__(self, model: EmulatedMoeForCausalLM, device, chunk_tokens: int, prefix_cache: bool = True,
                 cache_entries: int = 8):
        self.model = model
        self.device = torch.device(device)
        self.chunk_tokens = chunk_tokens
        self.prefix_cache = prefix_cache
        self.cache_entries = cache_entries
        self._cache: list[tuple[list[int], KVCache]] = []  # (prompt ids, kv of exactly those), newest last

    def _lookup(self, ids: list[int]) -> tuple[int, KVCache]:
        best, best_kv = 0, None
        if self.prefix_cache:
            for prompt, kv in self._cache:
                n = 0
                for a, b in zip(prompt, ids):
                    if a != b:
                        break
                    n += 1
                if n > best:
                    best, best_kv = n, kv
        reuse = min(best, len(ids) - 1)  # at least one token is computed: it yields the logits
        if reuse <= 0 or best_kv is None:
            return 0, KVCache(self.model.num_layers)
        return reuse, best_kv.truncated(reuse)

    def _store(self, ids: list[int], kv: KVCache) -> None:
        if not self.prefix_cache:
            return
        self._cache = [(p, k) for p, k in self._cache if p != ids]
        self._cache.append((list(ids), kv.truncated(len(ids))))
        del self._cache[: -self.cache_entries]

    def _forward(self, ids: list[int], kv: KVCache, start: int) -> torch.Tensor:
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.model(t, kv, start)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        cached, kv = self._lookup(prompt_ids)
        pos, chunks, logits = cached, [], None
        while pos < len(prompt_ids):
            chunk = prompt_ids[pos : pos + self.chunk_tokens]
            logits = self._forward(chunk, kv, pos)
            chunks.append(len(chunk))
            pos += len(chunk)
        self._store(prompt_ids, kv)
        last = logits[-1]
        token0_logits = last.detach().to("cpu", torch.float32).clone()
        out: list[int] = []
        for i in range(max_tokens):
            tok = int(torch.argmax(last))
            out.append(tok)
            if i + 1 < max_tokens:
                last = self._forward([tok], kv, pos)[-1]
                pos += 1
        return Generation(list(prompt_ids), out, token0_logits, cached, chunks)
