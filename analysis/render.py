"""Report renderers: terminal text, Markdown, JUnit XML, JSON."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pandas as pd

from moetrace import outputs
from moetrace.analysis.report import Report
from moetrace.analysis.sentences import fmt_int, layer_text, load_label, row_doc, steps_text
from moetrace.errors import ExitCode
from moetrace.schema import REPORT_SCHEMA, REPORT_SCHEMA_VERSION, SOURCES

STATUS_WORD = {"match": "ALL MATCH", "divergent": "DIVERGENT", "incomplete": "INCOMPLETE"}

# What each report file starts with: a report path is replaced, or removed after a
# failed run, only when it holds one of these (outputs.Ours).
JSON_REPORT = outputs.json_schema("a moetrace JSON report", REPORT_SCHEMA)
MARKDOWN_REPORT = outputs.text_head("a moetrace Markdown report", r"# moetrace ")
JUNIT_REPORT = outputs.text_head("a moetrace JUnit report", r'<\?xml[^>]*\?>\s*<testsuites name="moetrace"')


def to_json(rep: Report) -> str:
    return json.dumps(rep.doc, indent=1, sort_keys=False)


# Reports of a trace that could not be analyzed at all (audit exit 2): CI still gets a
# failing test case and a JSON verdict that says why.


def unusable_json(message: str) -> str:
    doc = {"schema": REPORT_SCHEMA, "version": REPORT_SCHEMA_VERSION, "status": "unusable",
           "audit_exit_code": int(ExitCode.INCOMPLETE),
           "error": message}
    return json.dumps(doc, indent=2) + "\n"


def unusable_markdown(message: str, command: str = "audit") -> str:
    return f"# moetrace {command}: UNUSABLE (exit {int(ExitCode.INCOMPLETE)})\n\n{_md_escape(message)}\n"


def unusable_junit(message: str) -> str:
    root = ET.Element("testsuites", name="moetrace", tests="1", failures="0", errors="1")
    suite = ET.SubElement(root, "testsuite", name="moetrace", tests="1", failures="0", errors="1")
    case = ET.SubElement(suite, "testcase", classname="moetrace", name="trace is usable")
    ET.SubElement(case, "error", message=message, type="unusable")
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _head(doc: dict) -> list[str]:
    lines = []
    for r in doc["runs"]:
        lines.append(
            f"run {r['run_id']}: TP{r['tp_size']} EP{r['ep_size']}, checkpoint {r['checkpoint_id']}, "
            f"ranks {','.join(map(str, r['ranks_present'])) or 'none'}"
            + (f" (missing {','.join(map(str, r['ranks_missing']))})" if r["ranks_missing"] else "")
            + f", {fmt_int(r['rows'])} rows"
        )
    i = doc["inputs"]
    lines.append(f"index: {i['index']} ({fmt_int(i['index_entries'])} entries, checkpoint {i['checkpoint_id']})")
    return lines


def _coverage_line(doc: dict) -> str:
    t = doc["totals"]
    mans = [m for r in doc["runs"] for m in r["manifests"]]
    written = sum(m["rows_written"] for m in mans)
    dropped = sum(m["rows_dropped"] for m in mans)
    unfinished = sum(not m["finished"] for m in mans)
    return (
        f"coverage: {fmt_int(t['loads'])} loads, {fmt_int(t['tensors'])} expected tensors, "
        f"{fmt_int(t['missing'])} missing; manifests: {fmt_int(written)} rows written, {fmt_int(dropped)} dropped, "
        + ("all finished" if not unfinished else f"{fmt_int(unfinished)} not finished")
    )


def _multi(doc: dict) -> tuple[bool, bool]:
    """(multi_source, multi_run) as the report decided them for its summary sentences."""
    return len({x["source"] for x in doc["loads"]}) > 1, len(doc["runs"]) > 1


def grouped_summaries(doc: dict) -> list[dict]:
    """doc["summaries"] (one per load and tensor kind) with the loads that differ only in step
    (same run, rank, layer, source, tensor and counts) folded into one entry, placed where the
    first of them was: {"run_id", "rank", "model", "layer", "source", "tensor", "steps", "loads",
    "finding", "sentence"}. A group of one keeps the summary's own sentence."""
    multi_source, multi_run = _multi(doc)
    groups: dict[tuple, dict] = {}
    for i, s in enumerate(doc["summaries"]):
        label = load_label(s["run_id"], s["rank"], s["layer"], s["step"], s["source"], multi_source, multi_run,
                           s["model"])
        if s["sentence"].startswith(label + ": "):
            finding = s["sentence"][len(label) + 2:]
            counts = tuple((c["verdict"], c["detail"], c["count"]) for c in s["counts"])
            key = (s["run_id"], s["rank"], s["model"], s["layer"], s["source"], s["tensor"], s["total"], counts,
                   finding)
        else:  # a sentence of another shape: shown as is, never folded
            finding, key = s["sentence"].split(": ", 1)[-1], ("as is", i)
        g = groups.get(key)
        if g is None:
            groups[key] = {"run_id": s["run_id"], "rank": s["rank"], "model": s["model"], "layer": s["layer"],
                           "source": s["source"], "tensor": s["tensor"], "steps": [s["step"]], "loads": 1,
                           "finding": finding, "sentence": s["sentence"]}
        else:
            g["steps"].append(s["step"])
            g["loads"] += 1
    out = list(groups.values())
    for g in out:
        if g["loads"] > 1:
            label = load_label(g["run_id"], g["rank"], g["layer"], g["steps"], g["source"], multi_source, multi_run,
                               g["model"])
            g["finding"] += f" ({fmt_int(g['loads'])} loads)"
            g["sentence"] = f"{label}: {g['finding']}"
    return out


def grouped_missing_loads(doc: dict) -> list[str]:
    """doc["missing_loads"] as lines, loads that differ only in step folded into one line."""
    multi_run = _multi(doc)[1]
    groups: dict[tuple, list[int]] = {}
    for m in doc["missing_loads"]:
        groups.setdefault((m["run_id"], m["rank"], m["model"], m["layer"], m["source"], m["expected"]),
                          []).append(m["step"])
    out = []
    for (run_id, rank, model, layer, source, expected), steps in groups.items():
        line = (f"rank {rank}, {layer_text(model, layer)}, {steps_text(steps)} ({source}): "
                f"{fmt_int(expected)} entries missing")
        if len(steps) > 1:
            line += f" per load ({fmt_int(len(steps))} loads)"
        out.append(f"{run_id}: {line}" if multi_run else line)
    return out


def to_text(rep: Report, max_lines: int = 20, command: str = "analyze") -> str:
    """The terminal summary. Run-level causes of an incomplete run come before the per-load
    lines, and loads that differ only in step share one line ("steps 0-9,12 … (11 loads)")."""
    doc = rep.doc
    out = [f"moetrace {command}: {STATUS_WORD[doc['status']]}"]
    out += ["  " + x for x in _head(doc)]
    out.append(doc["totals"]["sentence"])
    for f in doc["first_divergence"]:
        out.append(f"first divergence: {f['sentence']}")
    if doc["incomplete"]:
        out.append("incomplete:")
        out += ["  " + x for x in doc["incomplete"]]
    summaries = grouped_summaries(doc)
    if summaries:
        out.append("summary (per load and tensor kind):")
        for s in summaries[:max_lines]:
            out.append("  " + s["sentence"])
        if len(summaries) > max_lines:
            out.append(f"  … and {fmt_int(len(summaries) - max_lines)} more (see --json / --markdown)")
    missing = grouped_missing_loads(doc)
    if missing:
        out.append("loads not captured on every rank:")
        out += ["  " + x for x in missing[:max_lines]]
        if len(missing) > max_lines:
            out.append(f"  … and {fmt_int(len(missing) - max_lines)} more")
    out.append(_coverage_line(doc))
    if doc["warnings"]:
        out.append("warnings:")
        out += ["  " + x for x in doc["warnings"][:max_lines]]
    return "\n".join(out)


def _md_escape(s: str) -> str:
    """Text from the trace (run ids are folder names: anything) as Markdown shows it: HTML
    never renders (a run id `<img src=x onerror=...>` stays text), a `|` never splits a cell."""
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def to_markdown(rep: Report) -> str:
    doc = rep.doc
    t = doc["totals"]
    out = [f"# moetrace analysis: {STATUS_WORD[doc['status']]}", ""]
    out += [f"- {_md_escape(x)}" for x in _head(doc)]
    out += ["", f"**{_md_escape(t['sentence'])}**", ""]
    if doc["first_divergence"]:
        out += ["## First divergence", ""]
        out += [f"- {_md_escape(f['sentence'])}" for f in doc["first_divergence"]]
        out.append("")
    out += ["## Verdicts", "", "| verdict | count |", "|---|---:|"]
    out += [f"| {k} | {fmt_int(v)} |" for k, v in t["by_verdict"].items() if v]
    out.append("")
    if doc["incomplete"]:
        out += ["## Incomplete", ""] + [f"- {_md_escape(x)}" for x in doc["incomplete"]] + [""]
    if doc["summaries"]:
        out += ["## Summary per load and tensor kind", "", "| run | step | layer | rank | source | tensor | finding |",
                "|---|---:|---:|---:|---|---|---|"]
        for s in grouped_summaries(doc):
            step = steps_text(s["steps"]).split(" ", 1)[1]
            layer = s["layer"] if s["model"] == "target" else f"{s['model']} {s['layer']}"
            out.append(f"| {_md_escape(s['run_id'])} | {step} | {_md_escape(layer)} | {_md_escape(s['rank'])} | "
                       f"{s['source']} | {_md_escape(s['tensor'])} | {_md_escape(s['finding'])} |")
        out.append("")
    missing = grouped_missing_loads(doc)
    if missing:
        out += ["## Loads not captured on every rank", ""] + [f"- {_md_escape(x)}" for x in missing] + [""]
    out += ["## Coverage", "", _md_escape(_coverage_line(doc)), ""]
    out += ["| run | rank | finished | rows written | rows read | dropped | hook errors | parts |",
            "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in doc["runs"]:
        for m in r["manifests"]:
            done = "yes" if m["finished"] else "**no**"
            out.append(f"| {_md_escape(r['run_id'])} | {_md_escape(m['rank'])} | {done} | "
                       f"{fmt_int(m['rows_written'])} | {fmt_int(m['rows_read'])} | {fmt_int(m['rows_dropped'])} | "
                       f"{fmt_int(m['hook_errors'])} | {m['parts']} |")
        for rk in r["ranks_missing"]:
            out.append(f"| {_md_escape(r['run_id'])} | {_md_escape(rk)} | **missing** | | | | | |")
    out.append("")
    if doc["warnings"]:
        out += ["## Warnings", ""] + [f"- {_md_escape(x)}" for x in doc["warnings"]] + [""]
    if doc["divergent_rows"]:
        out += ["## Divergent entries", ""]
        out += [f"- {_md_escape(r['sentence'])}" for r in doc["divergent_rows"]]
        if doc["divergent_rows_truncated"]:
            out.append(f"- … and {fmt_int(doc['divergent_rows_truncated'])} more")
        out.append("")
    return "\n".join(out)


def to_junit(rep: Report) -> str:
    """One <testsuite> per run, one <testcase> per (rank, layer, source) plus a completeness case.

    A divergent case carries <failure message="first divergent entry's sentence">
    with the case's summary lines as text; missing entries are an <error>.
    """
    a = rep.analysis
    doc = rep.doc
    d, c, L = a.data, a.data.cols, a.loads
    drows = a.order_rows(a.divergent_rows())
    first_by_case: dict[tuple, int] = {}
    count_by_case: dict[tuple, int] = {}
    if len(drows):
        key = pd.DataFrame({"run": c["run"][drows], "rank": c["rank"][drows], "layer": c["lkey"][drows],
                            "source": c["source"][drows]})
        key["row"] = drows
        grp = key.groupby(["run", "rank", "layer", "source"], sort=False)
        for k, n in grp.size().items():
            count_by_case[tuple(int(x) for x in k)] = int(n)
        for k, r in grp["row"].first().items():
            first_by_case[tuple(int(x) for x in k)] = int(r)
    summ: dict[tuple, list[str]] = {}
    for s in grouped_summaries(doc):
        k = (d.run_ids.code(s["run_id"]), d.label_code(s["rank"]),
             d.models.code(s["model"]) * a.layer_stride + s["layer"], SOURCES.index(s["source"]))
        summ.setdefault(k, []).append(s["sentence"])
    root = ET.Element("testsuites", name="moetrace")
    totals = {"tests": 0, "failures": 0, "errors": 0}
    for run in d.runs:
        rc = d.run_ids.code(run.run_id)
        suite = ET.SubElement(root, "testsuite", name=f"moetrace.{run.run_id}")
        counts = {"tests": 0, "failures": 0, "errors": 0}
        cases: dict[tuple, dict] = {}
        Lr = L[L["run"] == rc] if len(L) else L
        for r in Lr.itertuples(index=False):
            k = (rc, int(r.rank), int(r.lkey), int(r.source))
            cc = cases.setdefault(k, {"rows": 0, "expected": 0, "missing": 0, "loads": 0})
            cc["rows"] += int(r.rows)
            cc["expected"] += int(r.expected)
            cc["missing"] += int(r.missing)
            cc["loads"] += 1
        ml = a.missing_loads
        for r in ml[ml["run"] == rc].itertuples(index=False) if len(ml) else []:
            k = (rc, int(r.rank), int(r.lkey), int(r.source))
            cc = cases.setdefault(k, {"rows": 0, "expected": 0, "missing": 0, "loads": 0})
            cc["expected"] += int(r.expected)
            cc["missing"] += int(r.expected)
            cc["missing_loads"] = cc.get("missing_loads", 0) + 1
        for k in sorted(cases, key=lambda k: (k[1], k[2], k[3])):
            cc = cases[k]
            _, rank, lkey, source = k
            model, layer = d.models.names[lkey // a.layer_stride], lkey % a.layer_stride
            tc = ET.SubElement(suite, "testcase", classname=f"moetrace.{run.run_id}.rank{d.labels[rank]}",
                               name=f"{'' if model == 'target' else model + '.'}layer{layer}.{SOURCES[source]}")
            counts["tests"] += 1
            if k in first_by_case:
                row = row_doc(a, first_by_case[k])
                f = ET.SubElement(tc, "failure", message=row["sentence"], type=row["verdict"])
                f.text = "\n".join([f"{fmt_int(count_by_case[k])} divergent entries over {fmt_int(cc['loads'])} "
                                    f"load(s)"]
                                   + summ.get(k, []))
                counts["failures"] += 1
            elif cc["missing"]:
                msg = f"{fmt_int(cc['missing'])} of {fmt_int(cc['expected'])} expected entries not captured"
                if cc.get("missing_loads"):
                    msg += f" ({fmt_int(cc['missing_loads'])} load(s) absent on this rank)"
                e = ET.SubElement(tc, "error", message=msg, type="missing")
                e.text = "\n".join(summ.get(k, []))
                counts["errors"] += 1
        tc = ET.SubElement(suite, "testcase", classname=f"moetrace.{run.run_id}", name="completeness")
        counts["tests"] += 1
        probs = [x for x in doc["incomplete"] if run.run_id in x or not any(rr.run_id in x for rr in d.runs)]
        if probs:
            e = ET.SubElement(tc, "error", message=probs[0], type="incomplete")
            e.text = "\n".join(probs)
            counts["errors"] += 1
        for kk, vv in counts.items():
            suite.set(kk, str(vv))
            totals[kk] += vv
    for kk, vv in totals.items():
        root.set(kk, str(vv))
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
