"""Prometheus metrics and denial-streak alerts, fed from the one audit line per request."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from addon import audit

# Reasons that mean the proxy, not the agent, is failing.
FAILURE_REASONS = frozenset({"internal-error", "store-unavailable"})


class Metrics:
    """One registry per proxy; principal names are the only per-agent label (never paths)."""

    def __init__(self, snapshot_age: Callable[[], float], store_up: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[Any, ...], Any] = {}
        self.requests = Counter(
            "credproxy_requests",
            "Requests by decision and reason",
            ["decision", "reason"],
            registry=self.registry,
        )
        self.by_principal = Counter(
            "credproxy_principal_requests",
            "Requests by authenticated principal and decision",
            ["principal", "decision"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "credproxy_request_duration_seconds",
            "Time from request headers to the audit line",
            registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.redactions = Counter(
            "credproxy_redactions", "Echoed secrets replaced in responses", registry=self.registry
        )
        self.reloads = Counter(
            "credproxy_policy_reloads", "Policy reloads from the store", registry=self.registry
        )
        self.once_consumed = Counter(
            "credproxy_once_grants_consumed", "Once-grants used", registry=self.registry
        )
        age = Gauge(
            "credproxy_store_snapshot_age_seconds",
            "Seconds since the last good store snapshot",
            registry=self.registry,
        )
        age.set_function(snapshot_age)
        up = Gauge("credproxy_store_up", "1 while the store answers", registry=self.registry)
        up.set_function(lambda: 1.0 if store_up() else 0.0)

    def observe(self, line: dict[str, Any]) -> None:
        decision = line[audit.DECISION]
        reason = line.get(audit.REASON) or ""
        self._child(self.requests, decision, reason).inc()
        principal = line.get(audit.PRINCIPAL)
        if principal and reason != "auth-required":
            self._child(self.by_principal, principal, decision).inc()
        self.duration.observe(line[audit.DURATION_MS] / 1000)
        if line.get("redactions"):
            self.redactions.inc(line["redactions"])

    def _child(self, metric: Counter, *labels: str) -> Any:
        """metric.labels(...), looked up once per label set: labels() is slow on the hot path.

        Bounded like the metric itself: decisions x reasons, principals x decisions.
        """
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StreakAlerts:
    """One alert when a principal collects `threshold` denials in a row, then quiet until an
    allow breaks the streak; the same for internal failures across every principal."""

    def __init__(self, threshold: int, log: Any) -> None:
        self.threshold = threshold
        self._log = log
        self._streaks: dict[str, deque[str]] = {}
        self._counts: dict[str, int] = {}
        self._failures = 0
        self._failure_reasons: deque[str] = deque(maxlen=5)

    def observe(self, principal: str | None, decision: str, reason: str | None) -> None:
        if decision not in ("allow", "deny"):
            return  # the proxy's own endpoints neither break nor extend a streak
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
        if decision == "allow":
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
