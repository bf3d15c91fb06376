"""checkpoints.shards: expected per-rank FusedMoE tensors equal an independent
reference built only from synthetic_values at the global coordinates SGLang's
loader places on each rank (docs/checkpoints.md), for every family and format."""

from __future__ import annotations

import math

import pytest
import torch

from moetrace.checkpoints.layout import ServerLayout
from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.shards import (
    Parallel,
    expected_expert,
    expected_layer,
    local_experts,
    rank_coords,
    tensor_names,
)
from moetrace.checkpoints.synthetic import synthetic_values as sv
from moetrace.errors import MoetraceError

H, E, LAYERS, DENSE = 256, 4, 2, 1  # layer 0 dense, layer 1 MoE
SDT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (family, fmt, scale_dtype, extra writer kwargs)
CASES = [
    (fam, fmt, sdt, {})
    for fam in ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3")
    for fmt, sdt in (("fp8_block", "float32"), ("fp8_block", "bfloat16"), ("fp8_block", "float16"),
                     ("fp8_channel", "float32"), ("bf16", "bfloat16"))
] + [
    ("qwen3_5_moe", "bf16", "bfloat16", {"fused": True}),
    ("qwen3_5_moe", "fp8_block", "bfloat16", {"intermediate": 512, "num_files": 3}),  # tp4 in whole blocks
    ("deepseek_v3", "fp8_block", "float32", {"intermediate": 512, "num_files": 1}),
    ("qwen3_moe", "fp8_block", "float32", {"hidden": 320}),  # ceil(H/128) = 3 scale columns
    ("qwen3_next", "fp8_channel", "bfloat16", {"num_files": 1}),
]  # fmt: skip
# Formats beyond the first table, on fewer layouts (SGLang's own loader checks them on all:
# test_loader_oracle.py)
MORE_CASES = [
    ("qwen3_moe", "fp8_block", "bfloat16", {"intermediate": 512, "block": (128, 64)}),  # w2 scale columns by block_k
    ("deepseek_v3", "fp8_block", "float32", {"quant_method": "compressed-tensors"}),  # scales named weight_scale
    ("qwen3_next", "fp8_tensor", "bfloat16", {"quant_method": "compressed-tensors", "num_files": 1}),
]  # fmt: skip


def test_padded_rank_holds_its_rows_then_zeros(make_ckpt):
    """flashinfer-trtllm pads I per rank to P: rank r holds rows [r*P, (r+1)*P) of I, zeros past I."""
    kw = _kwargs("qwen3_moe", "fp8_block", "float32", {})
    ckpt = open_checkpoint(make_ckpt(**kw))
    p = Parallel(4, 1, ServerLayout(True, 128))
    for tp_rank in (1, 2):  # rank 1: rows 128..255; rank 2: past I = 256, all zeros
        experts, want = reference(kw, 1, 4, 1, True, tp_rank, 128)
        got = expected_layer(ckpt, 1, tp_rank, p)
        for name in want:
            assert_same(got[name], want[name], f"rank {tp_rank} {name}")
    assert not got["w13_weight"].view(torch.uint8).any() and got["w13_weight"].shape == (4, 256, 256)
# (tp, ep, up_first, I per rank padded to); padding at every TP is checked against SGLang's
# own loader in test_loader_oracle.py
PARS = [(1, 1, False, None), (2, 1, False, None), (2, 1, True, None), (2, 2, False, None), (4, 1, False, None),
        (4, 2, True, None)]


def _kwargs(fam, fmt, sdt, extra):
    kw = dict(family=fam, fmt=fmt, scale_dtype=sdt, num_layers=LAYERS, dense_layers=DENSE, num_experts=E,
              hidden=H, intermediate=256, num_files=2)  # fmt: skip
    kw.update(extra)
    return kw


def reference(kw: dict, layer: int, tp: int, ep: int, up_first: bool, tp_rank: int, padded=None) -> tuple[range, dict]:
    """What rank tp_rank must hold, from the loader facts alone:
    moe_tp = tp/ep, ep_rank = tp_rank // moe_tp, r = tp_rank % moe_tp,
    experts [ep_rank*E/ep, ...); w13 = gate rows r*I_tp.. then up rows (swapped
    if up_first); w2 = down columns r*I_tp..; block scales fp32 in whole blocks (w13
    rows by block_n, w2 columns by block_k), named weight_scale_inv for the fp8 method;
    per-channel scales [rows, 1] fp32 with w2's full; per-tensor [gate, up] and down.
    padded P: rank r reads rows [r*P, (r+1)*P) clipped to I, zeros after."""
    fmt, hid, inter, nexp = kw["fmt"], kw["hidden"], kw["intermediate"], kw["num_experts"]
    moe_tp = tp // ep
    ep_rank, r = tp_rank // moe_tp, tp_rank % moe_tp
    i_tp = padded or inter // moe_tp
    experts = range(ep_rank * nexp // ep, (ep_rank + 1) * nexp // ep)
    wdt = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
    sdt = SDT[kw["scale_dtype"]]
    order = (1, 0) if up_first else (0, 1)
    mid = torch.arange(min(r * i_tp, inter), min((r + 1) * i_tp, inter))
    pad = i_tp - len(mid)
    col = torch.zeros(1, 1, dtype=torch.int64)
    bn, bk = kw.get("block", (128, 128))
    suffix = "weight_scale_inv" if fmt == "fp8_block" and kw.get("quant_method", "fp8") == "fp8" else "weight_scale"

    def rows(t):  # zero rows past the checkpoint's I (padding)
        return torch.cat([t, torch.zeros(pad, *t.shape[1:], dtype=t.dtype)]) if pad else t

    out = {}
    for e in experts:
        t = {
            "w13_weight": torch.cat([rows(sv(layer, e, p, mid[:, None], torch.arange(hid)[None, :], "weight", wdt))
                                     for p in order]),
            "w2_weight": rows(sv(layer, e, 2, torch.arange(hid)[:, None], mid[None, :], "weight", wdt).T).T,
        }
        if fmt == "fp8_block":  # blocks past the checkpoint's (padding) are zero, like their rows
            rb = torch.arange(r * i_tp // bn, (r + 1) * i_tp // bn)
            cb = torch.arange(r * i_tp // bk, (r + 1) * i_tp // bk)
            w13s = torch.cat([sv(layer, e, p, rb[:, None], torch.arange(math.ceil(hid / bk))[None, :], "scale", sdt)
                              * (rb < math.ceil(inter / bn))[:, None] for p in order])
            w2s = sv(layer, e, 2, torch.arange(math.ceil(hid / bn))[:, None], cb[None, :], "scale", sdt)
            t[f"w13_{suffix}"], t[f"w2_{suffix}"] = w13s.float(), (w2s * (cb < math.ceil(inter / bk))[None, :]).float()
        elif fmt == "fp8_channel":
            t["w13_weight_scale"] = torch.cat([rows(sv(layer, e, p, mid[:, None], col, "scale", sdt)) for p in order]).float()
            t["w2_weight_scale"] = sv(layer, e, 2, torch.arange(hid)[:, None], col, "scale", sdt).float()
        elif fmt == "fp8_tensor":
            zero = torch.zeros((), dtype=torch.int64)
            t["w13_weight_scale"] = torch.stack([sv(layer, e, p, zero, zero, "scale", sdt) for p in order]).float()
            t["w2_weight_scale"] = sv(layer, e, 2, zero, zero, "scale", sdt).float()
        for k, v in t.items():
            out.setdefault(k, []).append(v)
    return experts, {k: torch.stack(v) for k, v in out.items()}


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
    assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)), f"{what}: bytes differ"


def _refused(kw: dict, tp: int, ep: int, padded=None) -> bool:
    moe_tp = tp // ep
    i_tp = padded or kw["intermediate"] // moe_tp
    bn, bk = kw.get("block", (128, 128))
    return kw["intermediate"] % moe_tp != 0 or (kw["fmt"] == "fp8_block" and (i_tp % bn or (moe_tp > 1 and i_tp % bk)))


def _pid(p):
    return f"tp{p[0]}ep{p[1]}{'up' if p[2] else ''}{f'pad{p[3]}' if p[3] else ''}"


def _cid(c):
    return "-".join([c[0], c[1], c[2]] + [f"{k}{v}" for k, v in c[3].items()])


@pytest.mark.parametrize("par", PARS[2:3] + PARS[5:], ids=_pid)
@pytest.mark.parametrize("case", MORE_CASES, ids=_cid)
def test_more_formats_match_reference(make_ckpt, case, par):
    test_expected_layer_matches_reference(make_ckpt, case, par)


@pytest.mark.parametrize("par", PARS, ids=_pid)
@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_expected_layer_matches_reference(make_ckpt, case, par):
    kw = _kwargs(*case)
    tp, ep, up_first, padded = par
    ckpt = open_checkpoint(make_ckpt(**kw))
    p = Parallel(tp, ep, ServerLayout(up_first, padded))
    if _refused(kw, tp, ep, padded):
        with pytest.raises(MoetraceError, match=f"tp_size={tp}"):
            expected_layer(ckpt, 1, 0, p)
        return
    assert ckpt.spec.moe_layers == (1,)
    for tp_rank in range(tp):
        experts, want = reference(kw, 1, tp, ep, up_first, tp_rank, padded)
        got = expected_layer(ckpt, 1, tp_rank, p)
        assert tuple(got) == tensor_names(ckpt.spec) and set(got) == set(want)
        assert local_experts(ckpt.spec, p, rank_coords(tp_rank, p)[1]) == experts
        for name in want:
            assert_same(got[name], want[name], f"rank {tp_rank} {name}")
        # expected_expert agrees slot by slot (checked on the last local expert).
        one = expected_expert(ckpt, 1, experts[-1], tp_rank, p)
        for name in want:
            assert_same(one[name], want[name][-1], f"rank {tp_rank} expert {experts[-1]} {name}")


def test_rank_coords_and_local_experts(make_ckpt):
    spec = open_checkpoint(make_ckpt(**_kwargs("qwen3_moe", "bf16", "bfloat16", {}))).spec
    p = Parallel(4, 2)
    assert p.moe_tp_size == 2
    assert [rank_coords(r, p) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert local_experts(spec, p, 1) == range(2, 4)
    with pytest.raises(MoetraceError, match="tp_rank 4"):
        rank_coords(4, p)


def test_wrong_expert_is_visible(make_ckpt):
    """E+1 / E+2 shards differ from E's in every tensor (what the analysis relies on)."""
    ckpt = open_checkpoint(make_ckpt(**_kwargs("qwen3_5_moe", "fp8_block", "bfloat16", {})))
    p = Parallel(2)
    base = expected_expert(ckpt, 1, 0, 1, p)
    for other in (1, 2):
        t = expected_expert(ckpt, 1, other, 1, p)
        for name in base:
            assert not torch.equal(base[name].view(torch.uint8), t[name].view(torch.uint8)), name


def test_expert_not_on_rank_and_dense_layer_refused(make_ckpt):
    ckpt = open_checkpoint(make_ckpt(**_kwargs("deepseek_v3", "fp8_block", "float32", {})))
    with pytest.raises(MoetraceError, match=r"expert 0 is not on tp_rank 1"):
        expected_expert(ckpt, 1, 0, 1, Parallel(2, 2))
    with pytest.raises(MoetraceError, match=r"layer 0 is not a MoE layer"):
        expected_layer(ckpt, 0, 0, Parallel(1))


@pytest.mark.parametrize(
    "fam,fmt,inter,nexp,tp,ep,match",
    [
        ("qwen3_5_moe", "fp8_block", 256, 4, 4, 1, r"= 64 .*block_n = 128 \(tp_size=4, ep_size=1\)"),
        ("qwen3_moe", "fp8_block", 384, 4, 2, 1, r"= 192 .*block_n = 128 \(tp_size=2, ep_size=1\)"),
        ("qwen3_moe", "bf16", 256, 4, 3, 1, r"moe_intermediate_size 256 is not divisible by moe_tp_size 3"),
        ("deepseek_v3", "bf16", 256, 6, 4, 4, r"num_experts 6 is not divisible by ep_size 4"),
        ("deepseek_v3", "bf16", 256, 4, 2, 4, r"tp_size 2 is not divisible by ep_size 4"),
    ],
)
def test_refused_parallel_configs(make_ckpt, fam, fmt, inter, nexp, tp, ep, match):
    kw = _kwargs(fam, fmt, "bfloat16", {"intermediate": inter, "num_experts": nexp})
    ckpt = open_checkpoint(make_ckpt(**kw))
    with pytest.raises(MoetraceError, match=match):
        expected_layer(ckpt, 1, 0, Parallel(tp, ep))
