"""Commands that need no tensors do not import torch (seconds of start-up for
milliseconds of work): `hook-spec`, with or without an index to read. Judged by the
modules a run loaded, in a fresh process, never by time.

`index` answered from the cache does load torch: the config is read as SGLang reads it,
through transformers' AutoConfig (which imports torch where it is installed), and the
hit is proved by cutting a sample of shards again (checkpoints/index_cache.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Runs `moetrace ARGS` in this process and prints which moetrace module imported torch
# first (the innermost moetrace frame on the stack when `import torch` began), or null.
_PROBE = r"""
import json, sys

class Watch:
    importer = None

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and Watch.importer is None:
            f = sys._getframe(1)
            while f is not None and not f.f_globals.get("__name__", "").startswith("moetrace"):
                f = f.f_back
            Watch.importer = f.f_globals["__name__"] if f is not None else "(not moetrace)"
        return None

sys.meta_path.insert(0, Watch())
from moetrace.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "importer": Watch.importer}))
"""


def _run(*args, env=None) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 0, proc.stdout + proc.stderr
    return out


def _fingerprint_needs_torch() -> bool:
    code = "import sys, moetrace.fingerprint; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


def _torch_free(out: dict) -> None:
    """No torch; except, while moetrace.fingerprint itself imports torch, through it alone
    (the index's fp_version check): then an expected failure that names it."""
    if out["torch"] and out["importer"] == "moetrace.fingerprint" and _fingerprint_needs_torch():
        pytest.xfail("moetrace.fingerprint imports torch at import time (the only importer here)")
    assert not out["torch"], f"torch imported by {out['importer']}"


def test_hook_spec_does_not_import_torch(tmp_path):
    out = _run("hook-spec", "--out", tmp_path / "traces", "--layers", "0-3", "--guard-rows", "all")
    assert not out["torch"], f"torch imported by {out['importer']}"


def test_hook_spec_with_an_index_reads_it_without_torch(small_index, tmp_path):
    _torch_free(_run("hook-spec", "--out", tmp_path / "traces", "--index", small_index, "--guard", "alert"))
