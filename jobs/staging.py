"""What a server command says of KT staging, and prompts long enough to reach it.

The KT fork stages a layer's experts through the host slots (``SharedFullContext.load``,
the path moetrace exists to check) only in a prefill pass of at least
``--kt-gpu-prefill-token-threshold`` tokens (unset or 0: never), and a pass holds at most
``--chunked-prefill-size`` tokens. ``moetrace serve`` has the same two settings (also
spelled ``--prefill-threshold`` and ``--chunk-tokens``) with its own defaults. From the
command, before anything starts: ``audit --launch`` sizes its prompts from the threshold
when ``--prompt-tokens`` is not given, and refuses a command whose passes can never reach
it (analysis.staging holds the trace to what the server itself recorded).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Sequence

from moetrace.emulator.config import EmulatorConfig
from moetrace.servers.command import flag_value, is_moetrace_serve

THRESHOLD_FLAGS = ("--kt-gpu-prefill-token-threshold", "--prefill-threshold")
CHUNK_FLAGS = ("--chunked-prefill-size", "--chunk-tokens")
DEFAULT_PROMPT_WORDS = 2048  # a server that does not stage: long prompts all the same


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _serve_default(name: str) -> int:
    return next(f.default for f in fields(EmulatorConfig) if f.name == name)


def command_staging(cmd: Sequence[str]) -> dict | None:
    """{"threshold", "chunked_prefill_size" (None: the command does not say), "found_by"}
    of a command that stages (a positive threshold), else None."""
    threshold, chunk = _int(flag_value(cmd, THRESHOLD_FLAGS)), _int(flag_value(cmd, CHUNK_FLAGS))
    found_by = "the command's flags"
    if is_moetrace_serve(cmd):
        found_by = "the command's flags and moetrace serve's defaults"
        threshold = _serve_default("prefill_threshold") if threshold is None else threshold
        chunk = _serve_default("chunk_tokens") if chunk is None else chunk
    if threshold is None or threshold <= 0:
        return None
    return {"threshold": threshold, "chunked_prefill_size": chunk if chunk is not None and chunk > 0 else None,
            "found_by": found_by}


def prompt_words(staging: dict | None) -> tuple[int, str]:
    """(words per fresh prompt, where that number comes from) when --prompt-tokens is not
    given: past the staging threshold (a word is at least one token), else the default."""
    if staging is None:
        return DEFAULT_PROMPT_WORDS, "the default"
    threshold = int(staging["threshold"])
    return threshold + max(16, threshold // 8), "the staging threshold"


def never_stages(staging: dict | None, words: int | None = None) -> str | None:
    """Why no prefill pass of this command can stage (its passes are shorter than the
    threshold), or None. words: the --prompt-tokens given, named in the sentence."""
    if staging is None or staging.get("chunked_prefill_size") is None:
        return None
    chunk, threshold = int(staging["chunked_prefill_size"]), int(staging["threshold"])
    if chunk >= threshold:
        return None
    prompts = f" (prompts of ~{words} words, --prompt-tokens {words})" if words is not None else ""
    return (f"the server stages a layer only in a prefill pass of at least {threshold} tokens "
            f"(--kt-gpu-prefill-token-threshold {threshold}) but its passes hold at most {chunk} tokens "
            f"(--chunked-prefill-size {chunk}; read from {staging['found_by']}): no request can take the staged path "
            f"under test{prompts}")
