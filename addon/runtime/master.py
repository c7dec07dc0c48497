"""mitmproxy's Master with only the addons credproxy serves with, and nothing of credproxy's.

mitmdump loads 34 addons, and mitmproxy calls each of them for every event of every request
(about eight events per request: some 270 calls, whether the addon has the hook or not). The
others replay, rewrite, save, run scripts or serve pages (onboarding, proxyauth), none of
which credproxy uses; without them their options do not exist either, so nothing can turn
them on. addon/runtime/serve.py adds credproxy's addons to this master; the benchmark's
`mitmproxy-lean` runs it bare, to show what credproxy's own addons cost.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mitmproxy import master, options
from mitmproxy.addons import (
    block,
    core,
    disable_h2c,
    errorcheck,
    next_layer,
    proxyserver,
    tlsconfig,
)


def build() -> master.Master:
    """A Master on the running event loop, with mitmproxy's serving addons only."""
    found = master.Master(options.Options(), with_termlog=False)
    found.addons.add(
        core.Core(),
        block.Block(),  # block_global and block_private, which credproxy sets off
        disable_h2c.DisableH2C(),  # an h2c upgrade or h2 prior knowledge over plain HTTP: killed
        proxyserver.Proxyserver(),
        next_layer.NextLayer(),
        tlsconfig.TlsConfig(),
        errorcheck.ErrorCheck(),
    )
    return found


class StartFailed(Exception):
    """mitmproxy logged an error while starting (a listener that failed, say)."""


def raise_on_start_error(found: master.Master) -> None:
    """Raise StartFailed where mitmproxy's errorcheck would print its own line and exit 1.

    The error itself is already in the output, as a log line; its advice names mitmproxy's
    flags, not credproxy's, so `credproxy run` says what failed in one line of its own.
    """
    check: Any = found.addons.get("errorcheck")

    async def refuse() -> None:
        await asyncio.sleep(0)  # as errorcheck does: let pending log records arrive
        if check.logger.has_errored:
            raise StartFailed

    check.shutdown_if_errored = refuse
