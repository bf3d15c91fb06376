"""Smaller things a hostile sweep found, each with the answer a user should get: a plain
line instead of a raw KeyError or OSError, a hint that names an option the command has,
outputs others can read, a Markdown report that shows run ids as text, pictures titled
for the command that drew them, and a grid that shows unknown bytes over stale ones."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import cli, one_line_error
from support.traces import write_scenario

from moetrace.analysis import analyze
from moetrace.analysis.verdicts import STALE, UNKNOWN

TINY = ["--layers", "1", "--experts", "2", "--hidden", "128", "--intermediate", "128"]


def test_serve_on_a_compressed_tensors_block_checkpoint_is_one_line(tmp_path):
    """The emulator stages the fork's FP8 block path (w13_weight_scale_inv); a
    compressed-tensors block checkpoint's FusedMoE holds w13_weight_scale instead: one
    line saying so and how to make one it can serve, never `KeyError: 'w13_weight_scale_inv'`."""
    ckpt = tmp_path / "ct"
    assert cli("make-checkpoint", *TINY, "--quant-method", "compressed-tensors", "-o", ckpt).exit_code == 0
    r = cli("serve", ckpt, "--tp", "1", "--port", "0")
    one_line_error(r, str(ckpt), "compressed-tensors", "weight_scale", "--quant-method fp8")
    assert "KeyError" not in r.output


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_make_checkpoint_files_have_the_umasks_mode(tmp_path, umask):
    old = os.umask(umask)
    try:
        for files in ("1", "2"):
            out = tmp_path / f"c{files}-{umask:o}"
            assert cli("make-checkpoint", *TINY, "--files", files, "-o", out).exit_code == 0
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
            assert modes and set(modes.values()) == {0o666 & ~umask}, modes  # safetensors like config.json
    finally:
        os.umask(old)


def _read_only(cache: Path, *command: str) -> subprocess.CompletedProcess:
    """moetrace COMMAND with MOETRACE_CACHE bind-mounted read-only (a user and mount namespace)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(cache), sys.executable, "-m", "moetrace.cli",
                           *command], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MOETRACE_CACHE=str(cache)))
    if "mount" in proc.stderr and "moetrace" not in proc.stderr:
        pytest.skip(f"no read-only bind mount here: {proc.stderr.strip()}")
    return proc


def test_a_stale_entry_in_a_read_only_cache_is_one_line(small_model, tmp_path):
    """The cache holds an entry for this checkpoint that is no longer right (here: garbled),
    and MOETRACE_CACHE is read-only: one line naming it, what to do with `index` and with
    analyze/audit (which have no --no-cache), never a raw `[Errno 30]`; a good entry in the
    same read-only cache is simply used."""
    cache = tmp_path / "cache"
    r = cli("index", small_model.path, "--tp", "2", "-o", tmp_path / "first.parquet", env={"MOETRACE_CACHE": str(cache)})
    assert r.exit_code == 0, r.output
    (entry,) = (cache / "index").glob("*.parquet")
    good = _read_only(cache, "index", small_model.path, "--tp", "2", "-o", str(tmp_path / "hit.parquet"))
    assert good.returncode == 0, good.stderr
    entry.write_bytes(b"not an index any more")
    proc = _read_only(cache, "index", small_model.path, "--tp", "2", "-o", str(tmp_path / "second.parquet"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"moetrace: error: MOETRACE_CACHE {cache / 'index'}: cannot write the index cache "
                               "there (Read-only file system)")
    assert "--no-cache -o FILE (analyze and audit then take --index FILE)" in lines[0] and "Errno" not in lines[0]
    assert entry.read_bytes() == b"not an index any more" and not (tmp_path / "second.parquet").exists()


def test_the_cache_error_of_audit_names_only_what_audit_takes(small_model, tmp_path):
    """audit --checkpoint builds its index through the cache; audit has no --no-cache, so
    the error must not tell it to pass one."""
    write_scenario(small_model, str(tmp_path), "r", [0])
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    r = cli("audit", tmp_path / "r", "--checkpoint", small_model.path, env={"MOETRACE_CACHE": str(blocker)})
    line = one_line_error(r, f"MOETRACE_CACHE {blocker / 'index'}", "--index FILE")
    assert "or pass --no-cache" not in line


def test_markdown_shows_html_in_run_ids_as_text(small_model, small_index, tmp_path):
    run_id = '<img src=x onerror="alert(1)">&amp'
    out = tmp_path / "traces"
    out.mkdir()
    write_scenario(small_model, str(out), run_id, [0], {(0, 1, small_model.layer_ids[0]): {
        (0, "w2_weight_scale_inv"): ("expert", 2)}})
    md = tmp_path / "a.md"
    r = cli("analyze", out / run_id, "--index", small_index, "--markdown", md)
    assert r.exit_code == 0, r.output
    text = md.read_text()
    assert "<img" not in text and "&amp;lt;" not in text.replace("&amp;amp", "")
    assert "&lt;img src=x onerror=\"alert(1)\"&gt;&amp;amp" in text
    assert text.count("&lt;img") >= 3  # the run line, the summary table, the coverage table


def test_analyzes_unusable_picture_is_titled_analyze(tmp_path, small_index, monkeypatch):
    import matplotlib

    monkeypatch.setitem(matplotlib.rcParams, "svg.fonttype", "none")  # text as text, to read it back
    (tmp_path / "empty").mkdir()
    svg, md = tmp_path / "a.svg", tmp_path / "a.md"
    for command in ("analyze", "audit"):
        r = cli(command, tmp_path / "empty", "--index", small_index, "--plot", svg, "--markdown", md)
        assert r.exit_code == 2, r.output
        assert f"moetrace {command}: UNUSABLE (exit 2), no verdict" in svg.read_text()
        assert md.read_text().startswith(f"# moetrace {command}: UNUSABLE (exit 2)")


def test_grid_shows_unknown_bytes_over_stale_ones(small_model, small_index, tmp_path):
    """One cell (rank 1, layer L, expert 0) holds a stale w2 scale (E+2) and a w13 whose
    bytes are no shard of the checkpoint: the cell shows unknown, the least explained."""
    L = small_model.layer_ids[0]
    write_scenario(small_model, str(tmp_path), "mix", [0], {(0, 1, L): {
        (0, "w2_weight_scale_inv"): ("expert", 2), (0, "w13_weight"): ("random",),
        (1, "w2_weight_scale_inv"): ("expert", 3)}})
    rep = analyze([str(tmp_path / "mix")], index=small_index)
    assert {v for v, n in rep.doc["totals"]["by_verdict"].items() if n} == {"match", "stale", "unknown"}
    g = rep.grid
    rank, li = g.ranks.index("1"), list(g.layers).index(L)
    assert g.verdict[0, rank, li, 0] == UNKNOWN and g.verdict[0, rank, li, 1] == STALE and g.k[0, rank, li, 1] == 2
