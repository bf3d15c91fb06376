"""Verdict per trace row, by content: columnar joins on the 16-byte fingerprint.

Order of questions asked of a row (the first yes wins):

1. ``out_of_scope``: its (shard, model, layer) has no entry in the index (the index
   was built for fewer layers): ignored and counted.
2. ``unexpected``: the index covers its (shard, model, layer) but has no entry for
   its (expert, tensor).
3. ``match``: its fingerprint equals the expected one.
4. ``zeros`` / ``constant``: it equals a constant fill of its size (zeros, or a
   value from ``analysis.constants.CONSTANT_CANDIDATES`` for its dtype). A constant has no
   identity, so this is asked before "which tensor is it".
5. ``stale`` (E+k), ``wrong_rank``, ``wrong_layer``, ``wrong_tensor``: it equals
   some index entry; the entry closest to the expected key names the relation
   (same rank/layer/tensor other expert, then other rank, then other layer,
   then other tensor kind; smaller |k| first).
6. With chunk digests (recorded for this row): ``torn`` when its chunks
   come from several sources (index entries of the same size, or zero chunks),
   ``constant`` (value not identified) when all its full 64 KiB chunks are
   equal and match nothing, else ``unknown``.
7. ``unknown``.

Everything is vectorized over rows; Python loops run only over the few rows
that reach step 6, and over distinct (dtype, size) pairs for constants.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moetrace.analysis.constants import constant_candidates, constant_fingerprint
from moetrace.analysis.expected import IndexData
from moetrace.analysis.trace import TraceData, digest_pair, read_chunk_digests
from moetrace.fingerprint import CHUNK_BYTES

# Verdict codes. Ordered roughly by how bad they are to a reader of the plot.
MATCH, STALE, WRONG_RANK, WRONG_LAYER, WRONG_TENSOR, ZEROS, CONSTANT, TORN, UNKNOWN, UNEXPECTED, MISSING = range(11)
OUT_OF_SCOPE = -1
VERDICTS = (
    "match", "stale", "wrong_rank", "wrong_layer", "wrong_tensor", "zeros", "constant", "torn",
    "unknown", "unexpected", "missing",
)

@dataclass
class Verdicts:
    """Per-row results, aligned with TraceData.cols."""

    verdict: np.ndarray  # int8 code, OUT_OF_SCOPE for ignored rows
    pos: np.ndarray  # expected index entry, -1 if none
    found: np.ndarray  # index entry the content equals (stale/wrong_*), -1 if none
    k: np.ndarray  # found expert - expected expert (stale, wrong_*), 0 otherwise
    value: dict[int, str] = field(default_factory=dict)  # row -> constant fill description
    torn: dict[int, list[dict]] = field(default_factory=dict)  # row -> chunk ranges by source
    no_chunks: set[int] = field(default_factory=set)  # unknown rows without chunk digests


# ---------------------------------------------------------------- fp joins


def fp_join(q_hi: np.ndarray, q_lo: np.ndarray, t_hi: np.ndarray, t_lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All (query, table) position pairs with equal 128-bit fingerprints."""
    if len(q_hi) == 0 or len(t_hi) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort((t_lo, t_hi))
    s_hi = t_hi[order]
    left = np.searchsorted(s_hi, q_hi, side="left")
    right = np.searchsorted(s_hi, q_hi, side="right")
    counts = right - left
    q = np.repeat(np.arange(len(q_hi)), counts)
    if len(q) == 0:
        return q, q
    offs = np.arange(len(q)) - np.repeat(np.cumsum(counts) - counts, counts)
    t = order[np.repeat(left, counts) + offs]
    ok = t_lo[t] == q_lo[q]
    return q[ok], t[ok]


def first_per_group(groups: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Positions (into groups) of the lowest score of each group."""
    o = np.lexsort((score, groups))
    g = groups[o]
    keep = np.ones(len(o), dtype=bool)
    keep[1:] = g[1:] != g[:-1]
    return o[keep]


# ---------------------------------------------------------------- expected lookup


class KeyLookup:
    """(shard, layer key, expert, tensor) -> index position, dense when small. The layer
    key (``lkey``, set by the Analysis) folds the model into the layer: a draft's layer 0
    is not the target's."""

    def __init__(self, idx: IndexData, n_tensors: int):
        self.idx = idx
        self.nr = int(idx.rank.max()) + 1
        self.nl = int(idx.lkey.max()) + 1
        self.ne = int(idx.expert.max()) + 1
        self.nt = max(n_tensors, int(idx.tensor.max()) + 1)
        keys = self._key(idx.rank, idx.lkey, idx.expert, idx.tensor)
        self.dense = None
        size = self.nr * self.nl * self.ne * self.nt
        if size <= (1 << 25):
            self.dense = np.full(size, -1, dtype=np.int64)
            self.dense[keys] = np.arange(idx.n)
        self.keys = keys  # sorted, since the index is sorted by the same key
        # (shard, layer key) blocks: contiguous runs of the index
        rl = idx.rank * self.nl + idx.lkey
        self.block_start = np.full(self.nr * self.nl, -1, dtype=np.int64)
        self.block_len = np.zeros(self.nr * self.nl, dtype=np.int64)
        starts = np.flatnonzero(np.r_[True, rl[1:] != rl[:-1]])
        self.block_start[rl[starts]] = starts
        self.block_len[rl[starts]] = np.diff(np.r_[starts, idx.n])

    def _key(self, r, l, e, t):
        return ((r.astype(np.int64) * self.nl + l) * self.ne + e) * self.nt + t

    @staticmethod
    def _inside(a: np.ndarray, n: int) -> np.ndarray | None:
        """None when every value is in [0, n) (checked on min/max), else a mask."""
        if len(a) == 0 or (int(a.min()) >= 0 and int(a.max()) < n):
            return None
        return (a >= 0) & (a < n)

    def _ok(self, pairs) -> np.ndarray | None:
        ok = None
        for a, n in pairs:
            m = self._inside(a, n)
            if m is not None:
                ok = m if ok is None else ok & m
        return ok

    def block_of(self, r, l) -> np.ndarray:
        """(rank, layer) block id, -1 when the index has no entry for it."""
        ok = self._ok(((r, self.nr), (l, self.nl)))
        if ok is None:
            b = r.astype(np.int64) * self.nl + l
        else:
            b = np.where(ok, r.astype(np.int64) * self.nl + np.where(ok, l, 0), 0)
        has = self.block_len[b] > 0
        if ok is not None:
            has &= ok
        return b if has.all() else np.where(has, b, -1)

    def lookup(self, r, l, e, t) -> np.ndarray:
        ok = self._ok(((r, self.nr), (l, self.nl), (e, self.ne), (t, self.nt)))
        key = self._key(r, l, e, t)
        if ok is not None:
            key = np.where(ok, key, 0)
        if self.dense is not None:
            pos = self.dense[key]
        else:
            i = np.searchsorted(self.keys, key)
            i = np.minimum(i, len(self.keys) - 1)
            pos = np.where(self.keys[i] == key, i, -1)
        return pos if ok is None else np.where(ok, pos, -1)


# ---------------------------------------------------------------- constants


# ---------------------------------------------------------------- classification


def classify(data: TraceData, idx: IndexData, lookup: KeyLookup) -> Verdicts:
    c = data.cols
    n = data.n
    block = lookup.block_of(c["shard"], c["lkey"])
    pos = lookup.lookup(c["shard"], c["lkey"], c["expert"], c["tensor"])
    verdict = np.full(n, UNKNOWN, dtype=np.int8)
    found = np.full(n, -1, dtype=np.int64)
    k = np.zeros(n, dtype=np.int32)
    has = pos >= 0
    all_have = bool(has.all())
    safe = pos if all_have else np.maximum(pos, 0)
    match = c["hi"] == idx.hi[safe]
    match &= c["lo"] == idx.lo[safe]
    if not all_have:
        match &= has
        verdict[~has] = UNEXPECTED
        verdict[block < 0] = OUT_OF_SCOPE
    verdict[match] = MATCH
    out = Verdicts(verdict=verdict, pos=pos, found=found, k=k)
    todo = np.flatnonzero(~match & has) if not all_have else np.flatnonzero(~match)
    if len(todo) == 0:
        return out
    todo = _constants(data, todo, out)
    todo = _content(data, idx, todo, out)
    _torn(data, idx, todo, out)
    return out


def _constants(data: TraceData, rows: np.ndarray, out: Verdicts) -> np.ndarray:
    c = data.cols
    dt = c["dtype"][rows]
    nb = c["nbytes"][rows]
    pairs = np.unique(np.stack([dt.astype(np.int64), nb.astype(np.int64)], axis=1), axis=0)
    c_hi, c_lo, c_dt, c_nb, c_desc = [], [], [], [], []
    for d, b in pairs.tolist():
        for desc, pat in constant_candidates(data.dtypes.names[d], int(b)):
            fp = constant_fingerprint(pat, int(b))
            h, l = digest_pair(fp.digest)
            c_hi.append(h), c_lo.append(l), c_dt.append(d), c_nb.append(b), c_desc.append(desc)
    q, t = fp_join(c["hi"][rows], c["lo"][rows], np.array(c_hi, np.int64), np.array(c_lo, np.int64))
    # a candidate must be of the row's own dtype and size to name its value
    ok = (np.array(c_dt, np.int64)[t] == dt[q]) & (np.array(c_nb, np.int64)[t] == nb[q])
    q, t = q[ok], t[ok]
    if len(q):
        sel = first_per_group(q, t)
        q, t = q[sel], t[sel]
        hit = rows[q]
        is_zero = np.array([c_desc[i] == "zeros" for i in t], dtype=bool)
        out.verdict[hit] = np.where(is_zero, ZEROS, CONSTANT)
        for r, i in zip(hit[~is_zero].tolist(), t[~is_zero].tolist()):
            out.value[r] = c_desc[i]
    resolved = np.zeros(len(rows), dtype=bool)
    resolved[q] = True
    return rows[~resolved]


def relation_score(q_rank, q_layer, q_expert, q_tensor, f_rank, f_layer, f_expert, f_tensor):
    """(verdict code, score): lower score = closer relation to the expected key."""
    same_r, same_l, same_t = q_rank == f_rank, q_layer == f_layer, q_tensor == f_tensor
    code = np.where(
        same_r & same_l & same_t, STALE,
        np.where(same_l & same_t, WRONG_RANK, np.where(same_t, WRONG_LAYER, WRONG_TENSOR)),
    ).astype(np.int8)
    dk = np.abs(f_expert.astype(np.int64) - q_expert)
    score = (
        code.astype(np.int64) * (1 << 48)
        + (~same_l) * (1 << 40)
        + (~same_r) * (1 << 39)
        + np.minimum(dk, (1 << 20) - 1) * (1 << 12)
        + np.minimum(np.abs(f_layer.astype(np.int64) - q_layer), 4095)
    )
    return code, score


def _content(data: TraceData, idx: IndexData, rows: np.ndarray, out: Verdicts) -> np.ndarray:
    c = data.cols
    q, t = fp_join(c["hi"][rows], c["lo"][rows], idx.hi, idx.lo)
    if len(q) == 0:
        return rows
    r = rows[q]
    code, score = relation_score(c["shard"][r], c["lkey"][r], c["expert"][r], c["tensor"][r],
                                 idx.rank[t], idx.lkey[t], idx.expert[t], idx.tensor[t])
    sel = first_per_group(q, score)
    hit = rows[q[sel]]
    out.verdict[hit] = code[sel]
    out.found[hit] = t[sel]
    out.k[hit] = (idx.expert[t[sel]] - c["expert"][hit]).astype(np.int32)
    resolved = np.zeros(len(rows), dtype=bool)
    resolved[q[sel]] = True
    return rows[~resolved]


def _explode(blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """[row blob of 16-byte chunk digests] -> (owner, position, hi, lo) per chunk."""
    sizes = np.array([len(b) // 16 for b in blobs], dtype=np.int64)
    if sizes.sum() == 0:
        z = np.zeros(0, np.int64)
        return z, z, z, z
    words = np.frombuffer(b"".join(b[: 16 * (len(b) // 16)] for b in blobs), dtype="<i8").reshape(-1, 2)
    owner = np.repeat(np.arange(len(blobs)), sizes)
    pos = np.arange(len(owner)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return owner, pos, words[:, 0].copy(), words[:, 1].copy()


def _torn(data: TraceData, idx: IndexData, rows: np.ndarray, out: Verdicts) -> None:
    """Chunk-level localization of rows that equal nothing whole."""
    if len(rows) == 0:
        return
    c = data.cols
    blobs = read_chunk_digests(data, rows)
    have = np.array([b is not None and len(b) >= 16 for b in blobs], dtype=bool)
    out.no_chunks.update(rows[~have].tolist())
    rows = rows[have]
    blobs = [b for b, h in zip(blobs, have) if h]
    if len(rows) == 0:
        return
    q_owner, q_pos, q_hi, q_lo = _explode(blobs)
    n_chunks = np.bincount(q_owner, minlength=len(rows))
    # candidate sources: index entries of the same byte size (so chunk positions line
    # up) in the same layer: every expert, rank and tensor kind of it
    sizes = np.unique(c["nbytes"][rows])
    cand = np.flatnonzero(np.isin(idx.nbytes, sizes) & np.isin(idx.lkey, np.unique(c["lkey"][rows])))
    s_owner = s_pos = s_hi = s_lo = np.zeros(0, np.int64)
    if idx.chunk_digests is not None and len(cand):
        cf = idx.chunk_digests_of(cand)
        blobs_idx = cf.to_pylist()
        valid = np.array([b is not None for b in blobs_idx], dtype=bool)
        cand = cand[valid]
        s_owner, s_pos, s_hi, s_lo = _explode([b for b in blobs_idx if b is not None])
        s_owner = cand[s_owner]
    # zero chunks as a pseudo source (-2): full chunk and each row's own tail length
    zero_keys = {}
    for nb in sizes.tolist():
        zfp = constant_fingerprint(b"\0", int(nb))
        for i in range(zfp.n_chunks):
            zero_keys.setdefault((i == zfp.n_chunks - 1, int(nb)), digest_pair(zfp.chunk(i)))
    # join on (chunk fp) then keep equal positions
    qq, ss = fp_join(q_hi, q_lo, s_hi, s_lo)
    ok = q_pos[qq] == s_pos[ss]
    qq, ss = qq[ok], ss[ok]
    chunk_src = np.full(len(q_owner), -1, dtype=np.int64)  # index entry per trace chunk, -1 none, -2 zeros
    if len(qq):
        r = rows[q_owner[qq]]
        f = s_owner[ss]
        expected = out.pos[r] == f
        code, score = relation_score(c["shard"][r], c["lkey"][r], c["expert"][r], c["tensor"][r],
                                     idx.rank[f], idx.lkey[f], idx.expert[f], idx.tensor[f])
        score = np.where(expected, -1, score)
        sel = first_per_group(qq, score)
        chunk_src[qq[sel]] = f[sel]
    # zero chunks where nothing else matched
    un = np.flatnonzero(chunk_src == -1)
    if len(un):
        nb_of = c["nbytes"][rows][q_owner[un]]
        last = q_pos[un] == n_chunks[q_owner[un]] - 1
        for j, nb, is_last in zip(un.tolist(), nb_of.tolist(), last.tolist()):
            key = zero_keys.get((is_last, int(nb))) or zero_keys.get((False, int(nb)))
            if key is not None and (int(q_hi[j]), int(q_lo[j])) == key:
                chunk_src[j] = -2
    starts = np.r_[0, np.cumsum(n_chunks)[:-1]]
    for i, row in enumerate(rows.tolist()):
        s, n = int(starts[i]), int(n_chunks[i])
        src = chunk_src[s : s + n]
        if (src == -1).all():
            full = n - (1 if c["nbytes"][row] % CHUNK_BYTES else 0)
            h, l = q_hi[s : s + full], q_lo[s : s + full]
            if full >= 2 and (h == h[0]).all() and (l == l[0]).all():
                out.verdict[row] = CONSTANT
                out.value[row] = "a constant fill of an unidentified value (all 64 KiB chunks equal)"
            continue  # stays unknown
        ranges = []
        b = 0
        for j in range(1, n + 1):
            if j == n or src[j] != src[b]:
                ranges.append(_range_doc(idx, data, row, int(src[b]), b, j - 1, out))
                b = j
        distinct = {int(x) for x in src}
        if len(distinct) == 1:
            # one source for every chunk yet no whole-tensor match: size or tail differ
            out.verdict[row] = UNKNOWN
            continue
        out.verdict[row] = TORN
        out.torn[row] = ranges


def _range_doc(idx: IndexData, data: TraceData, row: int, src: int, a: int, b: int, out: Verdicts) -> dict:
    c = data.cols
    doc = {"first_chunk": a, "last_chunk": b}
    if src == -1:
        doc.update(source="unknown")
    elif src == -2:
        doc.update(source="zeros")
    else:
        doc.update(
            source="expected" if src == out.pos[row] else "index",
            tp_rank=int(idx.rank[src]), layer=int(idx.layer[src]), model=data.models.names[int(idx.model[src])],
            expert=int(idx.expert[src]),
            tensor=data.tensors.names[int(idx.tensor[src])], k=int(idx.expert[src] - c["expert"][row]),
        )
    return doc
