"""Commands that need no tensors do not import torch (seconds of start-up for
milliseconds of work): `hook-spec`, with or without an index to read, and `index` on the
CPU, built or answered from the cache (the shards are planned as bytes of the files and
hashed with xxhash; the hit's proof re-hashes its sample the same way). `index` loads only
click, numpy, pyarrow and xxhash besides the standard library: no pandas either (pyarrow
imports it on its first conversion of Python values; checkpoints/arrow_columns.py), nor
pyarrow.compute for an index of this size. Judged
by the modules a run loaded, in a fresh process, never by time.

The first `index` of a config.json reads it as SGLang does, through transformers'
AutoConfig (which imports torch where it is installed); its answer is kept in
$MOETRACE_CACHE/config/, and every later process reads it back."""

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
import importlib, os
if os.environ.get("PROBE_IMPORT"):  # a negative control: what a regression would load
    importlib.import_module(os.environ["PROBE_IMPORT"])
forks = []  # per fork: whether pyarrow was loaded by then
os.register_at_fork(before=lambda: forks.append("pyarrow" in sys.modules))
if os.environ.get("PROBE_WORKERS"):  # hash in worker processes, however small the checkpoint
    from moetrace.checkpoints import index_cpu
    index_cpu.PROCESS_BYTES, index_cpu.UNIT_BYTES = 0, 1
from moetrace.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
packages = sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names))
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "importer": Watch.importer, "packages": packages,
                  "pyarrow_compute": "pyarrow.compute" in sys.modules, "pyarrow_at_fork": forks}))
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


def test_help_and_hook_spec_load_click_alone(tmp_path):
    """`moetrace --help` and `hook-spec` without an index: click and moetrace, no pyarrow or numpy
    (~0.2 s of imports that neither needs); the Parquet schemas are built on first use."""
    for args in (("--help",), ("hook-spec", "--out", tmp_path / "traces", "--layers", "0-3")):
        out = _run(*args)
        assert _third_party(out) <= {"click", "moetrace"}, (args, sorted(_third_party(out)))
    from moetrace import schema

    assert schema.TRACE_SCHEMA.field("digest").type.byte_width == 16 and "checkpoint_id" in schema.INDEX_SCHEMA.names


def test_hook_spec_with_an_index_reads_it_without_torch(small_index, tmp_path):
    _torch_free(_run("hook-spec", "--out", tmp_path / "traces", "--index", small_index, "--guard", "alert"))


# What `moetrace index` may load besides the standard library (and the interpreter's own
# hooks: the editable install's finder, setuptools' distutils shim, Cython's runtime).
INDEX_PACKAGES = {"click", "moetrace", "numpy", "pyarrow", "xxhash"}


def _third_party(out: dict) -> set[str]:
    return {p for p in out["packages"] if not p.startswith("_") and p not in ("cython_runtime",)}


def test_index_built_and_from_the_cache_loads_no_torch_nor_pandas(make_ckpt, tmp_path):
    """A build (the cache holds no index of it) and a cache hit, both proved on the data,
    in processes whose config answer is cached (the first run's)."""
    import os
    import shutil

    ckpt = make_ckpt(family="qwen3_5_moe", fmt="fp8_block", num_layers=2, num_experts=4, hidden=256,
                     intermediate=512, draft=True)
    env = {**os.environ, "MOETRACE_CACHE": str(tmp_path / "cache")}
    _run("index", ckpt, "--tp", "2", "-o", tmp_path / "first.parquet", env=env)  # fills the config answer
    shutil.rmtree(tmp_path / "cache" / "index")
    for run in ("built", "from the cache"):
        out = _run("index", ckpt, "--tp", "2", "-o", tmp_path / f"{run}.parquet", "--json", env=env)
        assert not out["torch"], f"{run}: torch imported by {out['importer']}"
        assert _third_party(out) <= INDEX_PACKAGES, f"{run}: {sorted(_third_party(out) - INDEX_PACKAGES)}"
        assert not out["pyarrow_compute"], f"{run}: pyarrow.compute imported (40-90 ms)"
    assert (tmp_path / "built.parquet").read_bytes() == (tmp_path / "from the cache.parquet").read_bytes()


def test_index_forks_its_workers_before_importing_pyarrow(make_ckpt, tmp_path):
    """pyarrow (a tenth of a second) is imported while the hashing workers run, not before
    they start; an output there that is not an index is refused all the same, and stays."""
    import os
    import shutil

    ckpt = make_ckpt(family="qwen3_moe", fmt="fp8_block", num_layers=2, num_experts=4, hidden=256, intermediate=512)
    env = {**os.environ, "MOETRACE_CACHE": str(tmp_path / "cache"), "PROBE_WORKERS": "1"}
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the index hashes in this process")
    _run("index", ckpt, "--tp", "2", "-o", tmp_path / "first.parquet", env=env)  # fills the config answer
    shutil.rmtree(tmp_path / "cache" / "index")  # a build, never a hit
    out = _run("index", ckpt, "--tp", "2", "-o", tmp_path / "first.parquet", env=env)
    assert out["pyarrow_at_fork"] and not any(out["pyarrow_at_fork"]), out["pyarrow_at_fork"]
    assert "pyarrow" in out["packages"]
    shutil.rmtree(tmp_path / "cache" / "index")
    foreign = tmp_path / "notes.parquet"
    foreign.write_bytes(b"PAR1 someone else's file PAR1")
    proc = subprocess.run([sys.executable, "-c", _PROBE, "index", str(ckpt), "--tp", "2", "-o", str(foreign)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["code"] != 0
    assert "holds a file moetrace did not write" in proc.stderr and "Traceback" not in proc.stderr
    assert foreign.read_bytes() == b"PAR1 someone else's file PAR1"
    assert not list((tmp_path / "cache" / "index").glob("*.parquet"))  # the stopped build cached nothing


_ENDS = r"""
import atexit, os, sys
atexit.register(lambda: open(os.environ["ATEXIT_MARK"], "w").write("ran"))
from moetrace.cli import run
sys.argv[0] = "moetrace"
run()  # what the console script calls
"""


@pytest.mark.parametrize("quick", [True, False])
def test_the_console_entry_ends_with_its_exit_code_output_and_atexit(make_ckpt, tmp_path, quick):
    """The console script: index (QUICK_EXIT: the process ends without finalizing the
    interpreter) and analyze (a normal exit) give the same exit codes, complete output
    through a pipe, and run the atexit handlers."""
    import os

    ckpt = make_ckpt(family="qwen3_moe", fmt="fp8_block", num_layers=2, num_experts=4, hidden=256, intermediate=512)
    env = {**os.environ, "MOETRACE_CACHE": str(tmp_path / "cache"), "ATEXIT_MARK": str(tmp_path / "mark")}
    if quick:
        ok = ["index", str(ckpt), "--tp", "2", "-o", str(tmp_path / "i.parquet"), "--json"]
        bad = ["index", str(tmp_path / "nowhere"), "--tp", "2", "-o", str(tmp_path / "j.parquet")]
    else:
        ok = ["index", str(ckpt), "--tp", "2", "-o", str(tmp_path / "i.parquet")]  # builds the index analyze needs
        subprocess.run([sys.executable, "-c", _ENDS, *ok], env=env, check=True, capture_output=True)
        ok = ["analyze", "--help"]
        bad = ["analyze", str(tmp_path / "no-trace"), "--index", str(tmp_path / "i.parquet"), "-o",
               str(tmp_path / "report")]
    for args, code in ((ok, 0), (bad, 2)):
        (tmp_path / "mark").unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "-c", _ENDS, *args], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == code, proc.stderr
        assert (tmp_path / "mark").read_text() == "ran"
        if code:
            assert proc.stderr.startswith("moetrace: error:") and len(proc.stderr.splitlines()) == 1
        elif quick:
            assert json.loads(proc.stdout)["rows"] > 0  # the whole line came through the pipe


def test_the_package_list_sees_pandas(tmp_path):
    """Negative control: a run that loads pandas is told from one that does not."""
    import os

    clean = _run("hook-spec", "--out", tmp_path / "traces")
    out = _run("hook-spec", "--out", tmp_path / "traces", env={**os.environ, "PROBE_IMPORT": "pandas"})
    assert _third_party(clean) <= INDEX_PACKAGES and "pandas" in _third_party(out) - INDEX_PACKAGES
