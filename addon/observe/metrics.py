"""Prometheus metrics and denial-streak alerts, fed from the one audit line per request."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from addon.observe import audit, otlp

# Reasons that mean the proxy, not the agent, is failing.
FAILURE_REASONS = frozenset({"internal-error", "store-unavailable", "audit-unavailable"})


HOLD_BUCKETS = (1, 2, 5, 10, 30, 60, 120, 300, 600)
# Distinct (principal, model) label pairs of credproxy_model_tokens: an upstream names its
# models, so their number is bounded here.
MAX_MODEL_SERIES = 1000
OTHER_MODEL = "other"
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """One registry per proxy; principal names are the only per-agent label (never paths).

    The per-request figures are plain counters read at scrape time by a custom collector:
    prometheus_client's labelled metrics take a lock and a label lookup per update, which
    cost more per request than everything else here, for a single-threaded event loop.
    """

    def __init__(self, snapshot_age: Callable[[], float], store_up: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        self._requests: dict[tuple[str, str], int] = defaultdict(int)
        self._by_principal: dict[tuple[str, str], int] = defaultdict(int)
        self._durations = [0] * (len(DURATION_BUCKETS) + 1)  # the last one: above every bound
        self._duration_sum = 0.0
        self._redactions = 0
        # (principal, model, kind) -> tokens charged to budgets; models as the answers name
        # them, at most MAX_MODEL_SERIES distinct pairs, the rest counted under OTHER_MODEL.
        self._tokens: dict[tuple[str, str, str], int] = defaultdict(int)
        self._model_pairs: set[tuple[str, str]] = set()
        self.dns: Any = None  # addon.dns.Stats, set by the forwarder
        self.connections: Any = None  # addon.admission.Admission, set by the limits addon
        self.registry.register(self)  # collect() below
        self.reloads = Counter(
            "credproxy_policy_reloads", "Policy reloads from the store", registry=self.registry
        )
        self.once_consumed = Counter(
            "credproxy_once_grants_consumed", "Once-grants used", registry=self.registry
        )
        self.grant_uses = Counter(
            "credproxy_grant_uses", "Uses of grants with --max-uses", registry=self.registry
        )
        self.token_mints = Counter(
            "credproxy_token_mints",
            "Minted-token requests to token endpoints, by credential and outcome (minted, failed)",
            ["credential", "outcome"],
            registry=self.registry,
        )
        age = Gauge(
            "credproxy_store_snapshot_age_seconds",
            "Seconds since the last good store snapshot",
            registry=self.registry,
        )
        age.set_function(snapshot_age)
        up = Gauge("credproxy_store_up", "1 while the store answers", registry=self.registry)
        up.set_function(lambda: 1.0 if store_up() else 0.0)
        queued = Gauge(
            "credproxy_audit_queue_bytes",
            "Audit bytes waiting for stdout",
            registry=self.registry,
        )
        queued.set_function(audit.queued_bytes)
        audit_up = Gauge(
            "credproxy_audit_writable",
            "1 while the audit stream takes lines (requests are served)",
            registry=self.registry,
        )
        audit_up.set_function(lambda: 1.0 if audit.writable() else 0.0)
        self.held: Callable[[], int] = lambda: 0  # requests held now, set by the holds
        pending = Gauge(
            "credproxy_holds_pending",
            "Requests held for an owner's approval now",
            registry=self.registry,
        )
        pending.set_function(lambda: float(self.held()))
        # Credentials whose secret is held elsewhere (addon/proxy/sources.py), by the state
        # of their source; the wiring sets each state's count.
        self.secret_sources = Gauge(
            "credproxy_secret_sources",
            "Credentials whose secret is held elsewhere, by source state: ok, stale, failing",
            ["state"],
            registry=self.registry,
        )
        # mtls credentials: seconds until each certificate expires (addon/proxy/certexpiry.py).
        self.client_cert_expiry = Gauge(
            "credproxy_client_cert_expires_in_seconds",
            "Seconds until each mtls credential's certificate expires (negative: expired)",
            ["credential"],
            registry=self.registry,
        )
        self.holds = Counter(
            "credproxy_holds",
            "Requests held for approval, by outcome: approved, denied, timeout, gone",
            ["outcome"],
            registry=self.registry,
        )
        self.notifications = Counter(
            "credproxy_notifications",
            "Webhook notifications (--notify), by outcome: sent, failed, dropped",
            ["outcome"],
            registry=self.registry,
        )
        self.hold_seconds = Histogram(
            "credproxy_hold_duration_seconds",
            "How long held requests waited for a decision",
            buckets=HOLD_BUCKETS,
            registry=self.registry,
        )

    def observe(self, line: dict[str, Any]) -> None:
        decision = line[audit.DECISION]
        reason = line.get(audit.REASON) or ""
        self._requests[decision, reason] += 1
        principal = line.get(audit.PRINCIPAL)
        if principal and reason != "auth-required":
            self._by_principal[principal, decision] += 1
        seconds = line[audit.DURATION_MS] / 1000
        self._durations[bisect_left(DURATION_BUCKETS, seconds)] += 1
        self._duration_sum += seconds
        redactions = line.get("redactions")
        if redactions:
            self._redactions += redactions
        if audit.INPUT_TOKENS in line:
            self._count_tokens(principal or "", line.get(audit.MODEL) or "", line)

    def _count_tokens(self, principal: str, model: str, line: dict[str, Any]) -> None:
        pair = (principal, model)
        if pair not in self._model_pairs:
            if len(self._model_pairs) >= MAX_MODEL_SERIES:
                pair = (principal, OTHER_MODEL)
            else:
                self._model_pairs.add(pair)
        self._tokens[(*pair, "input")] += line[audit.INPUT_TOKENS]
        self._tokens[(*pair, "output")] += line[audit.OUTPUT_TOKENS]

    def collect(self) -> Iterator[Metric]:
        """The registry's scrape-time view of the per-request counters."""
        requests = CounterMetricFamily(
            "credproxy_requests", "Requests by decision and reason", labels=["decision", "reason"]
        )
        for labels, n in list(self._requests.items()):
            requests.add_metric(labels, n)
        by_principal = CounterMetricFamily(
            "credproxy_principal_requests",
            "Requests by authenticated principal and decision",
            labels=["principal", "decision"],
        )
        for labels, n in list(self._by_principal.items()):
            by_principal.add_metric(labels, n)
        cumulative, buckets = 0, []
        bounds = (*map(floatToGoString, DURATION_BUCKETS), "+Inf")
        for bound, n in zip(bounds, self._durations, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        duration = HistogramMetricFamily(
            "credproxy_request_duration_seconds",
            "Time from request headers to the audit line",
            buckets=buckets,
            sum_value=self._duration_sum,
        )
        redactions = CounterMetricFamily(
            "credproxy_redactions",
            "Echoed secrets replaced in responses",
            value=self._redactions,
        )
        failures = CounterMetricFamily(
            "credproxy_audit_write_failures",
            "Writes to stdout that failed (each retried)",
            value=audit.write_failures(),
        )
        export_dropped = CounterMetricFamily(
            "credproxy_audit_export_dropped",
            "Audit records not exported over OTLP, by reason: queue-full, export-failed, "
            "unexportable, shutdown (stdout has every line)",
            labels=["reason"],
        )
        for reason, n in otlp.dropped().items():
            export_dropped.add_metric([reason], n)
        export_queue = GaugeMetricFamily(
            "credproxy_audit_export_queue",
            "Audit records waiting for the OTLP collector (--otlp-queue bounds it)",
            value=otlp.waiting(),
        )
        tokens = CounterMetricFamily(
            "credproxy_model_tokens",
            "Tokens charged to grants' budgets, by principal, model (as answers name it) and "
            "kind (input, output)",
            labels=["principal", "model", "kind"],
        )
        for series, n in list(self._tokens.items()):
            tokens.add_metric(series, n)
        families = [requests, by_principal, duration, redactions, failures, tokens]
        families += [export_dropped, export_queue]
        if self.dns is not None:
            dns = self.dns
            families += [
                CounterMetricFamily(
                    "credproxy_dns_lookups", "Name lookups made", value=dns.lookups
                ),
                CounterMetricFamily(
                    "credproxy_dns_cache_hits", "Requests served a cached answer", value=dns.hits
                ),
                CounterMetricFamily(
                    "credproxy_dns_failures",
                    "Lookups that failed or answered a forbidden address",
                    value=dns.failures,
                ),
                CounterMetricFamily(
                    "credproxy_dns_lookup_seconds",
                    "Time spent in name lookups",
                    value=dns.lookup_seconds,
                ),
            ]
        if self.connections is not None:
            families += _connection_families(self.connections)
        return iter(families)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _connection_families(admission: Any) -> list[Metric]:
    refused = CounterMetricFamily(
        "credproxy_connections_refused",
        "Client connections closed at accept, by the bound that was full",
        labels=["reason"],
    )
    for reason, n in list(admission.refused.items()):
        refused.add_metric([reason], n)
    displaced = CounterMetricFamily(
        "credproxy_connections_displaced",
        "Unauthenticated client connections closed to make room for a newer one, by bound",
        labels=["reason"],
    )
    for reason, n in list(admission.displaced.items()):
        displaced.add_metric([reason], n)
    pending = GaugeMetricFamily(
        "credproxy_unauthenticated_connections",
        "Client connections open now that have not authenticated yet",
        value=len(admission.pending),
    )
    return [refused, displaced, pending]


class StreakAlerts:
    """One alert when a principal collects `threshold` denials in a row, then quiet until an
    allow breaks the streak; the same for internal failures across every principal.

    A challenge (a 407 to a request that offered no credentials, as git and Java send first)
    and credproxy.internal's answers neither extend nor break either streak. A request the
    grant allowed and the upstream failed (`error`) is no denial: it breaks the denial streak.
    """

    def __init__(self, threshold: int, log: Any) -> None:
        self.threshold = threshold
        self._log = log
        self._streaks: dict[str, deque[str]] = {}
        self._counts: dict[str, int] = {}
        self._failures = 0
        self._failure_reasons: deque[str] = deque(maxlen=5)

    def observe(self, principal: str | None, decision: str, reason: str | None) -> None:
        if decision not in (audit.ALLOW, audit.DENY, audit.ERROR):
            return
        if reason in FAILURE_REASONS:
            self._failures += 1
            self._failure_reasons.append(reason or "")
            if self._failures == self.threshold:
                self._log.error(
                    "alert.failure_streak",
                    count=self._failures,
                    last_reasons=list(self._failure_reasons),
                )
        else:
            self._failures = 0
        if principal is None or reason == "auth-required":
            return
        if decision != audit.DENY:
            self._counts.pop(principal, None)
            self._streaks.pop(principal, None)
            return
        count = self._counts.get(principal, 0) + 1
        self._counts[principal] = count
        reasons = self._streaks.setdefault(principal, deque(maxlen=5))
        reasons.append(reason or "")
        if count == self.threshold:
            self._log.warning(
                "alert.denial_streak",
                principal=principal,
                count=count,
                last_reasons=list(reasons),
                at=time.time(),
            )
