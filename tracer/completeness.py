"""The completeness rule: whether a trace is whole, one phrase per reason it is not.

``rank_problems`` judges one rank's manifest, ``run_problems`` a run's manifests (and
the launch: its server, its refused processes); ``run_file_problems`` what a run's
``_run.json`` says. The launcher (servers.launcher) and the analysis (analysis.report)
both apply it; the analysis also holds each rank's rows against its manifest
(analysis.row_check).
"""

from __future__ import annotations

from moetrace.schema import label_key, rank_label
from moetrace.tracer.claim import refusal_problem


def count_of(m: dict, key: str) -> int:
    """A manifest's counter (a list counts its entries; absent or null: 0)."""
    v = m.get(key) or 0
    return len(v) if isinstance(v, list) else int(v)


def rank_problems(m: dict) -> list[str]:
    """Why one rank's manifest does not describe a whole trace, one phrase each
    ("did not finish its trace ..."); empty when it does. A rank that wrote 0 rows
    is a problem even when its sampling legitimately kept nothing: an audit of it
    would check nothing."""
    problems = []
    if m.get("disabled"):
        problems.append(f"disabled tracing ({m.get('disabled_reason') or 'no reason recorded'})")
    elif not m.get("finished"):
        problems.append("did not finish its trace (finished: false)")
    dropped = count_of(m, "rows_dropped")
    if dropped:
        drops = m.get("drops") or {}
        why = ", ".join(f"{k}: {v:,}" for k, v in sorted(drops.items()) if v) or "reason not recorded"
        problems.append(f"dropped {dropped:,} rows ({why})")
    for key, word in (("hook_errors", "hook"), ("sink_errors", "sink")):
        n = count_of(m, key)
        if n:
            problems.append(f"had {n:,} {word} errors")
    problems += identity_problems(m)
    guard = m.get("guard") if isinstance(m.get("guard"), dict) else None
    problems += guard_problems(guard)
    if not count_of(m, "rows_written") and not (guard and guard.get("rows") == "mismatch" and _guard_checked(guard)):
        problems.append("wrote 0 rows (nothing captured: check the sampling filters and that traffic reached the "
                        "server)")
    listed = sum(int(p.get("rows") or 0) for p in m.get("parts") or [] if isinstance(p, dict))
    if "parts" in m and listed != count_of(m, "rows_written"):
        problems.append(f"lists parts of {listed:,} rows but says it wrote {count_of(m, 'rows_written'):,}")
    return problems


def identity_problems(m: dict) -> list[str]:
    """A manifest's identity fields must agree: its rank label names its tp_rank, pp_rank and
    replica, and the MoE coordinates its first module reported follow from tp_rank as SGLang
    derives them (parallel_state: TP ranks are moe_dp_idx * ep * moe_tp + ep_idx * moe_tp +
    moe_tp_idx; checkpoints.shards.rank_coords). A folder copied from another rank and
    relabelled, or a module reporting another rank's shard, fails here."""
    problems = []
    if isinstance(m.get("rank_label"), str) and isinstance(m.get("tp_rank"), int):
        want = rank_label(m["tp_rank"], m.get("pp_rank") or 0, m.get("pp_size") or 1, m.get("replica"))
        if want != m["rank_label"]:
            problems.append(f"manifest says rank_label {m['rank_label']} but tp_rank {m['tp_rank']}, "
                            f"pp_rank {m.get('pp_rank') or 0}, replica {m.get('replica')} (rank {want})")
    tp, moe_tp, ep = m.get("tp_rank"), m.get("moe_tp_size"), m.get("ep_size") or 1
    if isinstance(tp, int) and isinstance(moe_tp, int) and moe_tp > 0:
        for key, want in (("moe_tp_rank", tp % moe_tp), ("ep_rank", (tp // moe_tp) % ep)):
            got = m.get(key)
            if got is not None and got != want:
                problems.append(f"manifest says {key} {got}, but tp_rank {tp} of moe_tp_size {moe_tp}, ep_size {ep} "
                                f"holds {key} {want} (another rank's shard)")
    return problems


def _guard_checked(guard: dict) -> int:
    t = guard.get("tensors") or {}
    return int(t.get("match") or 0) + int(t.get("mismatch") or 0)


def guard_problems(guard: dict | None) -> list[str]:
    """A guard that could not verify, or verified nothing, does not vouch for the run
    (its trace holds rows for mismatches only, so 0 rows there is not a problem by itself)."""
    if not guard:
        return []
    if guard.get("status") == "unverified":
        return [f"guard could not verify ({guard.get('status_reason') or 'no reason recorded'})"]
    if not _guard_checked(guard):
        return ["guard verified nothing (no staged load or resident weights reached it)"]
    if guard.get("rows") != "mismatch":
        return []
    # Rows of mismatches only: what the guard verified is the coverage; nothing else checks the rest.
    problems = []
    unverified = int((guard.get("tensors") or {}).get("unverified") or 0)
    if unverified:
        problems.append(f"guard left {unverified:,} tensors unverified (its trace holds rows of mismatches only, "
                        "so nothing checked them)")
    for source, share in sorted((guard.get("coverage") or {}).items()):
        if isinstance(share, (int, float)) and share < 1:
            problems.append(f"guard verified {share:.1%} of the expected {source} tensors in its last pass "
                            "(its trace holds rows of mismatches only)")
    return problems


def guard_vouches(m: dict) -> bool:
    """A rank whose guard kept rows of mismatches only: its matching tensors are the
    guard's verdicts (counted in the manifest), not rows."""
    guard = m.get("guard")
    return isinstance(guard, dict) and guard.get("rows") == "mismatch"



def run_file_problems(run: dict | None) -> list[str]:
    """What a run's ``_run.json`` itself says is wrong (none when there is no _run.json):
    a launcher that never finished (killed, or still running), or one that found the
    run incomplete."""
    if run is None:
        return []
    if not run.get("finished"):
        return ["_run.json says the launcher did not finish (finished: false: it was killed, or is still running)"]
    problems = []
    server = server_problem(run.get("server_exit_code"), bool(run.get("stop_reason")))
    if server:
        problems.append(f"{server} (_run.json)")
    if run.get("complete") is not True:
        why = "; ".join(str(p) for p in run.get("problems") or []) or "no reason recorded"
        problems.append(f"_run.json says the run is incomplete ({why})")
    return problems


def foreign_ranks(manifests: dict[str, dict], nonce: str | None) -> list[str]:
    """Rank labels whose manifest belongs to another launch than `nonce` (a reused run id)."""
    return sorted((r for r, m in manifests.items() if m.get("run_nonce") != nonce), key=label_key)


def server_problem(exit_code: int | None, stop_requested: bool) -> str | None:
    """A server that exited non-zero when nobody asked it to stop crashed or never
    started: its trace is not the run that was asked for."""
    if exit_code is None or exit_code == 0 or stop_requested:
        return None
    how = f"signal {-exit_code}" if exit_code < 0 else f"code {exit_code}"
    return f"the server exited on its own with {how} (start-up failure or crash; see its log)"


def run_problems(manifests: dict[str, dict], expected_ranks: int | None, *, server_started: bool = True,
                 server_exit_code: int | None = None, stop_requested: bool = False,
                 nonce: str | None = None, refusals: list[dict] = ()) -> list[str]:
    """Why a run is not a whole trace, one sentence per reason (empty: whole).
    ``manifests``: {rank label: manifest} (read_manifests). ``expected_ranks``: the TP
    rank count the server was started with (None: the tp_size the manifests agree on);
    every pipeline stage and replica the manifests name must have all of them.
    ``nonce``: the launch's run_nonce, which every manifest must carry (one from an
    earlier launch under the same run id is not this run's). ``refusals``: tracer.claim
    records of processes refused a folder."""
    problems: list[str] = []
    if not server_started:
        problems.append("the server did not start")
    foreign = foreign_ranks(manifests, nonce) if nonce is not None else []
    if foreign:
        problems.append(f"manifests of rank {id_list(foreign)} are from another launch (a different run_nonce: "
                        "a reused run id)")
        manifests = {r: m for r, m in manifests.items() if r not in foreign}
    server = server_problem(server_exit_code, stop_requested)
    if server:
        problems.append(server)
    problems += [refusal_problem(r) for r in refusals]
    if not manifests:
        problems.append("no rank wrote a manifest (the hooks never started: check the server log for 'moetrace')")
        return problems
    want = expected_labels(manifests, expected_ranks)
    if want is not None:
        missing = [r for r in want if r not in manifests]
        extra = [r for r in manifests if r not in want]
        if missing:
            problems.append(f"{len(want) - len(missing)}/{len(want)} ranks reported (no manifest from rank "
                            f"{id_list(missing)})")
        if extra:
            problems.append(f"manifests from unexpected rank {id_list(extra)} (expected ranks {id_list(want)})")
    for r, m in manifests.items():
        problems += [f"rank {r} {p}" for p in rank_problems(m)]
    return problems



def id_list(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


# ---------------------------------------------------------------- the ranks a run must have


def common_value(manifests: dict[str, dict], key: str):
    """The value of `key` every manifest that has it agrees on, else None."""
    vals = {m.get(key) for m in manifests.values()} - {None}
    return next(iter(vals)) if len(vals) == 1 else None


def expected_rank_count(manifests: dict[str, dict], expected_ranks: int | None) -> int | None:
    """The TP rank count to expect: the server command's --tp, else the tp_size the
    manifests agree on, else unknown."""
    if expected_ranks is not None:
        return expected_ranks
    tp = common_value(manifests, "tp_size")
    return tp if isinstance(tp, int) and tp > 0 else None


def expected_labels(manifests: dict[str, dict], expected_ranks: int | None) -> list[str] | None:
    """Every rank label the run must have: each TP rank of each pipeline stage of each
    replica the manifests name (None when the TP size is unknown)."""
    n = expected_rank_count(manifests, expected_ranks)
    if n is None:
        return None
    pp = common_value(manifests, "pp_size")
    pp = pp if isinstance(pp, int) and pp > 0 else 1
    replicas = sorted({m.get("replica") for m in manifests.values()}, key=lambda r: -1 if r is None else r) or [None]
    return [rank_label(t, p, pp, r) for r in replicas for p in range(pp) for t in range(n)]
