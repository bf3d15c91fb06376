"""checkpoints.shards: expected per-rank FusedMoE tensors equal an independent
reference built only from synthetic_values at the global coordinates SGLang's
loader places on each rank (docs/checkpoints.md), for every family and format."""

from __future__ import annotations

import math

import pytest
import torch

from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.shards import Parallel, expected_expert, expected_layer, local_experts, rank_coords, tensor_names
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
# (tp, ep, up_first)
PARS = [(1, 1, False), (2, 1, False), (2, 1, True), (2, 2, False), (4, 1, False), (4, 2, True)]


def _kwargs(fam, fmt, sdt, extra):
    kw = dict(family=fam, fmt=fmt, scale_dtype=sdt, num_layers=LAYERS, dense_layers=DENSE, num_experts=E,
              hidden=H, intermediate=256, num_files=2)  # fmt: skip
    kw.update(extra)
    return kw


def reference(kw: dict, layer: int, tp: int, ep: int, up_first: bool, tp_rank: int) -> tuple[range, dict]:
    """What rank tp_rank must hold, from the loader facts alone:
    moe_tp = tp/ep, ep_rank = tp_rank // moe_tp, r = tp_rank % moe_tp,
    experts [ep_rank*E/ep, ...); w13 = gate rows r*I_tp.. then up rows (swapped
    if up_first); w2 = down columns r*I_tp..; block scales in 128-blocks as fp32;
    per-channel scales [rows, 1] fp32 with w2's full."""
    fmt, hid, inter, nexp, seed = kw["fmt"], kw["hidden"], kw["intermediate"], kw["num_experts"], 0
    moe_tp = tp // ep
    ep_rank, r = tp_rank // moe_tp, tp_rank % moe_tp
    i_tp = inter // moe_tp
    experts = range(ep_rank * nexp // ep, (ep_rank + 1) * nexp // ep)
    wdt = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
    sdt = SDT[kw["scale_dtype"]]
    order = (1, 0) if up_first else (0, 1)
    mid = torch.arange(r * i_tp, (r + 1) * i_tp)
    col = torch.zeros(1, 1, dtype=torch.int64)
    out = {}
    for e in experts:
        t = {
            "w13_weight": torch.cat([sv(layer, e, p, mid[:, None], torch.arange(hid)[None, :], "weight", wdt) for p in order]),
            "w2_weight": sv(layer, e, 2, torch.arange(hid)[:, None], mid[None, :], "weight", wdt),
        }
        if fmt == "fp8_block":
            bmid = torch.arange(r * i_tp // 128, (r + 1) * i_tp // 128)
            nb = math.ceil(hid / 128)
            t["w13_weight_scale_inv"] = torch.cat(
                [sv(layer, e, p, bmid[:, None], torch.arange(nb)[None, :], "scale", sdt) for p in order]
            ).float()
            t["w2_weight_scale_inv"] = sv(layer, e, 2, torch.arange(nb)[:, None], bmid[None, :], "scale", sdt).float()
        elif fmt == "fp8_channel":
            t["w13_weight_scale"] = torch.cat([sv(layer, e, p, mid[:, None], col, "scale", sdt) for p in order]).float()
            t["w2_weight_scale"] = sv(layer, e, 2, torch.arange(hid)[:, None], col, "scale", sdt).float()
        for k, v in t.items():
            out.setdefault(k, []).append(v)
    return experts, {k: torch.stack(v) for k, v in out.items()}


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), f"{what}: bytes differ"


def _refused(kw: dict, tp: int, ep: int) -> bool:
    moe_tp = tp // ep
    return kw["intermediate"] % moe_tp != 0 or (kw["fmt"] == "fp8_block" and (kw["intermediate"] // moe_tp) % 128 != 0)


@pytest.mark.parametrize("par", PARS, ids=lambda p: f"tp{p[0]}ep{p[1]}{'up' if p[2] else ''}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join([c[0], c[1], c[2]] + [f"{k}{v}" for k, v in c[3].items()]))
def test_expected_layer_matches_reference(make_ckpt, case, par):
    kw = _kwargs(*case)
    tp, ep, up_first = par
    ckpt = open_checkpoint(make_ckpt(**kw))
    p = Parallel(tp, ep, up_first)
    if _refused(kw, tp, ep):
        with pytest.raises(MoetraceError, match=f"tp_size={tp}"):
            expected_layer(ckpt, 1, 0, p)
        return
    assert ckpt.spec.moe_layers == (1,)
    for tp_rank in range(tp):
        experts, want = reference(kw, 1, tp, ep, up_first, tp_rank)
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
