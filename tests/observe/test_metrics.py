"""The per-request metrics, read at scrape time, against prometheus_client's own types."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from addon.observe.metrics import DURATION_BUCKETS, MAX_MODEL_SERIES, Metrics, StreakAlerts


def samples(text: bytes, prefix: str) -> list[str]:
    return [line for line in text.decode().splitlines() if line.startswith(prefix)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0.0, *DURATION_BUCKETS]) | st.floats(0, 100), max_size=30))
def test_the_duration_histogram_matches_prometheus_clients(durations: list[float]) -> None:
    """Bounds included (le), cumulative buckets, +Inf, count and sum: exactly Histogram's."""
    metrics = Metrics(lambda: 0.0, lambda: True)
    registry = CollectorRegistry()
    reference = Histogram(
        "credproxy_request_duration_seconds",
        "Time from request headers to the audit line",
        buckets=DURATION_BUCKETS,
        registry=registry,
    )
    for seconds in durations:
        metrics.observe({"decision": "allow", "principal": "a", "duration_ms": seconds * 1000})
        reference.observe(seconds)
    name = "credproxy_request_duration_seconds_"
    ours = samples(metrics.render(), name)
    theirs = [s for s in samples(generate_latest(registry), name) if "_created" not in s]
    assert [s.rsplit(" ", 1)[0] for s in ours] == [s.rsplit(" ", 1)[0] for s in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert abs(float(a.rsplit(" ", 1)[1]) - float(b.rsplit(" ", 1)[1])) < 1e-6


def test_requests_are_counted_by_decision_reason_and_principal() -> None:
    metrics = Metrics(lambda: 0.0, lambda: True)
    for line in [
        {"decision": "allow", "principal": "a", "duration_ms": 1.0, "redactions": 2},
        {"decision": "allow", "principal": "a", "duration_ms": 1.0, "redactions": 0},
        {"decision": "deny", "reason": "no-grant", "principal": "b", "duration_ms": 1.0},
        {"decision": "deny", "reason": "auth-required", "principal": "c", "duration_ms": 1.0},
    ]:
        metrics.observe(line)
    text = metrics.render()
    assert samples(text, "credproxy_requests_total") == [
        'credproxy_requests_total{decision="allow",reason=""} 2.0',
        'credproxy_requests_total{decision="deny",reason="no-grant"} 1.0',
        'credproxy_requests_total{decision="deny",reason="auth-required"} 1.0',
    ]
    # An unauthenticated name is the agent's claim, not a principal: never a label.
    assert samples(text, "credproxy_principal_requests_total") == [
        'credproxy_principal_requests_total{decision="allow",principal="a"} 2.0',
        'credproxy_principal_requests_total{decision="deny",principal="b"} 1.0',
    ]
    assert samples(text, "credproxy_redactions_total") == ["credproxy_redactions_total 2.0"]


def _call(principal: str, model: str, tokens_in: int, tokens_out: int) -> dict[str, object]:
    return {
        "decision": "allow",
        "principal": principal,
        "duration_ms": 1.0,
        "model": model,
        "input_tokens": tokens_in,
        "output_tokens": tokens_out,
    }


def test_model_tokens_are_counted_by_principal_model_and_kind() -> None:
    metrics = Metrics(lambda: 0.0, lambda: True)
    for line in [_call("a", "gpt-4o", 10, 2), _call("a", "gpt-4o", 5, 1), _call("b", "m", 7, 3)]:
        metrics.observe(line)
    assert samples(metrics.render(), "credproxy_model_tokens_total") == [
        'credproxy_model_tokens_total{kind="input",model="gpt-4o",principal="a"} 15.0',
        'credproxy_model_tokens_total{kind="output",model="gpt-4o",principal="a"} 3.0',
        'credproxy_model_tokens_total{kind="input",model="m",principal="b"} 7.0',
        'credproxy_model_tokens_total{kind="output",model="m",principal="b"} 3.0',
    ]


def test_models_an_upstream_names_are_bounded_as_labels() -> None:
    metrics = Metrics(lambda: 0.0, lambda: True)
    for n in range(MAX_MODEL_SERIES + 50):
        metrics.observe(_call("a", f"model-{n}", 1, 1))
    found = samples(metrics.render(), "credproxy_model_tokens_total")
    assert len(found) == 2 * (MAX_MODEL_SERIES + 1)
    assert 'credproxy_model_tokens_total{kind="input",model="other",principal="a"} 50.0' in found


def test_challenges_and_upstream_failures_are_counted_apart_from_denials() -> None:
    metrics = Metrics(lambda: 0.0, lambda: True)
    for line in [
        {"decision": "challenge", "reason": "auth-required", "principal": None, "duration_ms": 1},
        {"decision": "error", "reason": "upstream-tls-error", "principal": "a", "duration_ms": 1},
        {"decision": "deny", "reason": "no-grant", "principal": "a", "duration_ms": 1},
    ]:
        metrics.observe(line)
    text = metrics.render()
    assert samples(text, "credproxy_requests_total") == [
        'credproxy_requests_total{decision="challenge",reason="auth-required"} 1.0',
        'credproxy_requests_total{decision="error",reason="upstream-tls-error"} 1.0',
        'credproxy_requests_total{decision="deny",reason="no-grant"} 1.0',
    ]
    assert samples(text, "credproxy_principal_requests_total") == [
        'credproxy_principal_requests_total{decision="error",principal="a"} 1.0',
        'credproxy_principal_requests_total{decision="deny",principal="a"} 1.0',
    ]


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []

    def warning(self, event: str, **fields: object) -> None:
        self.events.append((event, fields))

    error = warning


def test_a_challenge_neither_extends_nor_breaks_a_streak() -> None:
    log = Log()
    alerts = StreakAlerts(3, log)
    for _ in range(3):
        alerts.observe(None, "challenge", "auth-required")  # git's first CONNECT, each time
        alerts.observe("a", "deny", "path-not-allowed")
    for _ in range(3):
        alerts.observe(None, "challenge", "auth-required")
        alerts.observe(None, "deny", "store-unavailable")
    assert [e for e, _ in log.events] == ["alert.denial_streak", "alert.failure_streak"]
    assert log.events[0][1]["last_reasons"] == ["path-not-allowed"] * 3


def test_an_upstream_failure_is_no_denial_and_breaks_the_streak() -> None:
    log = Log()
    alerts = StreakAlerts(2, log)
    alerts.observe("a", "deny", "no-grant")
    alerts.observe("a", "error", "upstream-timeout")
    alerts.observe("a", "deny", "no-grant")
    assert log.events == []
    alerts.observe("a", "error", "internal-error")
    alerts.observe("a", "error", "internal-error")
    assert [e for e, _ in log.events] == ["alert.failure_streak"]
