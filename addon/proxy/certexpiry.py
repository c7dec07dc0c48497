"""mtls certificates near their expiry: a gauge of the seconds left for each, and one audit
event (`credential.expiring`) per certificate once it is within WINDOW of it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from addon.observe import audit
from addon.observe.metrics import Metrics
from addon.proxy.live import LivePolicy

WINDOW = timedelta(days=14)
EVERY = 60.0  # seconds between looks


class CertExpiry:
    def __init__(
        self,
        live: LivePolicy,
        metrics: Metrics,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.live, self.metrics, self.now = live, metrics, now
        self._announced: set[tuple[str, str]] = set()  # (credential, fingerprint)
        self._task: asyncio.Task[None] | None = None

    def running(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def done(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the look must live; the gauge goes stale
                audit.logger().error("hook.failed", hook="cert_expiry", error_type=type(e).__name__)
            await asyncio.sleep(EVERY)

    def check(self) -> None:
        """The gauge for every mtls credential of the current policy; the event for each one
        newly within the window."""
        policy = self.live.current()
        if policy is None:
            return
        now = self.now()
        self.metrics.client_cert_expiry.clear()
        for credential in policy.credentials.values():
            mtls = credential.scheme == "mtls"
            shown = credential.options.get("cert_not_after") if mtls else None
            if not isinstance(shown, str):
                continue  # held elsewhere (no hint stored), or another scheme
            with contextlib.suppress(ValueError):
                left = (datetime.fromisoformat(shown) - now).total_seconds()
                self.metrics.client_cert_expiry.labels(credential.name).set(left)
                version = (credential.name, credential.fingerprint)
                if left <= WINDOW.total_seconds() and version not in self._announced:
                    self._announced.add(version)
                    audit.logger().warning(
                        "credential.expiring",
                        credential=credential.name,
                        fingerprint=credential.fingerprint,
                        not_after=shown,
                        seconds_left=round(left),
                    )
