"""credproxy's one entry in mitmproxy's addon list: its addons, nested, in the runner's order.

mitmproxy runs nested addons (`addons`) in list order, like top-level ones, but pays its
per-addon dispatch (a context manager and a coroutine per hook call) once for the entry.
The entry itself enforces the options credproxy needs and runs the policy poller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from mitmproxy import ctx, exceptions

from addon import audit
from addon.live import LivePolicy

REQUIRED_OPTIONS = {
    "connection_strategy": "lazy",
    "rawtcp": False,
    "http3": False,
    "onboarding": False,
    "ssl_insecure": False,
    "ignore_hosts": [],
    "allow_hosts": [],
    "proxyauth": None,
    "stream_large_bodies": None,
    "validate_inbound_headers": True,  # addon.wire refuses response transfer codings there
}


class Credproxy:
    def __init__(self, live: LivePolicy, addons: Sequence[object]) -> None:
        self.live = live
        self.addons = list(addons)
        self._poller: asyncio.Task[Any] | None = None

    def configure(self, updated: set[str]) -> None:
        for name, wanted in REQUIRED_OPTIONS.items():
            if name in updated and getattr(ctx.options, name) != wanted:
                raise exceptions.OptionsError(f"credproxy requires {name}={wanted!r}")

    def running(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self.live.run())

    def done(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        audit.drain()
