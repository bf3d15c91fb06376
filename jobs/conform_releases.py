"""`moetrace conform --releases SPEC`: every sglang-kt release in SPEC, from the package
index with its kt-kernel (conform.releases), each format as installed and with
--patch-fence, in one set of rank processes per release; one table and one JSON
document. A release that cannot be installed, or a case that cannot run, is a row
that says why. Exit 1: some row holds wrong bytes; else 2: some row could not run;
else 0. docs/conform.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Sequence

from moetrace.errors import ExitCode
from moetrace.jobs.conform import CONFORM_JSON, result_doc, run_conform, write_doc
from moetrace.jobs.conform_plan import FORMATS, Case

RELEASES_SCHEMA, RELEASES_SCHEMA_VERSION = "moetrace.conform.releases", 1


def row_of(version: str, kt: str | None, doc: dict, seconds: float) -> dict:
    """One table row from a result document (the analysis itself left out: the table's
    JSON holds every row's provenance, verdict and what each rank held)."""
    code = ExitCode(doc["exit_code"])
    # a release's case that could not run was refused (the fork, or its format)
    verdict = {"error": "ERROR", "absent": "NO PATH"}.get(doc["status"]) or (
        "REFUSED" if code == ExitCode.INCOMPLETE else code.label)
    return {"release": version, "kt_kernel": kt, "format": doc["case"]["fmt"],
            "fence": "--patch-fence" if doc["case"]["patch_fence"] else "as installed", "verdict": verdict,
            "exit_code": int(code), "e_plus_k": doc["e_plus_k"], "seconds": round(seconds, 1), "why": doc["error"],
            "writer_kind": doc["writer_kind"] or None,
            "result": {k: v for k, v in doc.items() if k != "analysis"}}


def table(rows: list[dict]) -> list[str]:
    head = ("release", "kt-kernel", "format", "fence", "verdict", "E+k", "seconds")
    body = [(r["release"], r["kt_kernel"] or "-", r["format"], r["fence"], r["verdict"],
             ",".join(f"E+{k}" for k in r["e_plus_k"]) or "-", f"{r['seconds']:.1f}") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (head, *body)]
    why = sorted({f"{r['release']} {r['format']}: {r['why']}" for r in rows if r["why"]})
    return lines + ([""] + [f"why {w}" for w in why] if why else [])


def run_release(version: str, rel, formats: Sequence[str], tp: int, experts: int, schedule: str,
                writer: str) -> list[dict]:
    if rel.path is None:
        return [{"release": version, "kt_kernel": rel.kt_kernel, "format": "-", "fence": "-",
                 "verdict": "NOT INSTALLED", "exit_code": int(ExitCode.INCOMPLETE), "e_plus_k": [], "seconds": 0.0,
                 "why": rel.why, "writer_kind": None, "result": None}]
    cases = [Case(f, schedule, fenced, writer, experts, str(rel.path)) for f in formats for fenced in (False, True)]
    t0 = time.perf_counter()
    results = run_conform(cases, tp=tp)
    each = (time.perf_counter() - t0) / max(1, sum(1 for r in results if not r.error))
    rows = [row_of(version, rel.kt_kernel, result_doc(r), 0.0 if r.error else each) for r in results]
    if rel.note:
        for r in rows:
            r["kt_kernel_note"] = rel.note
    return rows


def releases_main(spec: str, formats: Sequence[str] | None, tp: int, experts: int, schedule: str, writer: str,
                  cache: str | None, json_out: str | None, echo: Callable[[str], None] = print) -> int:
    from moetrace import __version__
    from moetrace.conform import releases
    from moetrace.outputs import probe_output

    if json_out:
        probe_output(json_out, "--json-out", CONFORM_JSON)
    formats = tuple(formats or FORMATS)
    available = releases.index_versions(releases.FORK)
    kernels = releases.index_versions(releases.KERNEL)
    versions = releases.select(spec, available)
    folder = Path(cache) if cache else releases.default_cache()
    echo(f"{len(versions)} sglang-kt release(s) {versions[0]} .. {versions[-1]}; formats {', '.join(formats)}; "
         f"cache {folder}")
    rows = []
    for v in versions:
        t0 = time.perf_counter()
        got = run_release(v, releases.install(v, folder, kernels), formats, tp, experts, schedule, writer)
        ran = sum(1 for r in got if r["verdict"] in ("PASS", "DIVERGENT"))
        echo(f"  {v}: {ran} of {len(got)} cases ran ({time.perf_counter() - t0:.0f} s)")
        rows += got
    for line in table(rows):
        echo(line)
    codes = {r["exit_code"] for r in rows}
    code = next((c for c in (ExitCode.DIVERGENT, ExitCode.INCOMPLETE) if c in codes), ExitCode.PASS)
    doc = {"schema": RELEASES_SCHEMA, "version": RELEASES_SCHEMA_VERSION, "moetrace_version": __version__,
           "spec": spec, "formats": list(formats), "tp": tp, "experts": experts, "schedule": schedule,
           "cache": str(folder), "exit_code": int(code), "rows": rows}
    return write_doc(json_out, json.loads(json.dumps(doc)), code, echo)
