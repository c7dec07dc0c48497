"""The workers' metrics merged: counters and histograms add up, gauges by what they mean."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from addon.observe.mergemetrics import merge


def _worker(requests: int, up: float, age: float, queued: float, seconds: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("credproxy_requests", "Requests", ["decision"], registry=registry)
    counter.labels("allow").inc(requests)
    Gauge("credproxy_store_up", "up", registry=registry).set(up)
    Gauge("credproxy_store_snapshot_age_seconds", "age", registry=registry).set(age)
    Gauge("credproxy_audit_queue_bytes", "queued", registry=registry).set(queued)
    histogram = Histogram("credproxy_wait_seconds", "waits", buckets=[1.0], registry=registry)
    for value in seconds:
        histogram.observe(value)
    return generate_latest(registry).decode()


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_counters_and_histograms_add_up_and_gauges_merge_by_meaning() -> None:
    merged = _samples(
        merge([_worker(3, 1.0, 0.5, 100.0, [0.5]), _worker(4, 0.0, 2.5, 50.0, [0.5, 3.0])])
    )
    assert merged[("credproxy_requests_total", (("decision", "allow"),))] == 7.0
    assert merged[("credproxy_store_up", ())] == 0.0  # up only if every worker is
    assert merged[("credproxy_store_snapshot_age_seconds", ())] == 2.5  # the oldest
    assert merged[("credproxy_audit_queue_bytes", ())] == 150.0  # the sum
    assert merged[("credproxy_wait_seconds_bucket", (("le", "1.0"),))] == 2.0
    assert merged[("credproxy_wait_seconds_bucket", (("le", "+Inf"),))] == 3.0
    assert merged[("credproxy_wait_seconds_count", ())] == 3.0


def test_the_supervisors_own_families_come_first_and_parse() -> None:
    own = "# HELP credproxy_workers n\n# TYPE credproxy_workers gauge\ncredproxy_workers 2\n"
    text = merge([_worker(1, 1.0, 0.0, 0.0, [])], own)
    assert text.startswith(b"# HELP credproxy_workers n\n# TYPE credproxy_workers gauge\n")
    assert _samples(text)[("credproxy_workers", ())] == 2.0
    assert b"# TYPE credproxy_requests_total counter" in text


def test_values_that_are_no_finite_number_still_merge() -> None:
    text = "# TYPE credproxy_a gauge\ncredproxy_a +Inf\n# TYPE credproxy_b gauge\ncredproxy_b NaN\n"
    merged = merge([text, text])
    samples = _samples(merged)
    assert samples[("credproxy_a", ())] == float("inf")
    assert samples[("credproxy_b", ())] != samples[("credproxy_b", ())]  # NaN
