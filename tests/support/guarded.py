"""Scaffolding for the guard's tests: expected shards, a KT-style staged load with the
race, a resident FusedMoE-like module, and a /metrics scrape parsed by prometheus_client.

The staged load copies the checkpoint's shards into ``gpu_layer`` expert by expert; with
``race=True`` the w2 scale of expert e holds expert e+2's bytes for e + 2 < E, as the
unfenced fork's peer ends up (the emulator proves that schedule; here only its result).
"""

from __future__ import annotations

import urllib.request

import torch
from torch import nn

from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.shards import Parallel, expected_layer

NAMES = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")


def shards(ckpt_path, rank: int = 0, tp: int = 1) -> dict[int, dict[str, torch.Tensor]]:
    """{layer: {param: [E, ...]}} as SGLang's FusedMoE holds them on `rank`."""
    ckpt = open_checkpoint(ckpt_path)
    return {L: expected_layer(ckpt, L, rank, Parallel(tp)) for L in ckpt.spec.moe_layers}


class Experts(nn.Module):
    """The FusedMoE params of one layer (FP8 block); forward leaves its input alone."""

    def __init__(self, layer_id: int, params: dict[str, torch.Tensor]):
        super().__init__()
        self.layer_id = layer_id
        self.moe_tp_rank, self.moe_tp_size, self.moe_ep_rank, self.moe_ep_size = 0, 1, 0, 1
        for k, v in params.items():
            self.register_parameter(k, nn.Parameter(v.clone(), requires_grad=False))

    def write(self, params: dict[str, torch.Tensor]) -> None:
        """As SGLang's weight loaders do: through .data (no version bump)."""
        for k, v in params.items():
            getattr(self, k).data.copy_(v)

    def forward(self, x):
        return x


class StagedContext:
    """Stands in for KT's SharedFullContext: ``load`` stages one layer into gpu_layer."""

    def __init__(self, host: dict[int, dict[str, torch.Tensor]], race: bool):
        self.host, self.race = host, race
        first = next(iter(host.values()))
        self.gpu_layer = Experts(99, {k: torch.zeros_like(v) for k, v in first.items()})  # layer_id stale, as KT's
        self.used: list[int] = []  # layers whose experts were computed with

    def load(self, layer_idx, wrapper=None, original_layer=None, gpu_experts_mask=None, logical_to_gpu_index=None):
        src = self.host[layer_idx]
        n = src["w13_weight"].shape[0]
        with torch.no_grad():
            for e in range(n):
                for k in NAMES:
                    stale = self.race and k == "w2_weight_scale_inv" and e + 2 < n
                    getattr(self.gpu_layer, k)[e].copy_(src[k][e + 2 if stale else e])

    def forward_layer(self, layer_idx):
        """What KTEPWrapperMethod.apply does: load, then compute with the staged experts."""
        type(self).load(self, layer_idx=layer_idx, wrapper=None)
        self.used.append(layer_idx)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics over HTTP, parsed by prometheus_client's text parser:
    {(sample name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels` (absent: 0)."""
    want = {k: str(v) for k, v in labels.items()}
    return sum(v for (n, items), v in samples.items() if n == name and want.items() <= dict(items).items())
