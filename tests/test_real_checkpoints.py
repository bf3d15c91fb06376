"""Checkpoints as transformers and llm-compressor write them: each indexes with shards
derived here independently (from the full tensors, by hand), shared experts included,
or is refused by name exactly where SGLang 0.5.23's model class does not load it.
docs/checkpoints.md's table of writers is read and checked row by row against this.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from support import hf_checkpoints as hf
from support.cli import cli, one_line_error

from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.shards import Parallel, expected_experts
from moetrace.checkpoints.spec import spec_from_config
from moetrace.errors import MoetraceError
from moetrace.fingerprint import fingerprint

pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parent.parent / "docs" / "checkpoints.md"
SHARED = {"qwen3_next": "shared_expert", "qwen3_5_moe": "shared_expert", "qwen3_5_moe_text": "shared_expert",
          "deepseek_v3": "shared_experts"}
# (writer, family, format) -> None (indexed) or the refusal's words
CASES = {
    **{("transformers", f, "bf16"): None for f in hf.ARCHS},
    ("transformers", "qwen3_moe", "bf16 fused"): "models/qwen3_moe.py maps per-expert names only",
    ("transformers", "qwen3_next", "bf16 fused"): "models/qwen3_next.py maps per-expert names only",
    ("transformers", "qwen3_5_moe", "bf16 fused"): None,
    ("transformers", "qwen3_5_moe_text", "bf16 fused"): None,
    ("transformers", "deepseek_v3", "bf16 fused"): None,
    ("transformers", "qwen3_5_moe", "fp8 block fused"): None,
    ("transformers", "qwen3_5_moe_text", "fp8 block fused"): None,
    ("transformers", "deepseek_v3", "fp8 block fused"): "loader maps model.layers.1.mlp.experts.gate_up_proj_scale;",
    ("transformers", "qwen3_5_moe", "fp8 block"): None,
    ("transformers", "deepseek_v3", "fp8 block"): None,
    # with one scale block across H, transformers 5.19 writes per-expert FP8 scales squeezed ([2] for [2, 1])
    ("transformers", "qwen3_5_moe", "fp8 block, hidden 128"): "scale shape [2] does not match weight_block_size",
    ("transformers", "deepseek_v3", "fp8 block, hidden 128"): "scale shape [2] does not match weight_block_size",
    **{("llm-compressor", p.name.rsplit("-", 1)[0], p.name.rsplit("-", 1)[1].replace("_", " ")): None
       for p in hf.llmcompressor_outputs()},
}


@pytest.fixture(scope="session")
def written(tmp_path_factory):
    """(writer, family, format) -> checkpoint folder, written on first use."""
    made: dict[tuple, Path] = {}

    def get(case: tuple) -> Path:
        if case not in made:
            writer, family, fmt = case
            if writer == "llm-compressor":
                made[case] = hf.DATA / f"{family}-{fmt.replace(' ', '_')}"
            else:
                root = tmp_path_factory.mktemp(f"{family}-{re.sub('[^a-z0-9]+', '-', fmt)}")
                fused = fmt.endswith("fused")
                hidden = 128 if fmt.endswith("hidden 128") else 256
                made[case] = (hf.fp8(root, family, fused, hidden) if fmt.startswith("fp8")
                              else hf.save_pretrained(root, family, fused=fused))
        return made[case]

    return get


class Full:
    """The checkpoint's tensors, read whole with safetensors: the independent side."""

    def __init__(self, root: Path, family: str):
        self.f = safe_open(str(root / "model.safetensors"), "pt")
        self.names = set(self.f.keys())
        cfg = json.loads((root / "config.json").read_text())
        q = cfg.get("quantization_config") or {}
        self.prefix = "model.language_model" if family == "qwen3_5_moe" else "model"
        self.shared = SHARED.get(family)
        if not q:
            self.kind, self.block = "bf16", None
        elif q["quant_method"] == "fp8":
            self.kind, self.block = "fp8", tuple(q["weight_block_size"])
        else:
            w = next(iter(q["config_groups"].values()))["weights"]
            self.kind = "ct " + w["strategy"]
            self.block = tuple(w["block_structure"]) if w["strategy"] == "block" else None

    def get(self, name: str) -> torch.Tensor:
        return self.f.get_tensor(name)

    def expert(self, layer: int, e: int, num_experts: int) -> dict[str, torch.Tensor]:
        """gate, up, down and their scales (gate_s, up_s, down_s) of one expert."""
        stem = f"{self.prefix}.layers.{layer}.mlp"
        suffix = "weight_scale_inv" if self.kind == "fp8" else "weight_scale"
        if f"{stem}.experts.gate_up_proj" in self.names and e < num_experts:
            gu, down = self.get(f"{stem}.experts.gate_up_proj")[e], self.get(f"{stem}.experts.down_proj")[e]
            out = {"gate": gu[: hf.I], "up": gu[hf.I:], "down": down}
            if self.kind != "bf16":
                s = self.get(f"{stem}.experts.gate_up_proj_scale_inv")[e]
                half = s.shape[0] // 2
                out.update(gate_s=s[:half], up_s=s[half:], down_s=self.get(f"{stem}.experts.down_proj_scale_inv")[e])
            return out
        mod = f"experts.{e}" if e < num_experts else self.shared
        out = {p: self.get(f"{stem}.{mod}.{p}_proj.weight") for p in ("gate", "up", "down")}
        if self.kind != "bf16":
            out.update({f"{p}_s": self.get(f"{stem}.{mod}.{p}_proj.{suffix}") for p in ("gate", "up", "down")})
        return out

    def shard(self, layer: int, e: int, num_experts: int, r: int, tp: int) -> dict[str, torch.Tensor]:
        x, n = self.expert(layer, e, num_experts), hf.I // tp
        rows = slice(r * n, (r + 1) * n)
        out = {"w13_weight": torch.cat([x["gate"][rows], x["up"][rows]]), "w2_weight": x["down"][:, rows]}
        if self.kind == "bf16":
            return out
        name = "weight_scale_inv" if self.kind == "fp8" else "weight_scale"
        if self.block:
            bn, bk = self.block
            b_rows, b_cols = slice(r * n // bn, (r + 1) * n // bn), slice(r * n // bk, (r + 1) * n // bk)
            out[f"w13_{name}"] = torch.cat([x["gate_s"][b_rows], x["up_s"][b_rows]]).float()
            out[f"w2_{name}"] = x["down_s"][:, b_cols].float()
        else:  # per-channel: w2 keeps every output channel
            out[f"w13_{name}"] = torch.cat([x["gate_s"][rows], x["up_s"][rows]]).float().reshape(-1, 1)
            out[f"w2_{name}"] = x["down_s"].float().reshape(-1, 1)
        return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


INDEXED = sorted(k for k, v in CASES.items() if v is None)
REFUSED = sorted(k for k, v in CASES.items() if v is not None)


@pytest.mark.parametrize("case", INDEXED, ids=" / ".join)
def test_indexes_with_independent_shards(written, case, tmp_path):
    writer, family, fmt = case
    root = written(case)
    full, ckpt = Full(root, family), open_checkpoint(root)
    spec = ckpt.spec
    assert spec.shared_experts == (1 if family in SHARED else 0), "every shared expert here is shaped like a routed one"
    assert spec.fused_experts == fmt.endswith("fused")
    want_digests = {}
    for layer in spec.moe_layers:
        for r in range(2):
            got = expected_experts(ckpt, layer, r, Parallel(2))
            for e in range(spec.num_experts + spec.shared_experts):
                for name, t in full.shard(layer, e, spec.num_experts, r, 2).items():
                    g = got[name][e]
                    assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(_bytes(g), _bytes(t)), \
                        f"{case} layer {layer} rank {r} expert {e} {name}"
                    want_digests[(r, layer, e, name)] = fingerprint(t).digest
    out = tmp_path / "index.parquet"
    r = cli("index", root, "--tp", 2, "-o", out, "--no-cache")
    assert r.exit_code == 0, r.output
    rows = [x for x in pq.read_table(out).to_pylist() if x["model"] == "target"]
    got_digests = {(x["moe_tp_rank"], x["layer"], x["expert"], x["tensor"]): x["digest"] for x in rows}
    assert got_digests == want_digests


@pytest.mark.parametrize("case", REFUSED, ids=" / ".join)
def test_refused_by_name_where_sglang_does_not_load(written, case, tmp_path):
    root = written(case)
    with pytest.raises(MoetraceError, match=re.escape(CASES[case])):
        ckpt = open_checkpoint(root)  # names refused here, tensor shapes when first read
        expected_experts(ckpt, ckpt.spec.moe_layers[-1], 0, Parallel(2))
    r = cli("index", root, "--tp", 2, "-o", tmp_path / "index.parquet", "--no-cache")
    one_line_error(r, CASES[case])
    assert not (tmp_path / "index.parquet").exists()


def _doc_rows() -> dict[tuple[str, str, str], str]:
    """docs/checkpoints.md's writers table: (writer, family, format) -> "indexed" | "refused"."""
    text = DOC.read_text()
    table = text[text.index("<!-- writers table -->"):]
    rows = {}
    for line in table.splitlines()[3:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows[(cells[0], cells[1], cells[2])] = cells[3].split()[0].rstrip(":")
    return rows


def test_docs_table_is_the_behaviour():
    """Every row of the docs table is a case here with the same outcome, and every case is a row."""
    want = {k: ("indexed" if v is None else "refused") for k, v in CASES.items()}
    assert _doc_rows() == want


# ------------------------------------------------- SGLang's own name mapping (model level)

@pytest.fixture(scope="session", params=["sglang", "sglang-kt"])
def sglang(request):
    """(support.sglang_loader, its build of upstream sglang 0.5.23 or the KT fork 0.7.2)."""
    from support import sglang_loader as sl
    from support.sglang_source import fork_root, installed_root

    root = installed_root("sglang") if request.param == "sglang" else fork_root()
    if root is None:
        pytest.skip(f"{request.param} not installed (make venv installs it)")
    o = sl.build(str(root))
    o.dist = request.param
    return sl, o


def _sglang_family(family: str) -> str:
    return "qwen3_5_moe" if family.startswith("qwen3_5_moe") else family


def _expert_weights(root: Path) -> list[tuple[str, torch.Tensor]]:
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        return [(n, f.get_tensor(n)) for n in sorted(f.keys()) if ".mlp.experts." in n or ".mlp.shared_experts." in n]


def _load_all_layers(sl, o, ckpt, root: Path, family: str, rank: int, fused_shared: int = 0):
    spec = ckpt.spec
    fmt, qm = spec.fmt, spec.quant_method
    layers = {L: sl.make_layer(o, layer_id=L, num_experts=spec.num_experts + fused_shared, hidden=spec.hidden_size,
                               intermediate=spec.intermediate_size, tp_size=2, ep_size=1, tp_rank=rank, fmt=fmt,
                               quant_method=qm, block=spec.block) for L in spec.moe_layers}
    for m in layers.values():
        for p in m.parameters():  # anything the model's mapping does not fill shows
            _bytes(p.data).fill_(0xA5)
    sl.load(o, _expert_weights(root), layers, spec.num_experts, family=_sglang_family(family), fused_shared=fused_shared)
    return layers


@pytest.mark.parametrize("case", INDEXED, ids=" / ".join)
def test_sglang_model_mapping_fills_what_the_index_expects(sglang, written, case):
    """The installed SGLang model class's own name mapping (qwen3_moe.py, qwen3_next.py,
    qwen3_5.py load_weights; DeepSeek's do_load_weights with its shared expert fused into
    the last slot) maps the real writer's names onto every FusedMoE parameter, equal byte
    for byte to moetrace's shards. Qwen shared experts are not fused on CUDA: routed only."""
    sl, o = sglang
    writer, family, fmt = case
    root = written(case)
    ckpt = open_checkpoint(root)
    shared = ckpt.spec.shared_experts if family == "deepseek_v3" else 0
    for rank in range(2):
        layers = _load_all_layers(sl, o, ckpt, root, family, rank, fused_shared=shared)
        if o.dist == "sglang-kt" and family == "deepseek_v3" and ckpt.spec.fused_experts:
            # docs/checkpoints.md: the fork's DeepSeek loader skips fused names (routed slots stay unwritten)
            for m in layers.values():
                assert bool((_bytes(m.w13_weight.data[: ckpt.spec.num_experts]) == 0xA5).all())
            continue
        for L, m in layers.items():
            want = expected_experts(ckpt, L, rank, Parallel(2), experts=range(ckpt.spec.num_experts + shared))
            held = {n: p.data for n, p in m.named_parameters()}
            assert set(held) == set(want), (case, sorted(held), sorted(want))
            for name, w in want.items():
                g = held[name]
                assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(_bytes(g), _bytes(w)), \
                    f"{case} rank {rank} layer {L} {name}"


def test_sglang_skips_fused_deepseek_scale_inv(sglang, written):
    """Upstream only (the fork maps no fused DeepSeek name at all).
    The refusal's premise, from deepseek_weight_loader.py itself: transformers' fused
    FP8 scale names (gate_up_proj_scale_inv) fill no scale; renamed to the _scale it maps,
    the same checkpoint indexes and equals SGLang's load."""
    sl, o = sglang
    if o.dist != "sglang":
        pytest.skip("the fork maps no fused DeepSeek names (test_sglang_model_mapping_fills_what_the_index_expects)")
    root = written(("transformers", "deepseek_v3", "fp8 block fused"))
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        tensors, metadata = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
    renamed = root.parent / (root.name + "-renamed")
    renamed.mkdir()
    (renamed / "config.json").write_text((root / "config.json").read_text())
    from safetensors.torch import save_file
    save_file({n.replace("_proj_scale_inv", "_proj_scale") if ".mlp.experts." in n else n: t
               for n, t in tensors.items()}, str(renamed / "model.safetensors"), metadata=metadata)
    ckpt = open_checkpoint(renamed)
    assert ckpt.spec.fused_experts and ckpt.spec.fmt == "fp8_block" and ckpt.spec.shared_experts == 1
    layers = _load_all_layers(sl, o, ckpt, root, "deepseek_v3", 0, fused_shared=1)  # the _scale_inv names
    E = ckpt.spec.num_experts
    for m in layers.values():  # routed weights land, their scales do not (the fused shared expert's do)
        for scale in (m.w13_weight_scale_inv, m.w2_weight_scale_inv):
            assert bool((_bytes(scale.data[:E]) == 0xA5).all()) and not bool((_bytes(scale.data[E:]) == 0xA5).all())
        assert not bool((_bytes(m.w13_weight.data[:E]) == 0xA5).all())
    layers = _load_all_layers(sl, o, ckpt, renamed, "deepseek_v3", 1, fused_shared=1)
    for L, m in layers.items():
        want = expected_experts(ckpt, L, 1, Parallel(2))
        for name, p in m.named_parameters():
            assert torch.equal(_bytes(p.data), _bytes(want[name])), name


def test_sglang_skips_fused_qwen3_moe_names(sglang, written):
    """The refusal's premise, from qwen3_moe.py itself: fused names fill nothing."""
    sl, o = sglang
    root = written(("transformers", "qwen3_moe", "bf16 fused"))
    per_expert = open_checkpoint(written(("transformers", "qwen3_moe", "bf16")))  # same sizes
    layers = _load_all_layers(sl, o, per_expert, root, "qwen3_moe", 0)
    for m in layers.values():
        for p in m.parameters():
            assert bool((_bytes(p.data) == 0xA5).all())


@pytest.mark.parametrize("family", ["qwen3_5_moe", "deepseek_v3"])
def test_sglang_fails_on_squeezed_per_expert_fp8_scales(sglang, written, family):
    """The refusal's premise: transformers' per-expert FP8 block scales ([2] for [2, 1])
    fail FusedMoE's loader (it narrows the scale along its second dimension)."""
    sl, o = sglang
    root = written(("transformers", family, "fp8 block, hidden 128"))
    sizes = types.SimpleNamespace(spec=spec_from_config(json.loads((root / "config.json").read_text()), root))
    with pytest.raises(IndexError):
        _load_all_layers(sl, o, sizes, root, family, 0, fused_shared=1 if family == "deepseek_v3" else 0)


def test_sglang_fails_on_fused_qwen3_next_names(sglang, written):
    sl, o = sglang
    root = written(("transformers", "qwen3_next", "bf16 fused"))
    per_expert = open_checkpoint(written(("transformers", "qwen3_next", "bf16")))
    with pytest.raises(KeyError, match="experts"):
        _load_all_layers(sl, o, per_expert, root, "qwen3_next", 0)
