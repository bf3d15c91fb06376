"""Trace ⋈ index: verdicts per row, the loads they form, and what each load covered.

``Analysis(data, idx, index_path)`` holds every intermediate result (verdicts,
loads, expected/captured/missing per load, loads absent on some ranks); the
report, renderers, plot and diff read from it.

Coverage is per physical slot: a load is expected to hold every slot the server
reported (``slot_count``) times every tensor kind of its format, and every one of
them must have an index entry. Which expert a slot holds is the server's own map
(redundant EPLB copies, KT's tables, fused shared experts), so the index keeps every
expert of every layer per shard and a slot's row finds its entry by its logical
expert. Loads are compared across the ranks of one pipeline stage of one replica.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moetrace.analysis.expected import IndexData
from moetrace.analysis.trace import TraceData
from moetrace.analysis.verdicts import MATCH, OUT_OF_SCOPE, KeyLookup, Verdicts, classify
from moetrace.schema import SOURCES, parse_rank_label
from moetrace.tracer.completeness import guard_vouches


class Analysis:
    """All intermediate results of one analysis; build once, render many ways."""

    def __init__(self, data: TraceData, idx: IndexData, index_path: str):
        self.data, self.idx, self.index_path = data, idx, index_path
        c = data.cols
        # The layer key folds the model into the layer: the draft's layer 0 is not the target's.
        top = max(int(idx.layer.max()), int(c["layer"].max()) if data.n else 0) + 1
        self.layer_stride = top
        idx.lkey = idx.model * top + idx.layer
        c["lkey"] = c["model"].astype(np.int64) * top + c["layer"]
        self.lookup = KeyLookup(idx, len(data.tensors))
        self.verdicts: Verdicts = classify(data, idx, self.lookup)
        self._unreproduced()
        self._loads()
        self._coverage()

    # -- what the index cannot check -------------------------------------------

    def _unreproduced(self) -> None:
        """Rows the index has no way to check, by reason (the report says why, and the
        trace cannot pass): a draft model the checkpoint side left out, a fused shared
        expert the checkpoint's shared expert cannot stand for. Never divergences."""
        c, v, idx = self.data.cols, self.verdicts, self.idx
        self.unreproduced: dict[str, int] = {}
        draft = self.data.models.code("draft")
        is_draft = c["model"] == draft
        if is_draft.any() and not (idx.model == draft).any():
            n = int(is_draft.sum())
            v.verdict[is_draft] = OUT_OF_SCOPE
            why = (idx.draft or {}).get("excluded") or "the index has no draft rows"
            self.unreproduced[f"draft model not checked ({why})"] = n
        # SGLang fuses one shared expert (DeepSeek V3 needs n_shared_experts == 1; Qwen has one): id num_experts
        n_shared = max(1, idx.shared_experts)
        shared = ((c["expert"] >= idx.num_experts) & (c["expert"] < idx.num_experts + n_shared) & (v.pos < 0)
                  & (v.verdict != OUT_OF_SCOPE) & ~is_draft)
        if idx.num_experts and shared.any():
            v.verdict[shared] = OUT_OF_SCOPE
            self.unreproduced["fused shared-expert slots not checked (the checkpoint's shared expert is not shaped "
                              "like a routed expert, so the index has no entry for it)"] = int(shared.sum())

    # -- loads ---------------------------------------------------------------

    def _loads(self) -> None:
        c, v = self.data.cols, self.verdicts
        n = self.data.n
        scope = v.verdict != OUT_OF_SCOPE
        self.scope = scope
        cols = ["run", "step", "layer", "lkey", "model", "rank", "source", "capture_seq", "slot_count"]
        if n == 0 or not scope.any():
            self.load = np.full(n, -1, dtype=np.int64)
            self.load_first = np.zeros(0, np.int64)
            self.loads = pd.DataFrame(columns=cols + ["rows"])
            return
        df = pd.DataFrame({k: c[k] for k in ("run", "step", "lkey", "rank", "source")})
        df["seq"] = np.where(c["source"] == 0, c["capture_seq"], -1)  # every staged load is its own
        codes = df.groupby(list(df.columns), sort=False).ngroup().to_numpy()
        codes = np.where(scope, codes, -1)
        uniq, codes = np.unique(codes, return_inverse=True)
        codes = codes.astype(np.int64)
        if len(uniq) and uniq[0] == -1:  # drop the out-of-scope pseudo load
            codes -= 1
        nl = int(codes.max()) + 1 if len(codes) else 0
        first = np.full(nl, -1, dtype=np.int64)
        ok = codes >= 0
        first[codes[ok][::-1]] = np.flatnonzero(ok)[::-1]
        self.load = codes
        self.load_first = first  # a row of each load
        self.loads = pd.DataFrame({
            "run": c["run"][first].astype(np.int64), "step": c["step"][first].astype(np.int64),
            "layer": c["layer"][first].astype(np.int64), "lkey": c["lkey"][first].astype(np.int64),
            "model": c["model"][first].astype(np.int64), "rank": c["rank"][first].astype(np.int64),
            "source": c["source"][first].astype(np.int64),
            "capture_seq": np.where(c["source"][first] == 0, c["capture_seq"][first], -1).astype(np.int64),
            "slot_count": c["slot_count"][first].astype(np.int64),
        })
        self.loads["rows"] = np.bincount(codes[ok], minlength=nl)

    # -- coverage ------------------------------------------------------------

    def kinds_of(self, shard: int, lkey: int, tensors: set[str] | None = None) -> np.ndarray:
        """Tensor codes the index has for a (shard, layer key) block, within `tensors`."""
        lk = self.lookup
        b = int(lk.block_of(np.array([shard]), np.array([lkey]))[0])
        if b < 0:
            return np.zeros(0, np.int64)
        s, n = int(lk.block_start[b]), int(lk.block_len[b])
        kinds = np.unique(self.idx.tensor[s:s + n])
        if tensors is not None:
            kinds = kinds[np.isin(kinds, [self.data.tensors.code(t) for t in tensors])]
        return kinds

    def _coverage(self) -> None:
        c, v, L = self.data.cols, self.verdicts, self.loads
        nl = len(L)
        for k in ("expected", "captured", "missing", "duplicates"):
            L[k] = 0
        # load -> (slot, expert, tensor code); -1 unknown
        self.missing_entries: dict[int, list[tuple[int, int, int]]] = {}
        self.captured_entries: dict[tuple, np.ndarray] = {}  # (run, rank, lkey) -> index positions seen
        self.slot_sampled = False
        if nl == 0:
            self.missing_loads = self._missing_loads()
            return
        rows = np.flatnonzero((self.load >= 0) & (v.pos >= 0))
        df = pd.DataFrame({"load": self.load[rows], "slot": c["slot"][rows], "tensor": c["tensor"][rows],
                           "expert": c["expert"][rows], "pos": v.pos[rows]})
        distinct = df.drop_duplicates(["load", "slot", "tensor"])
        captured = np.bincount(distinct["load"], minlength=nl)
        with_pos = np.bincount(df["load"], minlength=nl)
        # tensor kinds per load: those of its index block (its format), cut by tensor sampling
        shard = c["shard"][self.load_first].astype(np.int64)
        lkey = L["lkey"].to_numpy()
        blocks = self.lookup.block_of(shard, lkey)
        per_block = np.zeros(len(self.lookup.block_len), np.int64)
        for b in np.unique(blocks[blocks >= 0]).tolist():
            per_block[b] = len(self.kinds_of(int(shard[blocks == b][0]), int(lkey[blocks == b][0])))
        n_kinds = np.where(blocks >= 0, per_block[np.maximum(blocks, 0)], 0)
        expected = L["slot_count"].to_numpy() * n_kinds
        for run in self.data.runs:
            rc = self.data.run_ids.code(run.run_id)
            for label, rk in run.ranks.items():
                _, experts, tensors = rk.sampling()
                mine = (L["run"].to_numpy() == rc) & (L["rank"].to_numpy() == self.data.label_code(label))
                if guard_vouches(rk.manifest):  # rows of mismatches only: the guard's coverage is the rank's
                    expected = np.where(mine, captured, expected)
                    continue
                if tensors is not None:
                    for li in np.flatnonzero(mine).tolist():
                        kinds = self.kinds_of(int(shard[li]), int(lkey[li]), tensors)
                        expected[li] = int(L["slot_count"].iat[li]) * len(kinds)
                if experts is not None and not self._all_experts(experts):
                    # slots of unsampled experts were never written: not missing
                    expected = np.where(mine, self._sampled_slots(mine, experts, expected, captured), expected)
        L["expected"], L["captured"] = expected, captured
        L["missing"] = np.maximum(expected - captured, 0)
        L["duplicates"] = with_pos - captured
        for li in np.flatnonzero(L["missing"].to_numpy() > 0).tolist():
            kinds = self.kinds_of(int(shard[li]), int(lkey[li]), self._sampled_tensors(li))
            self.missing_entries[li] = self._missing_of(li, distinct[distinct["load"] == li], kinds)
        keyed = df.assign(run=L["run"].to_numpy()[df["load"]], rank=L["rank"].to_numpy()[df["load"]],
                          lkey=lkey[df["load"]])
        for (run, rank, lk), grp in keyed.groupby(["run", "rank", "lkey"]):
            self.captured_entries[(int(run), int(rank), int(lk))] = np.unique(grp["pos"].to_numpy())
        self.missing_loads = self._missing_loads()

    def _all_experts(self, experts: set[int]) -> bool:
        """An expert sampling that names every expert the index has samples nothing out."""
        ids = np.unique(self.idx.expert)
        return bool(np.isin(ids, np.array(sorted(experts), dtype=np.int64)).all())

    def _sampled_slots(self, mine: np.ndarray, experts: set[int], expected: np.ndarray,
                       captured: np.ndarray) -> np.ndarray:
        """Expected entries of a rank's loads under expert sampling. A staged load holds
        expert e in slot e (KT's full layer), so it expects the sampled experts below its
        slot count; a resident load's slot map is the server's, so it expects as many as
        the fullest load of its (layer, source) captured (a slot dropped from every load is
        then not seen: a warning says so)."""
        L = self.loads
        out = expected.copy()
        staged = mine & (L["source"].to_numpy() == SOURCES.index("staged"))
        ids = np.array(sorted(experts), dtype=np.int64)
        for li in np.flatnonzero(staged).tolist():
            kinds = expected[li] // max(int(L["slot_count"].iat[li]), 1)
            out[li] = int((ids < int(L["slot_count"].iat[li])).sum()) * kinds
        resident = mine & ~staged
        if resident.any():
            self.slot_sampled = True
            key = L.loc[resident, ["lkey", "source"]].astype(str).agg(":".join, axis=1)
            most = pd.Series(captured[resident]).groupby(key.to_numpy()).transform("max").to_numpy()
            out[resident] = most
        return out

    def _sampled_tensors(self, li: int) -> set[str] | None:
        """The tensor sampling of the rank that captured load li (None: all)."""
        code = int(self.loads["run"].iat[li])
        run = next(r for r in self.data.runs if self.data.run_ids.code(r.run_id) == code)
        rk = run.ranks.get(self.data.labels[int(self.loads["rank"].iat[li])])
        return rk.sampling()[2] if rk is not None else None

    def _missing_of(self, li: int, seen: pd.DataFrame, kinds: np.ndarray) -> list[tuple]:
        """(slot, expert, tensor) entries a load lacks: tensor kinds missing from slots it
        has, then one (-1, -1, kind) per kind for each slot it has no row of at all."""
        row = self.loads.iloc[li]
        out = []
        for slot, grp in seen.groupby("slot"):
            expert = int(grp["expert"].iloc[0])
            out += [(int(slot), expert, int(t)) for t in np.setdiff1d(kinds, grp["tensor"].to_numpy())]
        absent = int(row["expected"]) // max(len(kinds), 1) - seen["slot"].nunique()
        out += [(-1, -1, int(t)) for _ in range(max(absent, 0)) for t in kinds]
        return out

    def _missing_loads(self) -> pd.DataFrame:
        """Loads some rank of a pipeline stage of a replica captured and another rank of
        that stage did not (PP stages own different layers: never compared)."""
        L = self.loads
        out = []
        for run in self.data.runs:
            rc = self.data.run_ids.code(run.run_id)
            Lr = L[L["run"] == rc] if len(L) else L
            groups: dict[tuple, list[str]] = {}
            for label in run.expected_ranks:
                if label in run.ranks and guard_vouches(run.ranks[label].manifest):
                    continue  # rows of mismatches only: another rank's loads are not its to hold
                replica, pp, _ = parse_rank_label(label)
                groups.setdefault((replica, pp), []).append(label)
            for labels in groups.values():
                codes = [self.data.label_code(lb) for lb in labels if lb in self.data.labels]
                Lg = Lr[Lr["rank"].isin(codes)] if len(Lr) else Lr
                if not len(Lg):
                    continue
                want = Lg.groupby(["step", "lkey", "source"])["expected"].max()
                for code in codes:
                    have = set(zip(*(Lg.loc[Lg["rank"] == code, k] for k in ("step", "lkey", "source"))))
                    for key in sorted(set(want.index) - have):
                        step, lkey, source = key
                        out.append((rc, int(step), int(lkey) % self.layer_stride, int(lkey), code, int(source),
                                    int(want[key])))
        return pd.DataFrame(out, columns=["run", "step", "layer", "lkey", "rank", "source", "expected"])

    # -- helpers -------------------------------------------------------------

    def divergent_rows(self) -> np.ndarray:
        vv = self.verdicts.verdict
        return np.flatnonzero((vv != MATCH) & (vv != OUT_OF_SCOPE))

    def order_rows(self, rows: np.ndarray) -> np.ndarray:
        """rows sorted in first-divergence order."""
        c = self.data.cols
        o = np.lexsort((c["slot"][rows], c["rank"][rows], c["copy_position"][rows], c["transport_position"][rows],
                        c["source"][rows], c["lkey"][rows], c["step"][rows], c["run"][rows]))
        return rows[o]
