"""Trace ⋈ index: verdicts per captured tensor, first divergence, summaries, reports.

Public API::

    from moetrace.analysis import analyze, diff
    rep = analyze(["/data/traces/run1"], index="index.parquet")   # or checkpoint="CKPT"
    rep.doc          # the JSON document (docs/analysis.md)
    rep.exit_code    # what `moetrace audit` exits with: 0 match, 1 divergent, 2 incomplete
    render.to_text(rep) / to_markdown(rep) / to_junit(rep) / to_json(rep); plot.plot(rep, "grid.png")

Modules, in data-flow order: discovery (runs, manifests), trace and expected
(columnar reads), verdicts (per row), coverage (loads, missing entries), sentences,
summaries, grid, report (the document, ``analyze``), render, plot, diff.
"""

from moetrace.analysis.diff import diff
from moetrace.analysis.report import Report, analyze

__all__ = ["Report", "analyze", "diff"]
