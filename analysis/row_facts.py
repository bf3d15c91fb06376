"""What each rank's rows say, gathered once for the completeness rule (analysis.row_check.
rows_problems), which holds them against the rank's manifest.

Columnar: the rows are sorted by (run, rank) once; each rank's facts are distinct
counts over integer keys of its slice (several columns folded into one 64-bit key).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moetrace.analysis.coverage import Analysis
from moetrace.analysis.row_check import RowFacts
from moetrace.analysis.trace import ONLINE
from moetrace.analysis.verdicts import MATCH, OUT_OF_SCOPE
from moetrace.schema import SOURCES
from moetrace.tracer.manifest import layout_key

MAX_CONFLICTS = 3  # slot conflicts named per rank (the count says the rest)


def _key(*cols: np.ndarray) -> np.ndarray:
    """Several integer columns folded into one uint64 per row: each step multiplies in a
    column and scrambles with splitmix64's bijective finalizer, so equal rows give equal
    keys and different rows collide with probability about 2^-64 per pair."""
    h = np.zeros(len(cols[0]), np.uint64)
    with np.errstate(over="ignore"):
        for x in cols:
            h = h * np.uint64(0x9E3779B97F4A7C15) + x.astype(np.int64).astype(np.uint64) + np.uint64(1)
            h ^= h >> np.uint64(30)
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(27)
            h *= np.uint64(0x94D049BB133111EB)
            h ^= h >> np.uint64(31)
    return h


def _uniq(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values (by one sort: numpy's np.unique is many times slower on large int arrays)."""
    s = np.sort(x)
    return s[np.r_[True, s[1:] != s[:-1]]] if len(s) else s


def _distinct(x: np.ndarray) -> set[int]:
    return set(_uniq(x).tolist())


def row_facts(a: Analysis) -> dict[tuple[int, int], RowFacts]:
    """{(run code, rank code): RowFacts} for every (run, rank) with rows."""
    d, c = a.data, a.data.cols
    out: dict[tuple[int, int], RowFacts] = {}
    if d.n == 0:
        return out
    n_rank = int(c["rank"].max()) + 1
    pair = c["run"].astype(np.int64) * n_rank + c["rank"]
    order = np.argsort(pair, kind="stable")
    cuts = np.flatnonzero(np.diff(pair[order])) + 1
    for ix in np.split(order, cuts):
        run, rank = divmod(int(pair[ix[0]]), n_rank)
        out[(run, rank)] = _facts(a, ix)
    return out


def _facts(a: Analysis, ix: np.ndarray) -> RowFacts:
    """The facts of one rank's rows (positions ix)."""
    d = a.data
    col = {k: d.cols[k][ix] for k in ("tp", "shard", "model", "step", "source", "capture_seq", "layer", "tensor",
                                      "slot", "expert", "copy", "slot_count", "online")}
    f = RowFacts(rows=len(ix), tp_ranks=_distinct(col["tp"]), moe_tp_ranks=_distinct(col["shard"]))
    f.online = {ONLINE[i]: int(n) for i, n in enumerate(np.bincount(col["online"], minlength=len(ONLINE))) if n}
    event = _key(col["model"], col["step"], col["source"], col["capture_seq"], col["layer"])
    f.captures = len(_uniq(_key(event, col["tensor"])))  # one batch per tensor of a capture
    target = col["model"] == d.models.code("target")
    f.steps = _distinct(col["step"][target])
    f.resident_steps = _distinct(col["step"][target & (col["source"] == SOURCES.index("resident"))])
    top = int(col["slot_count"].max()) + 1
    layer_top = int(col["layer"].max()) + 1
    loads = _uniq(((col["source"].astype(np.int64) * len(d.models) + col["model"]) * layer_top + col["layer"]) * top
                      + col["slot_count"])
    for k in loads.tolist():
        rest, count = divmod(k, top)
        rest, layer = divmod(rest, layer_top)
        source, model = divmod(rest, len(d.models))
        f.slot_counts.setdefault(layout_key(SOURCES[source], d.models.names[model], layer), set()).add(count)
    for k in _uniq(col["model"].astype(np.int64) * layer_top + col["layer"]).tolist():
        model, layer = divmod(k, layer_top)
        f.layers.setdefault(d.models.names[model], set()).add(layer)
    f.experts = _distinct(col["expert"])
    f.tensors = {d.tensors.names[t] for t in _uniq(col["tensor"]).tolist()}
    f.sources = {SOURCES[x] for x in _uniq(col["source"]).tolist()}
    verdict = a.verdicts.verdict[ix]
    is_match = verdict == MATCH
    for word, bad in (("match", (col["online"] == ONLINE.index("match")) & ~is_match & (verdict != OUT_OF_SCOPE)),
                      ("mismatch", (col["online"] == ONLINE.index("mismatch")) & is_match)):
        if bad.any():
            f.contradicted[word] = int(bad.sum())
    f.slot_conflicts = _conflicts(d, col, event)
    return f


def _conflicts(d, col: dict, event: np.ndarray) -> list[str]:
    """Within one capture, a slot holds one expert and one expert copy sits in one slot:
    a slot naming two experts (or a copy named by two slots) is a trace that contradicts itself."""
    phrases = []
    held = col["expert"].astype(np.int64) * 65536 + col["copy"]
    for what, where, value in (("slot", _key(event, col["slot"]), held),
                               ("expert", _key(event, col["expert"], col["copy"]), col["slot"].astype(np.int64))):
        pairs = _key(where, value)
        if len(_uniq(pairs)) == len(_uniq(where)):  # one value per place: the common, fast answer
            continue
        _, rows_p = np.unique(pairs, return_index=True)  # a row per distinct (where, value)
        w_p = where[rows_p]
        _, inverse, counts = np.unique(w_p, return_inverse=True, return_counts=True)
        clash = counts[inverse.reshape(-1)] > 1  # where named with two values
        if not clash.any():
            continue
        groups = pd.DataFrame({"where": w_p[clash], "row": rows_p[clash]}).groupby("where", sort=False)["row"]
        named = []
        for _, rows in groups:
            r = rows.to_numpy()
            model = d.models.names[int(col["model"][r[0]])]
            layer = f"{'' if model == 'target' else model + ' '}layer {int(col['layer'][r[0]])}"
            at = f"step {int(col['step'][r[0]])} {layer} ({SOURCES[int(col['source'][r[0]])]})"
            if what == "slot":
                names = ", ".join(str(x) for x in sorted({int(col["expert"][i]) for i in r}))
                named.append((int(col["step"][r[0]]), f"{at}: slot {int(col['slot'][r[0]])} names experts {names} "
                                                      "within one load"))
            else:
                slots = ", ".join(str(x) for x in sorted({int(col["slot"][i]) for i in r}))
                named.append((int(col["step"][r[0]]), f"{at}: expert {int(col['expert'][r[0]])} copy "
                                                      f"{int(col['copy'][r[0]])} sits in slots {slots} within one "
                                                      f"load"))
        named.sort()
        shown = [p for _, p in named[:MAX_CONFLICTS]]
        if len(named) > len(shown):
            shown[-1] += f" (and {len(named) - len(shown):,} more such {what}s)"
        phrases += shown
    return phrases


def index_contradictions(a: Analysis) -> list[str]:
    """Rows whose dtype, byte size or per-expert shape is not what the index holds for their
    (model, tensor): the trace describes tensors the index does not (one phrase per kind)."""
    d, c, idx, v = a.data, a.data.cols, a.idx, a.verdicts
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
