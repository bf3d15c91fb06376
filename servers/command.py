"""A server command as moetrace reads it: its TP size and model flags, which SGLang it
starts, the flags that keep hooks firing, and the command with moetrace's hooks added.

Hooks run only on the eager forward path, so capturing every step turns CUDA
graphs off. Upstream ``sglang`` 0.5.23 has ``--disable-prefill-cuda-graph`` and
``--disable-decode-cuda-graph`` (``--disable-cuda-graph`` survives there as a
deprecated alias, ``server_args.py``); the KT fork, distribution ``sglang-kt``, has
only ``--disable-cuda-graph``. Both install the import package ``sglang``. The
distribution name decides for the fork; otherwise the server's own ``--help``;
never a version number.
"""

from __future__ import annotations

import json
import os
import subprocess
from importlib import metadata
from typing import Sequence

from moetrace.errors import MoetraceError

SPLIT_CUDA_GRAPH_FLAGS = ("--disable-prefill-cuda-graph", "--disable-decode-cuda-graph")
LEGACY_CUDA_GRAPH_FLAGS = ("--disable-cuda-graph",)
SERVER_DISTRIBUTIONS = ("sglang-kt", "sglang")  # both provide the import package `sglang`
FLAG_CHOICES = ("auto", "split", "legacy")
HELP_TIMEOUT_S = 180.0  # a real server imports torch and its kernels before printing help


def server_distribution(path: Sequence[str] | None = None) -> tuple[str, str] | None:
    """(distribution name, version) of the installed package providing ``sglang`` (in
    `path`, else on sys.path); the fork first when both are there."""
    found = {}
    for dist in metadata.distributions(**({"path": list(path)} if path is not None else {})):
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name in SERVER_DISTRIBUTIONS and name not in found:
            top = (dist.read_text("top_level.txt") or "sglang").split()
            if "sglang" in top:
                found[name] = dist.version
    for name in SERVER_DISTRIBUTIONS:
        if name in found:
            return name, found[name]
    return None


def flags_from_help(text: str) -> tuple[str, ...] | None:
    """The CUDA-graph flags a server's --help lists (the split ones when it has them)."""
    if all(f in text for f in SPLIT_CUDA_GRAPH_FLAGS):
        return SPLIT_CUDA_GRAPH_FLAGS
    words = set(text.replace(",", " ").replace("=", " ").split())
    if LEGACY_CUDA_GRAPH_FLAGS[0] in words:
        return LEGACY_CUDA_GRAPH_FLAGS
    return None


def invokes_sglang(cmd: Sequence[str]) -> bool:
    """The command starts SGLang itself (``-m sglang.launch_server``, the ``sglang``
    script, ``sglang_router``): only then is its ``--help`` SGLang's. Any other command
    (a wrapper script, a stand-in) may ignore --help and start serving, so it is never
    probed."""
    return any(os.path.basename(a) == "sglang" or a.startswith(("sglang.", "sglang_router.")) for a in cmd)


def probe_help(cmd: Sequence[str], timeout_s: float = HELP_TIMEOUT_S) -> str | None:
    """The server command's ``--help`` output, or None when it fails or does not answer."""
    try:
        done = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, env=dict(os.environ))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout or "") + (done.stderr or "") if done.returncode == 0 else None


def cuda_graph_flags_for(cmd: Sequence[str], choice: str = "auto", distribution: tuple[str, str] | None = None,
                         help_text: str | None = None) -> tuple[tuple[str, ...], str]:
    """(flags, how they were chosen) for the server command `cmd`.

    choice "split" / "legacy" forces a spelling ("option"). "auto": the fork's
    distribution has only the legacy flag ("distribution"); else the flags the
    command's --help lists ("help"); else the legacy flag, which every upstream
    release accepts ("default")."""
    if choice == "split":
        return SPLIT_CUDA_GRAPH_FLAGS, "option"
    if choice == "legacy":
        return LEGACY_CUDA_GRAPH_FLAGS, "option"
    if distribution is not None and distribution[0] == "sglang-kt":
        return LEGACY_CUDA_GRAPH_FLAGS, "distribution"
    text = help_text if help_text is not None else probe_help(cmd)
    flags = flags_from_help(text) if text else None
    if flags is not None:
        return flags, "help"
    return LEGACY_CUDA_GRAPH_FLAGS, "default"


TP_FLAGS = ("--tp", "--tp-size", "--tensor-parallel-size", "-tp")  # -tp: vLLM's short form
MODEL_FLAGS = ("--model-path", "--model")


def flag_value(cmd: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the first of `names` in the command (``--tp 2`` or ``--tp=2``), else None."""
    for i, arg in enumerate(cmd):
        for n in names:
            if arg == n and i + 1 < len(cmd):
                return cmd[i + 1]
            if arg.startswith(n + "="):
                return arg.split("=", 1)[1]
    return None


def expected_tp(cmd: Sequence[str]) -> int | None:
    v = flag_value(cmd, TP_FLAGS)
    return int(v) if v and v.isdigit() else None


def is_moetrace_serve(cmd: Sequence[str]) -> bool:
    """The command starts `moetrace serve` (the emulated KT server)."""
    cmd = list(cmd)
    return "serve" in cmd and any(t.endswith("moetrace") or t == "moetrace.cli" for t in cmd[: cmd.index("serve")])


# Flags of `moetrace serve` and `vllm serve` that take no value (everything else starting with - takes one).
_BARE_FLAGS = ("--disable-cuda-graph", "--disable-prefill-cuda-graph", "--disable-decode-cuda-graph",
               "--enforce-eager", "--trust-remote-code")


def model_path_of_command(cmd: Sequence[str]) -> str | None:
    """The model the server command loads: --model-path / --model, else the positional
    argument of `moetrace serve CKPT` or `vllm serve MODEL`; None when it says none."""
    found = flag_value(cmd, MODEL_FLAGS)
    cmd = list(cmd)
    if found is not None or "serve" not in cmd:
        return found
    rest, i = cmd[cmd.index("serve") + 1:], 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("-"):
            return arg
        i += 1 if "=" in arg or arg in _BARE_FLAGS else 2
    return None


def build_command(cmd: Sequence[str], spec: list[dict], flags: Sequence[str]) -> list[str]:
    """cmd + merged --forward-hooks + the CUDA-graph flags it does not have yet."""
    out: list[str] = []
    merged = False
    i = 0
    cmd = list(cmd)
    while i < len(cmd):
        arg = cmd[i]
        if arg == "--forward-hooks" or arg.startswith("--forward-hooks="):
            raw = arg.split("=", 1)[1] if "=" in arg else (cmd[i + 1] if i + 1 < len(cmd) else "[]")
            i += 1 if "=" in arg else 2
            try:
                existing = json.loads(raw)
            except json.JSONDecodeError as err:
                raise MoetraceError(f"--forward-hooks in the server command is not JSON ({err})") from None
            existing = existing if isinstance(existing, list) else [existing]
            out += ["--forward-hooks", json.dumps(existing + spec)]
            merged = True
            continue
        out.append(arg)
        i += 1
    if not merged:
        out += ["--forward-hooks", json.dumps(spec)]
    for f in flags:
        if f not in out:
            out.append(f)
    return out
