"""The guard's metric names read the same in both exposition formats a scrape may get
(Prometheus' text format and OpenMetrics, which Prometheus negotiates first), each
parsed by prometheus_client's own strict parser, and docs/guard.md's alert rules and
panels name series that a scrape in either format holds."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from moetrace.tracer.metrics import GuardMetrics

DOC = Path(__file__).resolve().parents[1] / "docs" / "guard.md"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _get(port: int, accept: str | None) -> tuple[str, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.headers.get("Content-Type", ""), resp.read().decode()


@pytest.fixture
def scrapes():
    """One rank's registry after a mismatched staged load, an update and a dropped row,
    scraped over HTTP as plain text and as OpenMetrics: {format: [(family, sample names)]}."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
    from prometheus_client.parser import text_string_to_metric_families as parse_text

    counts = {"hook_errors": 1, "sink_errors": 0, "drops": {"queue_full": 2}}
    m = GuardMetrics(0, 0, lambda: counts)
    try:
        assert m.exporter == "port", m.reason
        m.load("staged", {(0, "w2_weight_scale_inv"): [6, 2, 1]}, "mismatch", 0.003)
        m.verified_at(1.0e9)
        m.pass_coverage("staged", 1.0)
        m.status("mismatch")
        m.weight_update("update_weights_from_disk", "unverified")
        m.sync()
        text_type, text = _get(m.port, None)
        om_type, om = _get(m.port, OPENMETRICS)
    finally:
        m.close()
    assert text_type.startswith("text/plain") and om_type.startswith("application/openmetrics-text"), (text_type, om_type)
    return {"text": [(f.name, [s for s in f.samples]) for f in parse_text(text)],
            "openmetrics": [(f.name, [s for s in f.samples]) for f in parse_openmetrics(om)]}


def _series(families) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for _, samples in families for s in samples
            if not s.name.endswith("_created")}


def test_names_mean_the_same_in_text_and_openmetrics(scrapes):
    text, om = _series(scrapes["text"]), _series(scrapes["openmetrics"])
    ours = {n for n, _ in text} | {n for n, _ in om} | {f for f, _ in scrapes["text"] + scrapes["openmetrics"]}
    ours = {n for n in ours if "moetrace" in n}
    assert ours and all(re.fullmatch(r"moetrace_[a-z_]+", n) for n in ours), sorted(ours)  # no colon anywhere
    assert text == om  # every series: same name, labels and value in either format
    mismatched = ("moetrace_guard_tensors_mismatched_total", (("layer", "0"), ("source", "staged"),
                                                             ("tensor", "w2_weight_scale_inv"), ("tp_rank", "0")))
    assert om[mismatched] == 2 and om[("moetrace_hook_errors_total", (("tp_rank", "0"),))] == 1
    assert om[("moetrace_rows_dropped_total", (("reason", "queue_full"), ("tp_rank", "0")))] == 2
    # OpenMetrics names a counter's family without _total, and each of its samples with it
    families = dict(scrapes["openmetrics"])
    assert [s.name for s in families["moetrace_guard_tensors_mismatched"]] == ["moetrace_guard_tensors_mismatched_total",
                                                                             "moetrace_guard_tensors_mismatched_created"]


def test_guard_docs_rules_and_panels_name_scraped_series(scrapes):
    """Every metric name in docs/guard.md's rules and panels is a series of both scrapes
    (a histogram's by its _bucket/_count/_sum); the old colon names appear only where
    the page says they were renamed."""
    doc = DOC.read_text()
    rules = doc[doc.index("### Example alert rules"):doc.index("## The manifest's `guard` section")]
    named = set(re.findall(r"moetrace[_:][a-z_]+", rules))
    assert named and not [n for n in named if ":" in n], sorted(named)
    for fmt in ("text", "openmetrics"):
        names = {name for name, _ in _series(scrapes[fmt])}
        assert not sorted(n for n in named if n not in names), (fmt, sorted(named - names))
    table = doc[doc.index("## Metrics"):doc.index("### Example alert rules")]
    listed = {n for line in table.splitlines() if line.startswith("| `moetrace_")
              for n in re.findall(r"`(moetrace_[a-z_]+)`", line.split(" | ")[0])}
    scraped = {n for n, _ in _series(scrapes["openmetrics"])}
    assert listed and listed <= scraped | {n[:-len("_bucket")] for n in scraped if n.endswith("_bucket")}
    renamed = doc[doc.index("**Renamed.**"):]
    renamed = renamed[:renamed.index("\n\n")]
    assert "`moetrace:guard_status` → `moetrace_guard_status`" in renamed
    assert doc.count("moetrace:guard_") == renamed.count("moetrace:guard_")  # old names only where renamed
