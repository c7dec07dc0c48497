"""mitmproxy's Master with only the addons credproxy serves with, and nothing of credproxy's.

mitmdump loads 34 addons, and mitmproxy calls each of them for every event of every request
(about eight events per request: some 270 calls, whether the addon has the hook or not). The
others replay, rewrite, save, run scripts or serve pages (onboarding, proxyauth), none of
which credproxy uses; without them their options do not exist either, so nothing can turn
them on. `addon.runner` adds credproxy's addons to this master; the benchmark's
`mitmproxy-lean` runs it bare, to show what credproxy's own addons cost.
"""

from __future__ import annotations

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
