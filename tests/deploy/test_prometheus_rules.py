"""deploy/kubernetes/monitoring/prometheusrule.yaml: the rule groups pass `promtool check
rules`, and `promtool test rules` fires each alert on made-up series, and only then. The
PrometheusRule custom resource has no schema offline; its spec.groups is a Prometheus rule
file, which is what promtool checks."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import find, need_tool

ALERTS = {
    "CredproxyDenialStreak",
    "CredproxyFailureStreak",
    "CredproxyStoreUnavailable",
    "CredproxyStoreStale",
    "CredproxyAuditUnavailable",
    "CredproxyDown",
}
NS = 'namespace="credproxy"'


def series(name: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f"{name}{{{NS},{labels}}}", "values": values}


# (the case, its input series, when to look, the alerts expected then: their labels).
CASES: list[tuple[str, str, list[dict[str, str]], str, list[dict[str, str]]]] = [
    (
        "a principal denied 3 times a minute and never granted",
        "CredproxyDenialStreak",
        [
            series("credproxy_principal_requests_total", 'principal="a",decision="deny"', "0+3x20"),
            series("credproxy_principal_requests_total", 'principal="a",decision="allow"', "0x20"),
            # denied as often, but granted too
            series("credproxy_principal_requests_total", 'principal="b",decision="deny"', "0+3x20"),
            series(
                "credproxy_principal_requests_total", 'principal="b",decision="allow"', "0+1x20"
            ),
            # denied, but under 20 times in 10 minutes
            series("credproxy_principal_requests_total", 'principal="c",decision="deny"', "0+1x20"),
        ],
        "15m",
        [{"namespace": "credproxy", "principal": "a", "severity": "warning"}],
    ),
    (
        "requests end in store-unavailable and none is granted",
        "CredproxyFailureStreak",
        [
            series(
                "credproxy_requests_total",
                'pod="p1",decision="error",reason="store-unavailable"',
                "0+5x20",
            ),
            series("credproxy_requests_total", 'pod="p1",decision="allow",reason="ok"', "0x20"),
        ],
        "10m",
        [{"namespace": "credproxy", "severity": "critical"}],
    ),
    (
        "failures beside granted requests are no streak",
        "CredproxyFailureStreak",
        [
            series(
                "credproxy_requests_total",
                'pod="p1",decision="error",reason="internal-error"',
                "0+5x20",
            ),
            series("credproxy_requests_total", 'pod="p1",decision="allow",reason="ok"', "0+1x20"),
        ],
        "10m",
        [],
    ),
    (
        "one replica loses its store for over a minute",
        "CredproxyStoreUnavailable",
        [
            series("credproxy_store_up", 'pod="p1"', "1 1 0 0 0 0"),
            series("credproxy_store_up", 'pod="p2"', "1 1 1 1 1 1"),
        ],
        "5m",
        [{"namespace": "credproxy", "pod": "p1", "severity": "warning"}],
    ),
    (
        "a snapshot older than --max-stale",
        "CredproxyStoreStale",
        [
            series("credproxy_store_snapshot_age_seconds", 'pod="p1"', "0 0 40 100 160 220"),
            series("credproxy_store_snapshot_age_seconds", 'pod="p2"', "0 1 0 1 0 1"),
        ],
        "5m",
        [{"namespace": "credproxy", "pod": "p1", "severity": "critical"}],
    ),
    (
        "an audit stream that takes no lines",
        "CredproxyAuditUnavailable",
        [
            series("credproxy_audit_writable", 'pod="p1"', "1 0 0 0 0"),
            series("credproxy_audit_writable", 'pod="p2"', "1 1 1 1 1"),
        ],
        "4m",
        [{"namespace": "credproxy", "pod": "p1", "severity": "critical"}],
    ),
    (
        "a replica Prometheus cannot scrape for 5 minutes",
        "CredproxyDown",
        [
            {"series": f'up{{job="credproxy-admin",{NS},pod="p1"}}', "values": "0x10"},
            {"series": f'up{{job="credproxy-admin",{NS},pod="p2"}}', "values": "1x10"},
        ],
        "8m",
        [{"job": "credproxy-admin", "namespace": "credproxy", "pod": "p1", "severity": "warning"}],
    ),
]


@pytest.fixture(scope="module")
def groups(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rule = find(rendered["monitoring"], "PrometheusRule", "credproxy")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    return rule["spec"]["groups"]


@pytest.fixture(scope="module")
def promtool() -> str:
    return need_tool("promtool", "Debian: apt-get install prometheus")


def rules_by_alert(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in groups for r in g["rules"]}


def test_the_rules_are_the_alerts_the_docs_describe(groups: list[dict[str, Any]]) -> None:
    assert set(rules_by_alert(groups)) == ALERTS
    assert {case[1] for case in CASES} == ALERTS


def test_the_rules_pass_promtool_check(
    groups: list[dict[str, Any]], promtool: str, tmp_path: Path
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    done = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout


def expanded(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m[1]], template)


@pytest.mark.parametrize(
    ("alert", "inputs", "at", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_an_alert_fires_on_its_condition_only(
    groups: list[dict[str, Any]],
    promtool: str,
    tmp_path: Path,
    alert: str,
    inputs: list[dict[str, str]],
    at: str,
    expected: list[dict[str, str]],
) -> None:
    annotations = rules_by_alert(groups)[alert]["annotations"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [
                    {
                        "eval_time": at,
                        "alertname": alert,
                        "exp_alerts": [
                            {
                                "exp_labels": labels,
                                "exp_annotations": {
                                    k: expanded(v, labels) for k, v in annotations.items()
                                },
                            }
                            for labels in expected
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    done = subprocess.run(
        [promtool, "test", "rules", "test.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
