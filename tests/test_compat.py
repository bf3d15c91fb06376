"""docs/compat.md, row by row: a FusedMoE set up the way that configuration leaves it
(SGLang 0.5.23's own loader and create_weights, and its process_weights_after_loading
where moetrace reproduces the transform), captured through SGLang's own
register_forward_hooks, audited with --checkpoint (the index is built for the layout
the trace recorded, no layout flag given). Byte-equal and reproduced rows must match
everywhere but one deliberately corrupted expert, which must be caught; refused rows
must exit 2 naming the transform; KT INT4/MXFP4/MXFP8 staged contexts are not captured.
"""

from __future__ import annotations

import re
import shutil
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from support import sglang_loader as sl
from support.sglang_source import installed_root, load_hook_manager

from moetrace.analysis.report import analyze
from moetrace.checkpoints.reader import open_checkpoint
from moetrace.errors import MoetraceError
from moetrace.hooks import sglang_hook
from moetrace.hooks.spec import hook_spec
from moetrace.tracer.manifest import read_manifests

DOC = Path(__file__).resolve().parents[1] / "docs" / "compat.md"
CKPT = dict(num_layers=2, num_experts=4, hidden=128, intermediate=256, num_files=1, scale_dtype="bfloat16")
CORRUPT = (1, 2, "w13_weight")  # layer 1: expert 2's w13 gets expert 1's bytes (E-1)


def _set(attr: str, value) -> Callable:
    def mutate(o, m):
        setattr(m, attr, value)
    return mutate


def _param_attr(attr: str, names=None) -> Callable:
    def mutate(o, m):
        for n, p in m.named_parameters():
            if names is None or n in names:
                setattr(p, attr, True)
    return mutate


def _fnuz(o, m):
    for n, p in list(m.named_parameters()):
        if p.dtype == torch.float8_e4m3fn:  # normalize_e4m3fn_to_e4m3fnuz re-registers the weights
            setattr(m, n, torch.nn.Parameter(p.data.view(torch.uint8).view(torch.float8_e4m3fnuz), requires_grad=False))


def _marlin(o, m):
    m.quant_method = type("Fp8MarlinMoEMethod", (), {"load_up_proj_weight_first": False})()
    m.w13_weight = torch.nn.Parameter(m.w13_weight.data.view(torch.int32), requires_grad=False)


def _trtllm_bf16_blocked(o, m):
    for n in ("w13_weight", "w2_weight"):  # convert_to_block_layout: [E, K/128, M, 128]
        p = getattr(m, n).data
        p.data = p.reshape(p.shape[0], p.shape[1], p.shape[2] // 128, 128).permute(0, 2, 1, 3).contiguous()


@dataclass(frozen=True)
class Row:
    id: str
    result: str  # "byte-equal" | "reproduced" | "refused" | "not captured"
    fmt: str
    quant_method: str | None = "fp8"
    runner: str = "triton"
    switch: bool = False  # load_up_proj_weight_first on the layout method
    env: frozenset = frozenset()
    mutate: Callable | None = None  # what the configuration does after loading (refused rows)
    post_load: bool = True  # run the quant method's own process_weights_after_loading steps
    refusal: str = ""  # the transform the refusal must name
    staged: str | None = None  # KT staged context format (captured through SharedFullContext.load)
    fused: bool = False
    extra: dict = field(default_factory=dict)


ROWS = [
    Row("triton-fp8-block", "byte-equal", "fp8_block"),
    Row("triton-ct-block", "byte-equal", "fp8_block", "compressed-tensors"),
    Row("triton-ct-channel", "byte-equal", "fp8_channel", "compressed-tensors"),
    Row("triton-bf16", "byte-equal", "bf16", None, fused=True),
    Row("deepgemm-fp8-block-sm90", "byte-equal", "fp8_block", runner="deep_gemm"),
    Row("trtllm-fp8-block", "byte-equal", "fp8_block", runner="flashinfer_trtllm"),
    Row("trtllm-ct-block", "byte-equal", "fp8_block", "compressed-tensors", runner="flashinfer_trtllm"),
    Row("trtllm-ct-channel", "byte-equal", "fp8_channel", "compressed-tensors", runner="flashinfer_trtllm"),
    Row("cutlass-bf16", "byte-equal", "bf16", None, runner="flashinfer_cutlass", switch=True),
    Row("triton-fp8-tensor", "reproduced", "fp8_tensor"),
    Row("triton-ct-tensor", "reproduced", "fp8_tensor", "compressed-tensors"),
    Row("triton-bf16-swiglu", "reproduced", "bf16", None, env=frozenset({"SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED"})),
    Row("trtllm-bf16", "refused", "bf16", None, runner="flashinfer_trtllm", mutate=_trtllm_bf16_blocked,
        refusal="flashinfer-trtllm BF16 block layout"),
    Row("trtllm-fp8-tensor", "refused", "fp8_tensor", runner="flashinfer_trtllm", post_load=False,  # flashinfer's shuffle
        refusal="flashinfer-trtllm FP8 per-tensor weight shuffle"),
    Row("deepgemm-fp8-block-sm100", "refused", "fp8_block", runner="deep_gemm",
        mutate=_param_attr("format_ue8m0", ("w13_weight_scale_inv", "w2_weight_scale_inv")), refusal="DeepGEMM UE8M0"),
    Row("marlin-fp8", "refused", "fp8_block", runner="marlin", mutate=_marlin, refusal="Marlin-repacked"),
    Row("rocm-fnuz", "refused", "fp8_block", mutate=_fnuz, refusal="ROCm e4m3fnuz"),
    Row("rocm-aiter-shuffle", "refused", "bf16", None, runner="aiter", mutate=_param_attr("is_shuffled"),
        refusal="aiter-shuffled"),
    Row("cpu-amx", "refused", "bf16", None, mutate=_set("use_intel_amx_backend", True), refusal="CPU AMX-packed"),
    Row("unknown-runner", "refused", "fp8_block", runner="cutlass", refusal="the cutlass MoE runner"),
    Row("kt-staged-fp8-block", "byte-equal", "fp8_block", staged="fp8_block"),
    Row("kt-staged-trtllm", "refused", "fp8_block", runner="flashinfer_trtllm", staged="fp8_block",
        refusal="KT staged load under flashinfer-trtllm"),
    Row("kt-staged-int4", "not captured", "fp8_block", staged="int4"),
    Row("kt-staged-mxfp4", "not captured", "fp8_block", staged="mxfp4"),
    Row("kt-staged-mxfp8", "not captured", "fp8_block", staged="mxfp8"),
]
KT_FLAGS = {"fp8_block": "fp8_quant", "mxfp4": "mxfp4_quant", "mxfp8": "mxfp8_quant"}


def doc_rows() -> dict[str, str]:
    """id -> "moetrace" column of docs/compat.md's table."""
    out = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", cells[0]) and cells[0] != "id":
            out[cells[0]] = cells[4]
    return out


def test_doc_table_is_the_tested_table():
    staged_rows = {r.id: r.result for r in ROWS if r.result == "not captured"}
    assert doc_rows() == {r.id: r.result for r in ROWS if r.id not in staged_rows}
    text = DOC.read_text()
    for fmt in ("INT4", "MXFP4", "MXFP8"):
        assert fmt in text and "not captured" in text


@pytest.fixture(scope="module")
def oracle():
    root = installed_root("sglang")
    if root is None:
        pytest.skip("sglang 0.5.23 not installed (make venv installs it with --no-deps)")
    return sl.build(str(root))


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path_factory.getbasetemp() / "compat-index-cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # KB-sized layers: thread hand-offs would cost more than the work
    yield
    sglang_hook.close_all(timeout=10)
    torch.set_num_threads(threads)


def _layers(o, row: Row, ckpt) -> dict[int, torch.nn.Module]:
    spec, out = ckpt.spec, {}
    o.state.env = set(row.env)
    for layer in spec.moe_layers:
        m = sl.make_layer(o, layer_id=layer, num_experts=spec.num_experts, hidden=spec.hidden_size,
                          intermediate=spec.intermediate_size, tp_size=1, ep_size=1, tp_rank=0, fmt=row.fmt,
                          quant_method=row.quant_method, block=spec.block,
                          runner=row.runner if row.runner in sl.TRTLLM + ("triton", "deep_gemm") else "triton",
                          up_first_method=row.switch)
        m.runner_backend = types.SimpleNamespace(value=row.runner)
        sl.load(o, sl.checkpoint_tensors(ckpt, layer), {layer: m}, spec.num_experts)
        if row.post_load and not row.staged:  # staged contexts are captured when load() returns
            sl.post_load(o, m)
        if row.mutate:
            row.mutate(o, m)
        m.forward = lambda x: x  # the experts' math is not what is traced
        out[layer] = m
    o.state.env = set()
    return out


def _corrupt(layers: dict) -> None:
    layer, expert, name = CORRUPT
    t = getattr(layers[layer], name).data
    t[expert].copy_(t[expert - 1])


def _stage(row: Row, layers: dict, monkeypatch):
    """A stand-in KT wrapper module whose SharedFullContext.load stages `layers` with the
    fork's format flags set as its _detect_quant_type_from_created_weights would."""
    class SharedFullContext:
        def __init__(self):
            self.gpu_layer = None
            for flag in ("mxfp4_quant", "mxfp8_quant", "fp8_quant", "fp8_channel_quant", "bf16_quant"):
                setattr(self, f"_is_{flag}", KT_FLAGS.get(row.staged) == flag)

        def load(self, layer_idx, wrapper, original_layer=None, gpu_experts_mask=None, logical_to_gpu_index=None):
            self.gpu_layer = layers[layer_idx]

    mod = types.ModuleType("sglang.srt.layers.moe.kt_ep_wrapper")
    mod.SharedFullContext = SharedFullContext
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return SharedFullContext()


def _run(o, row: Row, ckpt, out: Path, monkeypatch, corrupt: bool = True, **config):
    layers = _layers(o, row, ckpt)
    if corrupt and row.result in ("byte-equal", "reproduced"):
        _corrupt(layers)
    model = sl.ExpertsModel(layers, ckpt.spec.num_experts)
    ctx = _stage(row, layers, monkeypatch) if row.staged else None
    run_id = config.pop("run_id", row.id)
    spec = hook_spec({"out": str(out), "run_id": run_id, "flush_interval_s": 0.05, "tp_rank": 0, "tp_size": 1,
                      **config})
    load_hook_manager().register_forward_hooks(model, spec)  # SGLang's code calls moetrace's factory
    try:
        for layer in ckpt.spec.moe_layers:
            if ctx is not None:
                ctx.load(layer_idx=layer, wrapper=None)
            else:
                model.model.layers[str(layer)].mlp.experts(torch.zeros(1))
    finally:
        for cap in list(sys.modules["moetrace.hooks.kt"]._ATTACHED.values()):
            cap.detach()
    assert sglang_hook.close_all()
    return str(out / run_id)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_compat_row(oracle, make_ckpt, tmp_path, monkeypatch, row):
    path = make_ckpt(family="qwen3_5_moe", fmt=row.fmt, quant_method=row.quant_method, fused=row.fused, **CKPT)
    ckpt = open_checkpoint(path)
    trace = _run(oracle, row, ckpt, tmp_path, monkeypatch)
    if row.result == "not captured":
        (m,) = read_manifests(str(tmp_path), row.id).values()
        assert m["rows_written"] == 0 and any(f"KT {row.staged} staged contexts are not captured" in n for n in m["notes"])
        return
    (m,) = read_manifests(str(tmp_path), row.id).values()
    source = "staged" if row.staged else "resident"
    assert set(m["layouts"]) == {f"{source}:target:{layer}" for layer in ckpt.spec.moe_layers}
    assert m["layouts"][f"{source}:target:0"]["module_path"] == "sglang.srt.layers.moe.fused_moe_triton.layer"
    if row.result == "refused":
        with pytest.raises(MoetraceError) as err:
            analyze([trace], checkpoint=str(path))
        assert err.value.exit_code == 2 and row.refusal in str(err.value) and "layer 0" in str(err.value)
        return
    rep = analyze([trace], checkpoint=str(path))
    doc = rep.doc
    ((first,),) = [f["entries"] for f in doc["first_divergence"]]
    layer, expert, name = CORRUPT
    assert rep.exit_code == 1 and (first["layer"], first["expert"], first["tensor"]) == (layer, expert, name)
    assert first["found"]["expert"] == expert - 1, first
    n = len(ckpt.spec.moe_layers) * ckpt.spec.num_experts * (2 if row.fmt == "bf16" else 4)
    assert doc["totals"]["match"] == n - 1 and doc["totals"]["tensors"] == n


def test_prebuilt_index_must_be_for_the_traced_layout(oracle, make_ckpt, tmp_path, monkeypatch):
    """--index built without flags for an up-first (trtllm) trace: exit 2 saying so; the
    index `moetrace index --layout-from TRACE` builds compares (and catches the corruption)."""
    from click.testing import CliRunner

    from moetrace.cli import main

    row = next(r for r in ROWS if r.id == "trtllm-fp8-block")
    path = make_ckpt(family="qwen3_5_moe", fmt=row.fmt, quant_method=row.quant_method, **CKPT)
    trace = _run(oracle, row, open_checkpoint(path), tmp_path, monkeypatch)
    runner = CliRunner()
    # The index of a checkpoint copy that is then removed: its checkpoint is not readable here.
    gone = shutil.copytree(path, tmp_path / "gone", copy_function=shutil.copyfile)  # new mtimes: its own index
    plain, traced = str(tmp_path / "plain.parquet"), str(tmp_path / "traced.parquet")
    assert runner.invoke(main, ["index", str(gone), "--tp", "1", "-o", plain]).exit_code == 0
    shutil.rmtree(gone)
    res = runner.invoke(main, ["analyze", trace, "--index", plain])
    assert res.exit_code == 2 and "built for gate rows first, but the trace records up rows first" in res.output
    assert "--layout-from TRACE" in res.output and f"its checkpoint {gone} is not readable here" in res.output
    # An index whose checkpoint is readable: audit builds the matching one itself and says so.
    readable = str(tmp_path / "readable.parquet")
    assert runner.invoke(main, ["index", str(path), "--tp", "1", "-o", readable]).exit_code == 0
    res = runner.invoke(main, ["audit", trace, "--index", readable])
    assert res.exit_code == 1, res.output
    assert (f"index {readable} was built for gate rows first, but the trace records up rows first"
            in " ".join(res.output.split())), res.output
    assert f"compared with the matching index built from its checkpoint {path}" in " ".join(res.output.split())
    assert runner.invoke(main, ["index", str(path), "--tp", "1", "--layout-from", trace, "-o", traced]).exit_code == 0
    assert analyze([trace], index=traced).exit_code == 1


def test_online_verification_with_a_plain_index_on_an_up_first_server(oracle, make_ckpt, tmp_path, monkeypatch):
    """hook-spec --index of a plain (gate-first) index on a flashinfer-trtllm server (w13 up
    rows first): online verification holds w13 to the up-first order derived from the index's
    chunk digests (each half is one 64 KiB chunk here), leaves the one-chunk w13 scale
    unchecked, never says `mismatch` of a clean server, and the audit of that trace passes;
    an injected fault is still a mismatch."""
    from click.testing import CliRunner

    from moetrace.cli import main

    row = next(r for r in ROWS if r.id == "trtllm-fp8-block")
    path = make_ckpt(family="qwen3_5_moe", fmt=row.fmt, quant_method=row.quant_method, **{**CKPT, "hidden": 256})
    ckpt = open_checkpoint(path)
    plain = str(tmp_path / "plain.parquet")
    assert CliRunner().invoke(main, ["index", str(path), "--tp", "1", "-o", plain]).exit_code == 0
    clean = _run(oracle, row, ckpt, tmp_path, monkeypatch, corrupt=False, index=plain, run_id="clean")
    (m,) = read_manifests(str(tmp_path), "clean").values()
    n = len(ckpt.spec.moe_layers) * ckpt.spec.num_experts
    assert m["online"] == {"match": 3 * n, "mismatch": 0, "unchecked": n}, m["online"]
    assert any("built for gate rows first" in note and "derived from the index's chunk digests" in note
               for note in m["notes"]), m["notes"]
    res = CliRunner().invoke(main, ["audit", clean, "--index", plain])
    assert res.exit_code == 0 and "disagree" not in res.output, res.output
    bad = _run(oracle, row, ckpt, tmp_path, monkeypatch, index=plain, run_id="corrupt")
    (m,) = read_manifests(str(tmp_path), "corrupt").values()
    assert m["online"] == {"match": 3 * n - 1, "mismatch": 1, "unchecked": n}, m["online"]
    assert CliRunner().invoke(main, ["audit", bad, "--index", plain]).exit_code == 1
