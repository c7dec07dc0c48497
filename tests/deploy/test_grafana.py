"""deploy/grafana/credproxy.json: every query names only metrics credproxy exports, read from
the metrics registry itself, so a renamed or dropped metric fails here, not on a dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from addon.observe.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "credproxy.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# What a PromQL expression may name besides metrics.
PROMQL = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "by",
    "without",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "clamp_min",
    "topk",
    "and",
    "or",
    "unless",
    "on",
    "ignoring",
}


def exported() -> set[str]:
    """Every series name the registry can produce, the optional families included."""
    metrics = Metrics(lambda: 0.0, lambda: True)
    metrics.dns = SimpleNamespace(lookups=0, hits=0, failures=0, lookup_seconds=0.0)
    metrics.connections = SimpleNamespace(refused={}, displaced={}, pending=set())
    names = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names


def queries(node: Any) -> list[tuple[str, str]]:
    """(panel title, expression) for every target in the dashboard, rows' panels included."""
    found = []
    for panel in node.get("panels", []):
        found += [(panel["title"], target["expr"]) for target in panel.get("targets", [])]
        found += queries(panel)
    return found


def names_in(expr: str) -> set[str]:
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # label values
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)  # matchers and ranges
    bare = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", bare)  # grouping labels
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare)) - PROMQL


DASH = json.loads(DASHBOARD.read_text())
QUERIES = queries(DASH)


def test_the_dashboard_covers_what_the_issue_asks_for() -> None:
    assert DASH["uid"] == "credproxy"
    text = " ".join(expr for _, expr in QUERIES)
    for metric in (
        "credproxy_requests_total",  # decisions by reason, upstream failures
        "credproxy_principal_requests_total",  # denials by principal
        "credproxy_request_duration_seconds_bucket",  # latency
        "credproxy_store_snapshot_age_seconds",  # store staleness
        "credproxy_audit_queue_bytes",  # audit backlog
        "credproxy_token_mints_total",  # minted-token renewals
        "credproxy_holds_pending",  # held approvals
    ):
        assert metric in text


@pytest.mark.parametrize(("title", "expr"), QUERIES, ids=[f"{t}: {e}" for t, e in QUERIES])
def test_every_query_names_only_metrics_credproxy_exports(title: str, expr: str) -> None:
    named = names_in(expr)
    assert named, f"{title}: no metric in {expr}"
    assert named <= exported(), f"{title}: {sorted(named - exported())} are not exported"


def test_the_check_catches_a_metric_that_does_not_exist() -> None:
    assert names_in("sum by (reason) (rate(credproxy_nonesuch_total[5m]))") - exported() == {
        "credproxy_nonesuch_total"
    }
