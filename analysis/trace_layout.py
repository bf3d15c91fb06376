"""The server layout of a trace, from the layout facts its rank manifests recorded.

Every captured (rank, source, layer) has facts (hooks.layout_facts); each becomes a
ServerLayout or a refusal (checkpoints.layout_rules). A trace is compared with one
index, so all of them must agree. Facts of modules that are not SGLang's own (test
stand-ins, moetrace's emulator) that lack SGLang's attributes are taken as the
canonical layout, with a warning; SGLang's own modules must say everything the rules
need, or the audit refuses (exit 2) rather than guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from moetrace.checkpoints.layout import CANONICAL, LayoutRefused, ServerLayout
from moetrace.checkpoints.layout_rules import derive_layout
from moetrace.errors import MoetraceError
from moetrace.tracer.manifest import parse_layout_key

SGLANG_MODULE_PREFIX = "sglang."


@dataclass
class TraceLayout:
    layout: ServerLayout
    warnings: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)  # (run_id, rank, source, model, layer) -> facts


def _where(run_id: str, rank, source: str, model: str, layer: int) -> str:
    return f"run {run_id} rank {rank} {'' if model == 'target' else model + ' '}layer {layer} ({source})"


def recorded_facts(runs) -> dict[tuple[str, str, str, str, int], dict | None]:
    """(run_id, rank label, source, model, layer) -> facts, for every layer a rank manifest lists."""
    out: dict = {}
    for run in runs:
        for rank, rm in sorted(run.ranks.items()):
            layouts = rm.manifest.get("layouts")
            if not isinstance(layouts, dict):
                continue
            for key, facts in layouts.items():
                parsed = parse_layout_key(key)
                if parsed is not None:
                    out[(run.run_id, rank, *parsed)] = facts if isinstance(facts, dict) else {"error": repr(facts)}
    return out


def _is_sglang(facts: dict) -> bool:
    return str(facts.get("module_path") or "").startswith(SGLANG_MODULE_PREFIX)


def layout_of_runs(runs, fmt: str, intermediate_size: int) -> TraceLayout:
    """The one ServerLayout of the runs' captured layers, or MoetraceError / LayoutRefused (exit 2)."""
    found: dict[ServerLayout, tuple] = {}
    warnings: list[str] = []
    facts_by_key = recorded_facts(runs)
    for (run_id, rank, source, model, layer), facts in sorted(facts_by_key.items()):
        run = next(r for r in runs if r.run_id == run_id)
        moe_tp = max(1, getattr(run, "moe_tp_size", None) or run.tp_size // max(1, run.ep_size))
        where = _where(run_id, rank, source, model, layer)
        try:
            layout = derive_layout(facts, fmt, intermediate_size // moe_tp, source, where)
        except LayoutRefused as err:
            if facts and not _is_sglang(facts) and err.transform == "an unknown layout":
                warnings.append(f"{where}: {facts.get('module_class')} is not SGLang's FusedMoE and does not say its "
                                "layout; compared as gate rows first, unpadded")
                layout = CANONICAL
            else:
                raise
        found.setdefault(layout, (where, facts))
    if len(found) > 1:
        desc = "; ".join(f"{where}: {layout.describe()}" for layout, (where, _) in found.items())
        raise MoetraceError(f"the trace records more than one expert layout ({desc}); one index reproduces one "
                            "layout: analyze these ranks or layers separately")
    if not facts_by_key and any("layout_schema" not in rm.manifest for run in runs for rm in run.ranks.values()):
        warnings.append("the trace records no layout facts (written by a moetrace before layouts were recorded): "
                        "compared as gate rows first, unpadded")
    layout = next(iter(found), CANONICAL)
    return TraceLayout(layout, warnings, facts_by_key)


def check_params(trace_layout: TraceLayout, expected: dict[str, tuple[str, list[int]]]) -> None:
    """Every recorded expert param must have the dtype and per-expert shape the index
    holds: anything else is a layout moetrace does not model (refused by name)."""
    for (run_id, rank, source, model, layer), facts in sorted(trace_layout.facts.items()):
        for name, p in ((facts or {}).get("params") or {}).items():
            want = expected.get(name)
            if want is None or not isinstance(p, dict):
                continue
            dtype, shape = p.get("dtype"), list(p.get("shape") or [])[1:]
            if (dtype, shape) != (want[0], list(want[1])):
                raise LayoutRefused(f"an unmodelled {name} layout ({dtype} {shape} per expert)",
                                    f"the layout moetrace reproduces holds {want[0]} {list(want[1])}",
                                    _where(run_id, rank, source, model, layer))


def layout_of_trace(paths: Sequence[str], spec) -> ServerLayout:
    """`moetrace index --layout-from TRACE`: the layout the trace at `paths` recorded."""
    from moetrace.analysis.discovery import discover, load_runs

    return layout_of_runs(load_runs(discover(list(paths))), spec.fmt, spec.intermediate_size).layout
