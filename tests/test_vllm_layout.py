"""hooks.vllm.kernel_layout without vLLM: the layouts of docs/compat.md's vLLM table, row by
row, on stand-in layers shaped as vLLM 0.32 leaves them (class names and attributes read
from its files), the CPU packs undone against their definition (the packs themselves are
held to vLLM's own prepack in tests/test_vllm_server.py), the zero padding checked, and
what the analysis makes of the recorded facts (checkpoints.layout_rules)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moetrace.checkpoints.layout import LayoutRefused, ServerLayout
from moetrace.checkpoints.layout_rules import derive_layout
from moetrace.hooks.vllm.kernel_layout import canonical, loaded_layout, resident_layout, unpack_cpu

DOC = Path(__file__).resolve().parents[1] / "docs" / "compat.md"
E, H, I_TP, P = 3, 64, 24, 32  # I_tp 24 is padded to 32 by vLLM's CPU experts


class UnquantizedFusedMoEMethod:  # names as vLLM's: the layout is read from them
    def __init__(self, backend: str, experts=None):
        self.unquantized_backend = SimpleNamespace(value=backend)
        self.moe_kernel = SimpleNamespace(fused_experts=experts)


class Fp8MoEMethod(UnquantizedFusedMoEMethod):
    pass


class CPUUnquantizedExperts:
    isa = "vec"

    def __init__(self, zentorch: bool = False):
        self._use_zentorch = zentorch


class X86CPUUnquantizedExperts(CPUUnquantizedExperts):
    isa = "amx"


class ArmCPUUnquantizedExperts(CPUUnquantizedExperts):
    isa = "neon"


class TritonExperts:
    pass


class RoutedExperts:
    def __init__(self, method, param_i: int = I_TP, **tensors):
        self.quant_method = method
        self.moe_config = SimpleNamespace(intermediate_size_per_partition_unpadded=I_TP, hidden_dim_unpadded=H)
        self.intermediate_size_per_partition, self.hidden_size, self.local_num_experts = param_i, H, E
        for k, v in tensors.items():
            setattr(self, k, v)


def checkpoint_layer(seed: int = 0) -> dict[str, torch.Tensor]:
    """A rank's shards as the checkpoint gives them: w13 [E, 2*I_tp, H] gate rows first, w2 [E, H, I_tp]."""
    g = torch.Generator().manual_seed(seed)
    return {"w13_weight": torch.randn(E, 2 * I_TP, H, generator=g).to(torch.bfloat16),
            "w2_weight": torch.randn(E, H, I_TP, generator=g).to(torch.bfloat16)}


def pad(layer: dict) -> dict:
    """experts/cpu_moe.py _pad_moe_intermediate: gate rows [0, I), zeros, up rows [P, P+I), zeros; w2 columns [0, I)."""
    w13 = torch.zeros(E, 2 * P, H, dtype=torch.bfloat16)
    w13[:, :I_TP], w13[:, P:P + I_TP] = layer["w13_weight"][:, :I_TP], layer["w13_weight"][:, I_TP:]
    w2 = torch.zeros(E, H, P, dtype=torch.bfloat16)
    w2[:, :, :I_TP] = layer["w2_weight"]
    return {"w13_weight": w13, "w2_weight": w2}


def pack(t: torch.Tensor, isa: str) -> torch.Tensor:
    """vLLM CPU's prepack per expert W[N, K], as its definition reads (not moetrace's inverse)."""
    out = []
    for w in t:
        n, k = w.shape
        p = w.reshape(n // 16, 16, k).permute(0, 2, 1) if isa == "vec" else \
            w.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
        out.append(p.contiguous().reshape(n, k))
    return torch.stack(out)


def cpu_resident(isa: str, layer: dict, cls=None) -> RoutedExperts:
    held = {k: pack(v, isa) for k, v in pad(layer).items()}
    cls = cls or (X86CPUUnquantizedExperts if isa == "amx" else CPUUnquantizedExperts)
    return RoutedExperts(UnquantizedFusedMoEMethod("CPU", cls()), **held)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_pack_and_padding_are_undone_to_the_checkpoints_shards(isa):
    layer = checkpoint_layer()
    routed = cpu_resident(isa, layer)
    tensors = {"w13_weight": routed.w13_weight, "w2_weight": routed.w2_weight}
    layout = resident_layout(routed, tensors)
    assert layout.facts["undone"] == [f"cpu_{isa}_pack", "zero_pad_32"] and not layout.refused
    assert layout.facts["held_intermediate_size"] == P and layout.facts["isa"] == isa
    held, problems = canonical(tensors, layout)
    assert problems == []
    for name in layer:
        assert torch.equal(bits(held[name]), bits(layer[name])), name
    # the negative control: what the kernel holds is not the shards (padded, then packed)
    assert routed.w13_weight.shape == (E, 2 * P, H) and routed.w2_weight.shape == (E, H, P)
    unpadded = pad(layer)["w13_weight"]
    assert not torch.equal(bits(routed.w13_weight), bits(unpadded))


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_unpack_inverts_the_pack_over_every_bit_pattern(isa):
    raw = torch.randint(0, 1 << 16, (2, 32, 64), dtype=torch.int32).to(torch.int16)  # NaNs, -0.0, subnormals
    w = raw.view(torch.bfloat16)
    packed = pack(w, isa)
    assert not torch.equal(bits(packed), raw)
    assert torch.equal(bits(unpack_cpu(packed, isa)), raw)


def test_nonzero_padding_is_named_never_passed():
    layer = checkpoint_layer()
    padded = pad(layer)
    padded["w2_weight"][1, 5, I_TP + 3] = 1.0  # slot 1 holds a byte in the pad
    w13, w2 = pack(padded["w13_weight"], "vec"), pack(padded["w2_weight"], "vec")
    routed = RoutedExperts(UnquantizedFusedMoEMethod("CPU", CPUUnquantizedExperts()), w13_weight=w13, w2_weight=w2)
    tensors = {"w13_weight": w13, "w2_weight": w2}
    held, problems = canonical(tensors, resident_layout(routed, tensors))
    assert problems == ["w2_weight: the kernel's zero padding (I_tp 24 padded to 32) holds nonzero bytes in slot(s) [1]"]
    assert torch.equal(bits(held["w2_weight"]), bits(layer["w2_weight"]))  # the real part is still judged


def test_negative_zero_in_the_pad_is_not_zero_bytes():
    padded = pad(checkpoint_layer())
    padded["w13_weight"][2, I_TP, 0] = -0.0
    w13, w2 = pack(padded["w13_weight"], "vec"), pack(padded["w2_weight"], "vec")
    routed = RoutedExperts(UnquantizedFusedMoEMethod("CPU", CPUUnquantizedExperts()), w13_weight=w13, w2_weight=w2)
    tensors = {"w13_weight": w13, "w2_weight": w2}
    _, problems = canonical(tensors, resident_layout(routed, tensors))
    assert problems and "slot(s) [2]" in problems[0]


# ---------------------------------------------------------------- docs/compat.md's vLLM table

def _cuda(backend: str, param_i: int = I_TP):
    layer = checkpoint_layer()
    return "resident", RoutedExperts(UnquantizedFusedMoEMethod(backend, TritonExperts()), param_i, **layer)


def _loaded(method, param_i: int = I_TP):
    return "loaded", RoutedExperts(method, param_i, **checkpoint_layer())


ROWS = {
    "vllm-loaded": lambda: _loaded(UnquantizedFusedMoEMethod("CPU", CPUUnquantizedExperts)),
    "vllm-loaded-padded": lambda: _loaded(UnquantizedFusedMoEMethod("FlashInfer TRTLLM"), param_i=128),
    "vllm-cpu-vec": lambda: ("resident", cpu_resident("vec", checkpoint_layer())),
    "vllm-cpu-amx": lambda: ("resident", cpu_resident("amx", checkpoint_layer())),
    "vllm-cpu-neon": lambda: ("resident", cpu_resident("vec", checkpoint_layer(), ArmCPUUnquantizedExperts)),
    "vllm-cpu-zentorch": lambda: ("resident", RoutedExperts(UnquantizedFusedMoEMethod("CPU", CPUUnquantizedExperts(True)),
                                                            **checkpoint_layer())),
    "vllm-triton": lambda: _cuda("TRITON"),
    "vllm-cutlass": lambda: _cuda("FlashInfer CUTLASS"),
    "vllm-trtllm": lambda: _cuda("FlashInfer TRTLLM", param_i=128),
    "vllm-aiter": lambda: _cuda("ROCm AITER"),
    "vllm-xpu": lambda: _cuda("XPU"),
    "vllm-quantized": lambda: ("resident", RoutedExperts(Fp8MoEMethod("TRITON", TritonExperts()), **checkpoint_layer())),
}


def doc_rows() -> dict[str, str]:
    """id -> "moetrace" column of docs/compat.md's vLLM table (7 columns, ids vllm-*)."""
    out = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and re.fullmatch(r"vllm(-[a-z0-9]+)+", cells[2]):
            out[cells[2]] = cells[5]
    return out


def outcome(source: str, routed) -> tuple[str, dict]:
    tensors = {"w13_weight": routed.w13_weight, "w2_weight": routed.w2_weight}
    layout = loaded_layout(routed) if source == "loaded" else resident_layout(routed, tensors)
    f = layout.facts
    if f["refused"]:
        return "refused", f
    if f["undone"]:
        return "undone", f
    return ("reproduced" if f["up_first"] else "byte-equal"), f


def test_doc_table_is_the_tested_table():
    assert doc_rows() == {row: outcome(*make())[0] for row, make in ROWS.items()}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_analysis_reads_each_rows_facts(row):
    """The recorded facts become the layout the index reproduces, or a refusal naming the transform."""
    result, facts = outcome(*ROWS[row]())
    if result == "refused":
        with pytest.raises(LayoutRefused, match=re.escape(facts["refused"]["transform"])):
            derive_layout(facts, "bf16", I_TP, facts["source"], "run r rank 1 layer 0")
    else:
        assert derive_layout(facts, "bf16", I_TP, facts["source"]) == ServerLayout(up_first=result == "reproduced")


def test_analysis_refuses_facts_for_another_shard_size():
    _, facts = outcome(*ROWS["vllm-cpu-vec"]())
    with pytest.raises(LayoutRefused, match="24 intermediate rows per rank.*gives each rank 48"):
        derive_layout(facts, "bf16", 48, "resident")
