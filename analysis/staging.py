"""A server that stages must have staged: the trace reached the path under test.

A KT server (the fork's KTEPWrapperMethod, `moetrace serve`) moves a layer's experts
through the host slots only in a prefill pass of at least its threshold of tokens. A
trace of such a server that holds no staged load checked the resident weights alone,
whatever its verdicts: incomplete (exit 2), saying why (the prompts, or prefill passes
shorter than the threshold). What the server was configured to do is read from the rank
manifests (`staging`, read in the server), else from `_run.json` (the launch command's
flags); the prompts sent from `_run.json`'s `traffic`. A hook config whose sampling
leaves out staged captures asked for none.
"""

from __future__ import annotations

from moetrace.tracer.sampling import Sampling


def _configured(run) -> tuple[dict | None, str]:
    """(staging facts, who says so) of a run, the server's own first."""
    for label, rk in sorted(run.ranks.items()):
        staging = rk.manifest.get("staging")
        if isinstance(staging, dict) and isinstance(staging.get("threshold"), int):
            return staging, f"rank {label}'s {staging.get('found_by') or 'KT wrapper'}"
    staging = (run.run_json or {}).get("staging")
    if isinstance(staging, dict) and isinstance(staging.get("threshold"), int):
        return staging, f"the launch command ({staging.get('found_by') or 'its flags'})"
    return None, ""


def _staged_elsewhere(run) -> bool:
    """A staged load the rows do not show: a guard that kept rows of mismatches only counts them."""
    for rk in run.ranks.values():
        guard = rk.manifest.get("guard")
        by_source = guard.get("by_source") if isinstance(guard, dict) else None
        if isinstance(by_source, dict) and any(int(n or 0) for n in (by_source.get("staged") or {}).values()):
            return True
    return False


def _sampled_out(run) -> bool:
    for rk in run.ranks.values():
        try:
            if "staged" not in Sampling.from_config(rk.manifest.get("config") or {}).sources:
                return True
        except Exception:  # a config the tracer refuses: the completeness rule says so
            continue
    return False


def staging_problem(run, held_sources: set[str]) -> str | None:
    """The sentence saying the run's server stages but its trace holds no staged load, or
    None. held_sources: the sources of every row the run's ranks hold."""
    staging, said_by = _configured(run)
    if staging is None or staging["threshold"] <= 0 or "staged" in held_sources:
        return None
    if _staged_elsewhere(run) or _sampled_out(run):
        return None
    threshold, chunk = int(staging["threshold"]), staging.get("chunked_prefill_size")
    traffic = (run.run_json or {}).get("traffic") if isinstance((run.run_json or {}).get("traffic"), dict) else {}
    words = traffic.get("prompt_tokens") if isinstance(traffic.get("prompt_tokens"), int) else None
    skipped = [n for rk in run.ranks.values() for n in (rk.manifest.get("notes") or [])
               if isinstance(n, str) and ("staged contexts are not captured" in n or "staged capture skipped" in n)]
    if skipped:
        why = f"the server's staged layers were not captured ({skipped[0]})"
    elif isinstance(chunk, int) and 0 < chunk < threshold:
        why = f"its prefill passes hold at most {chunk} tokens (chunked_prefill_size {chunk}), fewer than the threshold"
    elif words is not None and words < threshold:
        why = f"the prompts sent were ~{words} words (--prompt-tokens {words}), fewer than the threshold"
    else:
        why = "no prefill pass of the traffic reached the threshold"
    return (f"run {run.run_id}: the server stages a layer only in a prefill pass of at least {threshold} tokens "
            f"(staging threshold {threshold}, read from {said_by}) but the trace holds no staged load: {why}; only "
            f"resident weights were checked (send prompts of at least {threshold} tokens; audit --launch sizes them "
            "from the threshold when --prompt-tokens is not given)")
