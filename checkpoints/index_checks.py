"""What every index read proves before a row is used (checkpoints.index.read_index).

An index is the reference every verdict is measured against: a flipped bit in it
would make a clean server look corrupt (a fail-closed guard kills it) or turn real
matches into "unknown" divergences. So each read checks that the file says the
same thing everywhere:

- the metadata is a JSON object whose sizes are integers (``check_metadata``);
- every row's ``schema_version`` and ``checkpoint_id`` are the metadata's;
- ``nbytes`` is the row's shape times its dtype's size;
- ``digest`` follows from ``chunk_digests`` and ``nbytes`` (fingerprint.tensor_digest),
  and there is one chunk digest per chunk;
- ids are in range (no negative expert, layer or rank);
- every layer the metadata lists has the rows of every expert (and the fused shared
  expert) for every moe_tp_rank read, each with the same tensors.

Any disagreement is a MoetraceError naming the index and the first bad row: exit 2,
never a divergence. docs/index.md.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from moetrace import fingerprint as fpdef
from moetrace.checkpoints import arrow_columns
from moetrace.errors import MoetraceError
from moetrace.schema import INDEX_SCHEMA_VERSION, format_ids

CHECKED_COLUMNS = ("schema_version", "checkpoint_id", "model", "moe_tp_rank", "layer", "expert", "tensor", "dtype",
                   "shape", "nbytes", "digest", "chunk_digests")
_SIZES = {"tp_size": 1, "ep_size": 1, "moe_dp_size": 1, "moe_tp_size": 1, "num_experts": 1, "shared_experts": 0}


def _corrupt(path, what: str) -> MoetraceError:
    return MoetraceError(f"index {path}: corrupt: {what}; rebuild it with `moetrace index`")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_metadata(path, meta: dict) -> None:
    """Types and ranges of the metadata every reader relies on (a key may be absent)."""
    for key, low in _SIZES.items():
        v = meta.get(key)
        if v is not None and (not _is_int(v) or v < low):
            raise _corrupt(path, f"metadata {key} is {v!r}, expected an integer >= {low}")
    layers = meta.get("layers")
    if layers is not None and (not isinstance(layers, list) or not all(_is_int(x) and x >= 0 for x in layers)):
        raise _corrupt(path, f"metadata layers is {layers!r}, expected a list of layer ids")
    if not isinstance(meta.get("checkpoint_id"), str):
        raise _corrupt(path, f"metadata checkpoint_id is {meta.get('checkpoint_id')!r}, expected a string")
    for key in ("draft", "layout"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise _corrupt(path, f"metadata {key} is {meta[key]!r}, expected an object")
    if isinstance(meta.get("draft"), dict) and "layers" in meta["draft"]:
        d = meta["draft"]["layers"]
        if not isinstance(d, list) or not all(_is_int(x) and x >= 0 for x in d):
            raise _corrupt(path, f"metadata draft.layers is {d!r}, expected a list of layer ids")
    tp, ep, dp, mtp = (meta.get(k) for k in ("tp_size", "ep_size", "moe_dp_size", "moe_tp_size"))
    if None not in (tp, ep, dp, mtp) and tp != ep * dp * mtp:
        raise _corrupt(path, f"metadata tp_size {tp} is not ep_size {ep} x moe_dp_size {dp} x moe_tp_size {mtp}")


_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4,
             "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8}


def _itemsize(name: str) -> int | None:
    """Bytes per element of a torch dtype spelled as the schemas spell it (schema.dtype_name),
    without torch: reading an index needs no tensors."""
    name = str(name)
    return 1 if name.startswith("float8_") else _ITEMSIZE.get(name)


def _where(model, layer, expert, tensor) -> str:
    return f"{'' if model == 'target' else model + ' '}layer {layer} expert {expert} {tensor}"


def check_rows(path, meta: dict, table: pa.Table, moe_tp_rank: int | None = None) -> None:
    """The rows read (all, or one moe_tp_rank's) against themselves and the metadata."""
    names = table.column_names
    if table.num_rows == 0:
        return
    for col, want in (("schema_version", INDEX_SCHEMA_VERSION), ("checkpoint_id", meta.get("checkpoint_id"))):
        codes, strings = _codes(path, table, col)
        found = strings or np.unique(codes).tolist()
        if found != [want]:
            raise _corrupt(path, f"rows hold {col} {sorted(map(str, found))}, the metadata says {want}")
    mtp = meta.get("moe_tp_size")
    n_experts = None if meta.get("num_experts") is None else meta["num_experts"] + int(meta.get("shared_experts") or 0)
    for col, high in (("layer", None), ("expert", n_experts), ("moe_tp_rank", mtp)):
        ids = _codes(path, table, col)[0]
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (high is not None and hi >= high):
            bad = lo if lo < 0 else hi
            limit = f"0-{high - 1}" if high is not None else ">= 0"
            raise _corrupt(path, f"a row has {col} {bad}, expected {limit}")
    _check_each_row(path, table, names)
    _check_coverage(path, meta, table, moe_tp_rank)


def _check_each_row(path, table: pa.Table, names: list[str]) -> None:
    """nbytes vs shape x dtype; one chunk digest per chunk; digest vs chunk digests.
    Vectorized but the digests (one hash per row)."""
    nbytes = table.column("nbytes").combine_chunks()
    if nbytes.null_count:
        raise _corrupt(path, "a row has no nbytes")
    nb = arrow_columns.values(nbytes).astype(np.int64)
    bad = np.flatnonzero(nb < 0)
    if "shape" in names:
        shape = table.column("shape").combine_chunks()
        if shape.null_count or shape.values.null_count:
            raise _corrupt(path, "a row's shape is or holds a null")
        dims, offsets = arrow_columns.list_values(shape)  # offsets from 0, into dims
        dims = dims.astype(np.int64)
        prod = np.ones(len(nb), dtype=np.int64)
        nonempty = np.flatnonzero(np.diff(offsets) > 0)
        if len(dims):
            prod[nonempty] = np.multiply.reduceat(dims, offsets[:-1][nonempty])
        dtype_codes, dtype_names = _codes(path, table, "dtype")
        itemsize = np.array([_itemsize(d) or 0 for d in dtype_names], dtype=np.int64)
        if (itemsize == 0).any():
            unknown = [d for d, k in zip(dtype_names, itemsize) if k == 0]
            raise _corrupt(path, f"rows have dtype {unknown[0]!r}, not a torch dtype")
        want = prod * itemsize[dtype_codes]
        bad = np.union1d(bad, np.flatnonzero(want != nb))
    if len(bad):
        i = int(bad[0])
        raise _corrupt(path, f"{_row(table, i)} has nbytes {nb[i]}, its shape and dtype say otherwise")
    if "chunk_digests" not in names:
        return
    chunks = table.column("chunk_digests").combine_chunks()
    lengths = np.where(arrow_columns.valid(chunks), np.diff(arrow_columns.offsets(chunks)), -1)  # null: -1
    wrong = np.flatnonzero(lengths != 16 * -(-nb // fpdef.CHUNK_BYTES))
    if len(wrong):
        i = int(wrong[0])
        raise _corrupt(path, f"{_row(table, i)} has {lengths[i]} bytes of chunk digests, its {nb[i]} bytes need "
                             f"{16 * fpdef.n_chunks_for(int(nb[i]))}")
    digests = table.column("digest").combine_chunks()
    if digests.null_count:
        raise _corrupt(path, "a row has no digest")
    bufs = chunks.buffers()
    width = np.int64 if pa.types.is_large_binary(chunks.type) else np.int32
    offs = np.frombuffer(bufs[1], dtype=width)[chunks.offset:chunks.offset + len(chunks) + 1]
    data = bufs[2].to_pybytes() if bufs[2] is not None else b""
    dig = digests.buffers()[1].to_pybytes()[digests.offset * 16:]
    for i in range(len(nb)):
        if fpdef.tensor_digest(data[offs[i]:offs[i + 1]], int(nb[i])) != dig[16 * i:16 * i + 16]:
            raise _corrupt(path, f"{_row(table, i)}: its digest does not follow from its chunk digests")


def _row(table: pa.Table, i: int) -> str:
    r = table.slice(i, 1).select(["model", "layer", "expert", "tensor"]).to_pylist()[0]
    return _where(r["model"], r["layer"], r["expert"], r["tensor"])


def _codes(path, table: pa.Table, col: str) -> tuple[np.ndarray, list]:
    """A column as integer codes (and the values they stand for, for a string column)."""
    arr = table.column(col).combine_chunks()
    if arr.null_count:
        raise _corrupt(path, f"a row has no {col}")
    return arrow_columns.codes(arr)


def _layer_stats(path, table: pa.Table) -> list[dict]:
    """Per (model, moe_tp_rank, layer): its rows, its distinct experts and tensors."""
    model, names = _codes(path, table, "model")
    rank, layer, expert = (_codes(path, table, c)[0] for c in ("moe_tp_rank", "layer", "expert"))
    tensor, _ = _codes(path, table, "tensor")
    keys, group = np.unique(np.stack([model, rank, layer], axis=1), axis=0, return_inverse=True)
    group = group.reshape(-1)
    distinct = lambda codes: np.bincount(  # noqa: E731
        np.unique(np.stack([group, codes], axis=1), axis=0)[:, 0], minlength=len(keys))
    rows, experts, tensors = np.bincount(group, minlength=len(keys)), distinct(expert), distinct(tensor)
    return [{"model": names[m], "moe_tp_rank": int(r), "layer": int(layer_id), "expert_count": int(rows[i]),
             "expert_count_distinct": int(experts[i]), "tensor_count_distinct": int(tensors[i])}
            for i, (m, r, layer_id) in enumerate(keys)]


def _coded(path, table: pa.Table, cols: list[str], coded: dict | None) -> list[tuple[np.ndarray, list]]:
    """_codes of each column, taken from `coded` where it holds them (and kept there)."""
    coded = {} if coded is None else coded
    for c in cols:
        if c not in coded:
            coded[c] = _codes(path, table, c)
    return [coded[c] for c in cols]


def distinct_rows(path, table: pa.Table, cols: list[str], coded: dict | None = None) -> list[dict]:
    """The distinct combinations of these columns' values, in sorted order of their codes.
    coded: the columns' codes kept for later calls on the same table (rows_where)."""
    coded = _coded(path, table, cols, coded)
    if not table.num_rows:
        return []
    keys = np.unique(np.stack([codes for codes, _ in coded], axis=1), axis=0)
    return [{c: (names[k] if names else int(k)) for c, (_, names), k in zip(cols, coded, key)} for key in keys]


def rows_where(path, table: pa.Table, coded: dict | None = None, **equal) -> pa.Table:
    """The rows whose columns equal these values (model by name, ids by number). coded: as
    distinct_rows' (a column is coded once however many rows are asked for)."""
    keep = np.ones(table.num_rows, dtype=bool)
    for (col, want), (codes, names) in zip(equal.items(), _coded(path, table, list(equal), coded)):
        if names:
            want = names.index(want) if want in names else -1
        keep &= codes == want
    return arrow_columns.take(table, np.flatnonzero(keep))


def _check_coverage(path, meta: dict, table: pa.Table, moe_tp_rank: int | None) -> None:
    """Every listed layer holds every expert with the same tensors, per moe_tp_rank read."""
    if meta.get("num_experts") is None:
        return
    experts = meta["num_experts"] + int(meta.get("shared_experts") or 0)
    ranks = [moe_tp_rank] if moe_tp_rank is not None else list(range(int(meta.get("moe_tp_size") or 1)))
    models = {"target": meta.get("layers")}
    draft = meta.get("draft")
    if isinstance(draft, dict) and "excluded" not in draft:
        models["draft"] = draft.get("layers")
    held = {(s["model"], s["moe_tp_rank"], s["layer"]): s for s in _layer_stats(path, table)}
    for model, layers in models.items():
        for r in ranks:
            missing = [layer for layer in layers or () if (model, r, layer) not in held]
            if missing:
                raise _corrupt(path, f"the metadata lists {model} layers {format_ids(layers)} but moe_tp_rank {r} "
                                     f"has no rows of layer(s) {format_ids(missing)}")
    for (model, r, layer), s in held.items():
        listed = models.get(model)
        if listed is not None and layer not in listed:
            raise _corrupt(path, f"{model} layer {layer} has rows but the metadata lists layers {format_ids(listed)}")
        # a draft model (Qwen3.5 MTP) has the routed experts, with or without a fused shared one
        want = (experts,) if model == "target" else (meta["num_experts"], experts)
        n = s["expert_count_distinct"]
        if n not in want or s["expert_count"] != n * s["tensor_count_distinct"]:
            raise _corrupt(path, f"{model} layer {layer} moe_tp_rank {r} has {s['expert_count']} rows of {n} experts, "
                                 f"expected {s['tensor_count_distinct']} tensors of each of {want[-1]} experts")
