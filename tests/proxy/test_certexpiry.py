"""mtls certificates near their expiry: the gauge, and one audit event per certificate
version once within the window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from structlog.testing import capture_logs

from addon.observe.metrics import Metrics
from addon.proxy.certexpiry import WINDOW, CertExpiry

NOW = datetime(2027, 1, 1, tzinfo=UTC)


def _credential(name: str, left: timedelta, scheme: str = "mtls", fp: str = "fp-1") -> Any:
    options = {"cert_not_after": (NOW + left).isoformat(timespec="seconds")}
    return SimpleNamespace(name=name, scheme=scheme, options=options, fingerprint=fp)


def _expiry(*credentials: Any) -> tuple[CertExpiry, Metrics, SimpleNamespace]:
    policy = SimpleNamespace(credentials={c.name: c for c in credentials})
    live: Any = SimpleNamespace(current=lambda: policy)
    metrics = Metrics(lambda: 0.0, lambda: True)
    return CertExpiry(live, metrics, now=lambda: NOW), metrics, policy


def _gauge(metrics: Metrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(
        "credproxy_client_cert_expires_in_seconds", {"credential": name}
    )


def test_a_certificate_within_the_window_is_announced_once_per_version() -> None:
    soon = _credential("soon", WINDOW - timedelta(days=1))
    later = _credential("later", WINDOW + timedelta(days=1))
    bearer = _credential("token", timedelta(days=1), scheme="bearer")
    expiry, metrics, policy = _expiry(soon, later, bearer)
    with capture_logs() as logs:
        expiry.check()
        expiry.check()
        policy.credentials["soon"] = _credential("soon", timedelta(days=3), fp="fp-2")  # rotated
        expiry.check()
    events = [
        (e["credential"], e["fingerprint"]) for e in logs if e["event"] == "credential.expiring"
    ]
    assert events == [("soon", "fp-1"), ("soon", "fp-2")]
    assert _gauge(metrics, "soon") == timedelta(days=3).total_seconds()
    assert _gauge(metrics, "later") == (WINDOW + timedelta(days=1)).total_seconds()
    assert _gauge(metrics, "token") is None


def test_a_removed_credential_leaves_the_gauge() -> None:
    gone = _credential("gone", timedelta(days=100))
    expiry, metrics, policy = _expiry(gone)
    expiry.check()
    assert _gauge(metrics, "gone") is not None
    del policy.credentials["gone"]
    expiry.check()
    assert _gauge(metrics, "gone") is None
