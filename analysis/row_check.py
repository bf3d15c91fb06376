"""The rows against their manifest: where a rank's rows contradict what its manifest
says it captured (``rows_problems``), from the facts analysis.row_facts gathers.

Part of the completeness rule (tracer.completeness judges the manifests themselves);
only a reader of the rows can apply it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetrace.tracer.completeness import count_of, guard_vouches, id_list
from moetrace.tracer.manifest import layout_key, parse_layout_key
from moetrace.tracer.sampling import Sampling


@dataclass
class RowFacts:
    """What one rank's rows say, for ``rows_problems`` to hold against its manifest
    (analysis.row_facts reads them from the rows it joined with the index)."""

    rows: int = 0
    tp_ranks: set = field(default_factory=set)  # the rows' tp_rank values
    moe_tp_ranks: set = field(default_factory=set)  # the rows' moe_tp_rank values (the shard)
    online: dict = field(default_factory=dict)  # "match" | "mismatch" | "unchecked" -> rows
    captures: int = 0  # distinct capture batches: (model, step, source, capture_seq, layer, tensor)
    steps: set = field(default_factory=set)  # steps of the target model's rows
    resident_steps: set = field(default_factory=set)  # steps of the target model's resident rows
    slot_counts: dict = field(default_factory=dict)  # layout key "<source>:<model>:<layer>" -> slot_count values
    layers: dict = field(default_factory=dict)  # model -> layers with rows
    experts: set = field(default_factory=set)  # logical experts the rows name
    tensors: set = field(default_factory=set)  # tensor names of the rows
    sources: set = field(default_factory=set)  # sources of the rows
    slot_conflicts: list = field(default_factory=list)  # phrases: a slot naming two experts within one load
    contradicted: dict = field(default_factory=dict)  # online verdict -> rows the index judges otherwise


def merged(a: RowFacts, b: RowFacts) -> RowFacts:
    """The facts of two disjoint sets of one rank's rows (segments split by weight updates)."""
    def union(x: dict, y: dict) -> dict:
        return {k: set(x.get(k, set())) | set(y.get(k, set())) for k in set(x) | set(y)}

    def add(x: dict, y: dict) -> dict:
        return {k: x.get(k, 0) + y.get(k, 0) for k in set(x) | set(y)}

    return RowFacts(rows=a.rows + b.rows, tp_ranks=a.tp_ranks | b.tp_ranks,
                    moe_tp_ranks=a.moe_tp_ranks | b.moe_tp_ranks,
                    online=add(a.online, b.online), captures=a.captures + b.captures, steps=a.steps | b.steps,
                    resident_steps=a.resident_steps | b.resident_steps, slot_counts=union(a.slot_counts, b.slot_counts),
                    layers=union(a.layers, b.layers), experts=a.experts | b.experts, tensors=a.tensors | b.tensors,
                    sources=a.sources | b.sources, slot_conflicts=a.slot_conflicts + b.slot_conflicts,
                    contradicted=add(a.contradicted, b.contradicted))


def _layouts(m: dict) -> dict[str, dict]:
    """The manifest's layout facts by layout_key (a key written without the model is the target's)."""
    out = {}
    for key, facts in (m.get("layouts") or {}).items():
        parsed = parse_layout_key(key)
        if parsed is not None and isinstance(facts, dict):
            out[layout_key(*parsed)] = facts
    return out


def layout_slots(facts: dict) -> int | None:
    """Slots a layer's captures must report: the physical slots its expert params hold (else
    num_local_experts) less those the loader never fills (``unfilled_slots``, hooks.fused_moe)."""
    physical = None
    for p in (facts.get("params") or {}).values():
        shape = p.get("shape") if isinstance(p, dict) else None
        if isinstance(shape, list) and shape and isinstance(shape[0], int):
            physical = shape[0]
            break
    if physical is None and isinstance(facts.get("num_local_experts"), int):
        physical = facts["num_local_experts"]
    return None if physical is None else physical - int(facts.get("unfilled_slots") or 0)


# Why a capture point a server's hooks provide (a model's "capture_points") holds no row.
CAPTURE_POINT_HINTS = {
    "loaded": "the model loader never reached moetrace's (another --load-format?)",
    "resident": "no forward pass reached the hooks: torch.compile on (start vLLM with --enforce-eager), or no traffic",
}


def capture_point_problems(models: dict, held: set, kept, vouched: bool) -> list[str]:
    """Every capture point a model's hooks provide (hooks.vllm.session: the load boundary and
    the forward) that the sampling keeps must hold rows: a load-boundary capture alone must
    not pass for a check of the weights the kernel computes with."""
    if vouched:  # a guard's mismatch-only rows: its own coverage speaks for the rest
        return []
    out = []
    for model, entry in sorted(models.items()):
        points = entry.get("capture_points") if isinstance(entry, dict) else None
        for source in points if isinstance(points, list) else ():
            if source not in held and (kept is None or source in kept):
                out.append(f"captured no {source} rows of the {model} ({CAPTURE_POINT_HINTS.get(source, 'never ran')})")
    return out


def _where(key: str) -> str:
    source, model, layer = key.split(":")
    return f"{'' if model == 'target' else model + ' '}layer {layer} ({source})"


def rows_problems(m: dict, f: RowFacts) -> list[str]:
    """Where a rank's rows contradict what its manifest says it captured, one phrase each
    (empty: they agree). Everything the manifest claims must be in the rows: the rank that
    wrote them, the verdicts online verification and the guard recorded, every capture and
    every step it counted, every layer and every slot of the layouts it recorded; and the
    rows must claim nothing the manifest does not."""
    problems = []
    for key, seen in (("tp_rank", f.tp_ranks), ("moe_tp_rank", f.moe_tp_ranks)):
        want = m.get(key)
        if want is None and key == "moe_tp_rank" and isinstance(m.get("tp_rank"), int):
            # not reported by a module (a sink fed directly): the shard a TP rank holds without EP
            moe_tp = m.get("moe_tp_size") or (m.get("tp_size") or 1) // (m.get("ep_size") or 1)
            want = m["tp_rank"] % max(1, int(moe_tp))
        other = sorted(v for v in seen if v != want)
        if other:
            problems.append(f"holds rows of {key} {id_list(other)} but its process was {key} {want} (rows bound to "
                            "another rank)")
    vouched = guard_vouches(m)
    # Counters are comparable with the rows only in a closed trace that lost nothing (an
    # unfinished manifest is a snapshot that may count rows not yet in a part: already a problem).
    closed = bool(m.get("finished")) and not m.get("disabled")
    whole = closed and not count_of(m, "rows_dropped") and not count_of(m, "rows_after_close")
    online = m.get("online") if isinstance(m.get("online"), dict) else {}
    if whole:
        for key in ("match", "mismatch", "unchecked"):
            said, held = int(online.get(key) or 0), int(f.online.get(key) or 0)
            if said != held:
                problems.append(f"manifest counts {said:,} online '{key}' verdicts but its rows hold {held:,}")
        if count_of(m, "captures") != f.captures:
            problems.append(f"manifest counts {count_of(m, 'captures'):,} captures but its rows hold {f.captures:,}")
    guard = m.get("guard") if isinstance(m.get("guard"), dict) else None
    if guard and guard.get("status") != "unverified" and closed:
        t = guard.get("tensors") or {}
        said, held = int(t.get("mismatch") or 0), int(f.online.get("mismatch") or 0)
        if (held != said) if (vouched and whole) else (held < said - count_of(m, "rows_after_close")):
            problems.append(f"guard counts {said:,} mismatching tensors (status {guard.get('status')}) but the rows "
                            f"hold {held:,}")
        if vouched and f.rows != held:
            problems.append(f"guard kept rows of mismatches only, but {f.rows - held:,} rows are not mismatches")
    for verdict, n in sorted(f.contradicted.items()):
        other = "diverge from" if verdict == "match" else "match"
        problems.append(f"{n:,} rows verified online as '{verdict}' {other} the index (the server's verdicts "
                        "disagree with this index's)")
    problems += f.slot_conflicts
    models = m.get("models") if isinstance(m.get("models"), dict) else {}
    # Steps counted from the hooks' own calls (layer-order) are passes the hooks saw, each with its
    # resident captures; a server's pass counter also counts CUDA-graph replays no hook sees.
    counted = (models.get("target") or {}).get("steps_found_by") == "layer-order" if isinstance(models.get("target"),
                                                                                               dict) else False
    try:
        s = Sampling.from_config(m.get("config") or {})
    except Exception:  # a config the tracer would have refused: nothing is sampled out
        s = Sampling()
    target_layers = f.layers.get("target", set())
    for what, held, kept in (("expert", f.experts, s.experts), ("target layer", target_layers, s.layers),
                             ("tensor", f.tensors, s.tensors), ("source", f.sources, s.sources)):
        extra = sorted(held - set(kept)) if kept is not None else []
        if extra:
            problems.append(f"holds rows of {what}(s) {id_list(_short(extra))} that its sampling (config) excluded")
    problems += capture_point_problems(models, f.sources, s.sources, vouched)
    if f.resident_steps and not vouched and counted and whole:
        origin = min(f.steps)
        want = {origin + k for k in range(count_of(m, "steps_seen")) if s.want("resident", k, -1 if s.layers is None
                                                                               else min(s.layers))}
        gone = sorted(want - f.resident_steps)
        if gone:
            problems.append(f"manifest counts {count_of(m, 'steps_seen'):,} steps (steps_seen) but no row holds "
                            f"step(s) {id_list(_short(gone))}")
    for model, layers in sorted(f.layers.items()):
        listed = (models.get(model) or {}).get("layers") if isinstance(models.get(model), dict) else None
        if listed:
            extra = sorted(set(layers) - set(listed))
            if extra:
                problems.append(f"holds rows of {model} layer(s) {id_list(_short(extra))}, which its manifest's model "
                                f"does not have (layers {id_list(_short(sorted(listed)))})")
    layouts = _layouts(m)
    if layouts:
        cfg = m.get("config") or {}
        sampled = cfg.get("experts") is not None or cfg.get("tensors") is not None  # may keep nothing of a layer
        for key in sorted(set(f.slot_counts) - set(layouts)):
            problems.append(f"holds rows of {_where(key)} but records no layout for it")
        if whole and not vouched and not sampled:
            for key in sorted(set(layouts) - set(f.slot_counts)):
                problems.append(f"records the layout of {_where(key)} but holds no row of it")
    for key, counts in sorted(f.slot_counts.items()):
        facts = layouts.get(key)
        want = layout_slots(facts) if facts is not None else None
        if want is None:
            continue
        # facts that changed during the run hold the last capture's unfilled slots: then only the physical bound
        most = want + int(facts.get("unfilled_slots") or 0)
        wrong = sorted(c for c in counts if (c > most if facts.get("changed") else c != want))
        if wrong:
            problems.append(f"loads of {_where(key)} report {id_list(wrong)} slots but its recorded layout holds "
                            f"{want}")
    return problems


def _short(ids: list, n: int = 8) -> list:
    return ids if len(ids) <= n else ids[:n] + [f"… ({len(ids) - n} more)"]
