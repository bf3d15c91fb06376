"""SGLang's own loader is the shard oracle: checkpoints.shards must equal, byte for byte,
what upstream sglang 0.5.23's FusedMoE (and the sglang-kt fork's) loads on every rank.

The installed FusedMoE.weight_loader / _load_w13 / _load_w2 / scale paths and the quant
methods' create_weights run on CPU (support.sglang_loader), fed by Qwen3.5's own
load_weights (model.language_model rename, fused gate_up_proj split). The layout the
expected side reproduces comes from moetrace's own facts and rules (hooks.layout_facts ->
checkpoints.layout_rules.loaded_layout), so a wrong rule is caught too. Every
difference is a moetrace bug.
"""

from __future__ import annotations

import pytest
import torch
from support import sglang_loader as sl
from support.sglang_source import fork_root, installed_root

from moetrace.checkpoints.layout_rules import loaded_layout
from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.shards import Parallel, expected_layer
from moetrace.errors import MoetraceError
from moetrace.hooks.layout_facts import layout_facts

FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3")
# (format, quant_method, fused)
FORMATS = [("fp8_block", "fp8", False), ("fp8_block", "compressed-tensors", False),
           ("fp8_channel", "compressed-tensors", False), ("fp8_tensor", "fp8", False),
           ("fp8_tensor", "compressed-tensors", False), ("bf16", None, False), ("bf16", None, True)]
SIZES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]
# How w13's order is decided: (runner, load_up_proj_weight_first on the layout method)
ORDERS = [("triton", False), ("flashinfer_trtllm", False), ("triton", True)]
# block_n != block_k catches w2 scale columns cut by the wrong one; I/4 = 64 < 128 makes
# flashinfer-trtllm pad (ranks 2-3 of TP4 then hold zeros only).
CKPT = dict(num_layers=1, num_experts=2, hidden=64, intermediate=256, num_files=1, scale_dtype="bfloat16",
            block=(32, 16))


@pytest.fixture(scope="session")
def oracles():
    up = installed_root("sglang")
    if up is None:
        pytest.skip("sglang 0.5.23 not installed (make venv installs it with --no-deps)")
    fork = fork_root()
    return {"sglang": sl.build(str(up)), "sglang-kt": sl.build(str(fork)) if fork else None}


@pytest.fixture(scope="session")
def checkpoints(make_ckpt):
    out = {}
    for family in FAMILIES:
        for fmt, qm, fused in FORMATS:
            if fused and family != "qwen3_5_moe":
                continue  # the fused 3-D layout is Qwen3.5's
            ckpt = open_checkpoint(make_ckpt(family=family, fmt=fmt, quant_method=qm, fused=fused, **CKPT))
            out[(family, fmt, qm, fused)] = (ckpt, sl.checkpoint_tensors(ckpt, ckpt.spec.moe_layers[0]))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def differences(o, ckpt, weights, fmt, qm, tp, ep, runner, switch) -> list[str]:
    spec, layer = ckpt.spec, ckpt.spec.moe_layers[0]
    bad = []
    for rank in range(tp):
        try:
            m = sl.make_layer(o, layer_id=layer, num_experts=spec.num_experts, hidden=spec.hidden_size,
                              intermediate=spec.intermediate_size, tp_size=tp, ep_size=ep, tp_rank=rank, fmt=fmt,
                              quant_method=qm, block=spec.block, runner=runner, up_first_method=switch)
        except ValueError as err:  # SGLang refuses the configuration: so must moetrace
            with pytest.raises(MoetraceError):
                expected_layer(ckpt, layer, rank, Parallel(tp, ep))
            return [] if "divisible" in str(err) else [f"rank {rank}: SGLang refused: {err}"]
        for p in m.parameters():  # anything the loader fails to write shows
            _bytes(p.data).fill_(0xA5)
        sl.load(o, weights, {layer: m}, spec.num_experts)
        layout = loaded_layout(layout_facts(m), spec.intermediate_size // (tp // ep))
        want = expected_layer(ckpt, layer, rank, Parallel(tp, ep, layout))
        held = {n: p.data for n, p in m.named_parameters()}
        if set(held) != set(want):
            bad.append(f"rank {rank}: params {sorted(held)} != {sorted(want)}")
        for name, w in want.items():
            g = held.get(name)
            if g is not None and (g.dtype != w.dtype or g.shape != w.shape or not torch.equal(_bytes(g), _bytes(w))):
                bad.append(f"rank {rank} {name}: SGLang {g.dtype}{list(g.shape)}, moetrace {w.dtype}{list(w.shape)}")
    return bad


@pytest.mark.parametrize("dist", ["sglang", "sglang-kt"])
def test_shards_equal_sglang_loader(oracles, checkpoints, dist):
    o = oracles[dist]
    if o is None:
        pytest.skip("sglang-kt 0.7.2 not installed in a side directory of the venv (make venv installs it; "
                    "or set MOETRACE_FORK_PATH)")
    bad: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~1000 loads of KB-sized tensors: thread hand-offs would dominate
    try:
        ran = _all_configs(o, checkpoints, bad)
    finally:
        torch.set_num_threads(threads)
    assert len(checkpoints) == 4 * 6 + 1 and ran > 0.85 * len(checkpoints) * len(SIZES) * len(ORDERS)
    assert not bad, "\n".join(bad[:20])


def _all_configs(o, checkpoints, bad: list[str]) -> int:
    ran = 0
    for (family, fmt, qm, fused), (ckpt, weights) in checkpoints.items():
        for (tp, ep) in SIZES:
            for runner, switch in ORDERS:
                if switch and fmt == "fp8_tensor":
                    # the loader keeps per-tensor scales [gate, up] while the weights go up first
                    # (layout_rules refuses it); no quant method sets this up
                    continue
                ran += 1
                for d in differences(o, ckpt, weights, fmt, qm, tp, ep, runner, switch):
                    bad.append(f"{family} {fmt}/{qm}{' fused' if fused else ''} TP{tp} EP{ep} {runner}"
                               f"{' up-first method' if switch else ''}: {d}")
    return ran


def test_known_bug_w2_scale_columns_cut_by_block_k(oracles, checkpoints):
    """The negative control of the oracle: slicing w2 scale columns with block_n (the old
    shards.py) differs from SGLang wherever block_n != block_k."""
    ckpt, weights = checkpoints[("qwen3_moe", "fp8_block", "fp8", False)]
    o, layer = oracles["sglang"], ckpt.spec.moe_layers[0]
    m = sl.make_layer(o, layer_id=layer, num_experts=2, hidden=64, intermediate=256, tp_size=2, ep_size=1, tp_rank=1,
                      fmt="fp8_block", quant_method="fp8", block=ckpt.spec.block)
    sl.load(o, weights, {layer: m}, 2)
    (bn, bk), i_tp = ckpt.spec.block, 128
    full = dict(weights)[f"model.layers.{layer}.mlp.experts.0.down_proj.weight_scale_inv"].float()
    by_k, by_n = full[:, i_tp // bk: 2 * i_tp // bk], full[:, i_tp // bn: 2 * i_tp // bn]
    assert torch.equal(m.w2_weight_scale_inv.data[0], by_k) and by_n.shape != by_k.shape


# INT4 (compressed-tensors W4A16 pack-quantized): SGLang's CompressedTensorsWNA16MoE
# create_weights (is_transposed params) and the loader's transposing path. H/8 = 16
# words, I/8 = 32; group 32: H holds 4 groups, I 8; group 128 refuses TP4 (64 columns of
# down per rank split a group: SGLang then holds zero w2 scale groups).
INT4 = dict(num_layers=1, num_experts=2, hidden=128, intermediate=256, num_files=1, scale_dtype="bfloat16")


@pytest.fixture(scope="module")
def int4_checkpoints(make_ckpt):
    out = {}
    for family in FAMILIES:
        for gs in (32, 128):
            ckpt = open_checkpoint(make_ckpt(family=family, fmt="int4", group_size=gs, **INT4))
            out[(family, gs)] = (ckpt, sl.checkpoint_tensors(ckpt, ckpt.spec.moe_layers[0]))
    return out


def _int4_layer(o, ckpt, weights, tp, rank):
    spec, layer = ckpt.spec, ckpt.spec.moe_layers[0]
    m = sl.make_layer(o, layer_id=layer, num_experts=spec.num_experts, hidden=spec.hidden_size,
                      intermediate=spec.intermediate_size, tp_size=tp, ep_size=1, tp_rank=rank, fmt="int4",
                      quant_method="compressed-tensors", group_size=spec.group_size)
    for p in m.parameters():
        _bytes(p.data).fill_(0xA5)
    sl.load(o, weights, {layer: m}, spec.num_experts, family=spec.family)
    return m


@pytest.mark.parametrize("dist", ["sglang", "sglang-kt"])
def test_int4_shards_equal_sglang_wna16_loader(oracles, int4_checkpoints, dist):
    o = oracles[dist]
    if o is None:
        pytest.skip("sglang-kt 0.7.2 not installed in a side directory of the venv")
    bad, compared = [], 0
    for (family, gs), (ckpt, weights) in int4_checkpoints.items():
        for tp in (1, 2, 4):
            for rank in range(tp):
                m = _int4_layer(o, ckpt, weights, tp, rank)
                try:
                    want = expected_layer(ckpt, ckpt.spec.moe_layers[0], rank, Parallel(tp))
                except MoetraceError:  # moetrace refuses: SGLang holds no whole w2 scale group there
                    assert m.w2_weight_scale.shape[1] == 0, (family, gs, tp)
                    break
                for name, w in want.items():
                    g = getattr(m, name).data
                    compared += 1
                    if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(_bytes(g), _bytes(w)):
                        bad.append(f"{family} g{gs} TP{tp} rank {rank} {name}: SGLang {g.dtype}{list(g.shape)}, "
                                   f"moetrace {w.dtype}{list(w.shape)}")
    assert compared == 4 * (7 + 3) * 4 and not bad, "\n".join(bad[:20])


def test_int4_known_bugs_differ_from_sglang(oracles, int4_checkpoints):
    """The negative controls, each the same shape as what SGLang holds: the rank's words
    reshaped instead of transposed, the words of the other rank, w13's halves up first."""
    ckpt, weights = int4_checkpoints[("qwen3_moe", 32)]
    m = _int4_layer(oracles["sglang"], ckpt, weights, 2, 1)
    w = dict(weights)
    down = w["model.layers.0.mlp.experts.0.down_proj.weight_packed"]  # [128, 32] words
    held = m.w2_weight_packed.data[0]
    assert torch.equal(held, down[:, 16:32].T)  # rank 1: words 16..31 (columns 128..255 of I = 256)
    assert not torch.equal(held, down[:, 16:32].contiguous().view(held.shape))
    assert not torch.equal(held, down[:, 0:16].T)
    gate, up = (w[f"model.layers.0.mlp.experts.0.{p}_proj.weight_packed"][128:256] for p in ("gate", "up"))
    assert torch.equal(m.w13_weight_packed.data[0], torch.cat([gate, up]).T)
    assert not torch.equal(m.w13_weight_packed.data[0], torch.cat([up, gate]).T)


@pytest.mark.parametrize("dist", ["sglang", "sglang-kt"])
def test_marlin_permute_scales_transform_equals_sglang(oracles, dist):
    """checkpoints.transforms.marlin_permute_scales (moetrace's own) against the installed
    marlin_utils.marlin_permute_scales, called as the fork's _prepare_weight_int4 calls it."""
    from moetrace.checkpoints.transforms import marlin_permute_scales

    o = oracles[dist]
    if o is None:
        pytest.skip("sglang-kt 0.7.2 not installed in a side directory of the venv")
    f = o.ns["marlin_permute_scales"]
    for gs, i_tp, hidden in ((32, 32, 128), (32, 128, 256), (128, 128, 256), (128, 256, 384), (32, 64, 96)):
        w13 = torch.randn(3, hidden // gs, 2 * i_tp).to(torch.bfloat16)
        w2 = torch.randn(3, i_tp // gs, hidden).to(torch.bfloat16)
        got = marlin_permute_scales({"w13_weight_scale": w13, "w2_weight_scale": w2})
        for name, s, size_k in (("w13_weight_scale", w13, 2 * i_tp), ("w2_weight_scale", w2, i_tp)):
            want = torch.stack([f(s[e], size_k, s.shape[2], gs).view(s[e].shape) for e in range(3)])
            assert torch.equal(got[name], want), (gs, i_tp, hidden, name)
