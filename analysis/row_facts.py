"""What each rank's rows say, gathered once for the completeness rule (tracer.manifest.
rows_problems), which holds them against the rank's manifest.

Columnar: one groupby per fact over every row, then one RowFacts per (run, rank).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moetrace.analysis.coverage import Analysis
from moetrace.analysis.trace import ONLINE
from moetrace.analysis.verdicts import MATCH, OUT_OF_SCOPE
from moetrace.schema import SOURCES
from moetrace.tracer.manifest import RowFacts, layout_key

MAX_CONFLICTS = 3  # slot conflicts named per rank (the count says the rest)


def row_facts(a: Analysis) -> dict[tuple[int, int], RowFacts]:
    """{(run code, rank code): RowFacts} for every (run, rank) with rows."""
    d, c = a.data, a.data.cols
    out: dict[tuple[int, int], RowFacts] = {}
    if d.n == 0:
        return out
    df = pd.DataFrame({k: c[k] for k in ("run", "rank", "tp", "shard", "model", "step", "source", "capture_seq",
                                         "layer", "tensor", "slot", "expert", "copy", "slot_count", "online")})
    df["verdict"] = a.v.verdict
    key = ["run", "rank"]
    for (run, rank), g in df.groupby(key, sort=False):
        out[(int(run), int(rank))] = RowFacts(rows=len(g))
    _sets(df, key, out, d.models.names)
    online = df.groupby(key + ["online"]).size()
    for (run, rank, code), n in online.items():
        out[(run, rank)].online[ONLINE[code]] = int(n)
    batches = df.drop_duplicates(key + ["model", "step", "source", "capture_seq", "layer", "tensor"])
    for (run, rank), n in batches.groupby(key).size().items():
        out[(run, rank)].captures = int(n)
    for (run, rank, model, source, layer), g in df.groupby(key + ["model", "source", "layer"])["slot_count"]:
        f = out[(run, rank)]
        f.slot_counts[layout_key(SOURCES[source], d.models.names[model], layer)] = set(np.unique(g).tolist())
    scope = df["verdict"] != OUT_OF_SCOPE
    said_match, said_mismatch = df["online"] == ONLINE.index("match"), df["online"] == ONLINE.index("mismatch")
    is_match = df["verdict"] == MATCH
    for verdict, bad in (("match", said_match & ~is_match & scope), ("mismatch", said_mismatch & is_match)):
        for (run, rank), n in df[bad].groupby(key).size().items():
            out[(run, rank)].contradicted[verdict] = int(n)
    _conflicts(df, key, out, d.models.names)
    return out


def _sets(df: pd.DataFrame, key: list[str], out: dict, models: list[str]) -> None:
    """The rank identities, steps and layers the rows name."""
    target = df["model"] == models.index("target")
    resident = df["source"] == SOURCES.index("resident")
    for col, attr, rows in (("tp", "tp_ranks", None), ("shard", "moe_tp_ranks", None), ("step", "steps", target),
                            ("step", "resident_steps", target & resident)):
        sub = df if rows is None else df[rows]
        for (run, rank), vals in sub.groupby(key)[col]:
            setattr(out[(run, rank)], attr, set(np.unique(vals).tolist()))
    for (run, rank, model), vals in df.groupby(key + ["model"])["layer"]:
        out[(run, rank)].layers[models[model]] = set(np.unique(vals).tolist())


def _conflicts(df: pd.DataFrame, key: list[str], out: dict, models: list[str]) -> None:
    """Within one capture, a slot holds one expert and one expert copy sits in one slot:
    a slot naming two experts (or a copy named by two slots) is a trace that contradicts itself."""
    event = key + ["model", "step", "source", "capture_seq", "layer"]
    pairs = df.drop_duplicates(event + ["slot", "expert", "copy"])
    for what, by, other in (("slot", ["slot"], "expert"), ("expert", ["expert", "copy"], "slot")):
        clash = pairs[pairs.duplicated(event + by, keep=False)]
        if not len(clash):
            continue
        for (run, rank), g in clash.groupby(key):
            groups = g.groupby(event[2:] + by, sort=True)[other].agg(lambda s: sorted(set(s.tolist())))
            phrases = []
            for idx, names in list(groups.items())[:MAX_CONFLICTS]:
                model, step, source, _, layer = idx[:5]
                layer_s = f"{'' if models[model] == 'target' else models[model] + ' '}layer {layer}"
                if what == "slot":
                    phrases.append(f"step {step} {layer_s} ({SOURCES[source]}): slot {idx[5]} names experts "
                                   f"{', '.join(map(str, names))} within one load")
                else:
                    phrases.append(f"step {step} {layer_s} ({SOURCES[source]}): expert {idx[5]} copy {idx[6]} sits in "
                                   f"slots {', '.join(map(str, names))} within one load")
            more = len(groups) - len(phrases)
            if more:
                phrases[-1] += f" (and {more:,} more such {what}s)"
            out[(int(run), int(rank))].slot_conflicts += phrases


def index_contradictions(a: Analysis) -> list[str]:
    """Rows whose dtype, byte size or per-expert shape is not what the index holds for their
    (model, tensor): the trace describes tensors the index does not (one phrase per kind)."""
    d, c, idx, v = a.data, a.data.cols, a.idx, a.v
    out = []
    rows = np.flatnonzero(v.pos >= 0)
    if len(rows):
        pos = v.pos[rows]
        bad = rows[(c["dtype"][rows] != idx.dtype[pos]) | (c["nbytes"][rows] != idx.nbytes[pos])]
        if len(bad):
            df = pd.DataFrame({"tensor": c["tensor"][bad], "dtype": c["dtype"][bad], "nbytes": c["nbytes"][bad],
                               "want_dtype": idx.dtype[v.pos[bad]], "want_nbytes": idx.nbytes[v.pos[bad]]})
            for key, g in df.groupby(list(df.columns), sort=True):
                t, dt, nb, wdt, wnb = (int(x) for x in key)
                out.append(f"{len(g):,} {d.tensors.names[t]} rows hold {d.dtypes.names[dt]}, {nb:,} bytes, where the "
                           f"index holds {d.dtypes.names[wdt]}, {wnb:,} bytes")
    if idx.shapes is not None:
        held: dict[tuple[int, int], set] = {}
        for model, tensor, shape in idx.shapes:
            held.setdefault((model, tensor), set()).add(shape)
        for (model, tensor, shape), part in sorted(d.shapes.items()):
            want = held.get((model, tensor))
            if want is not None and shape not in want:
                layer = "" if d.models.names[model] == "target" else d.models.names[model] + " "
                out.append(f"{layer}{d.tensors.names[tensor]} rows of shape {list(shape)} (e.g. in {part}), where the "
                           f"index holds {' or '.join(str(list(s)) for s in sorted(want))}")
    return out
