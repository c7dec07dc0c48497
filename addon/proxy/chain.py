"""credproxy's one entry in mitmproxy's addon list: its addons, called in the runner's order.

mitmproxy pays its per-addon dispatch (a context manager, a coroutine and two generators per
hook call, for every hook, whether the addon has it or not) for each entry in its list and
for each nested addon. `Chain` is one entry: for each hook it calls, in order, exactly the
addons that have it, and only waits when one of them returned an awaitable.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import mitmproxy.addonmanager
import mitmproxy.proxy.layers
import mitmproxy.proxy.server_hooks
from mitmproxy import ctx, exceptions, hooks

from addon.observe import audit
from addon.proxy import reading
from addon.proxy.live import LivePolicy

assert mitmproxy.addonmanager and mitmproxy.proxy.layers and mitmproxy.proxy.server_hooks  # hooks

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


class Lifecycle:
    """The options credproxy needs, and the policy poller while the proxy runs."""

    def __init__(self, live: LivePolicy) -> None:
        self.live = live
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


class Chain:
    """Addons in order, as one mitmproxy addon named "credproxy"."""

    name = "credproxy"

    def __init__(self, addons: Sequence[object]) -> None:
        self.parts = tuple(addons)
        for hook in hooks.all_hooks:
            funcs = tuple(f for a in self.parts if callable(f := getattr(a, hook, None)))
            if funcs:
                setattr(self, hook, _in_order(funcs, pauses=hook in _PAUSING))

    def part(self, kind: type[Any]) -> Any:
        """The one addon of this class."""
        [found] = [a for a in self.parts if isinstance(a, kind)]
        return found


# While one of these hooks waits (a store write, a token mint, a DNS lookup, an owner's
# approval), the request's body would pile up in the proxy: its connection is not read.
_PAUSING = frozenset({"requestheaders"})


def _in_order(funcs: tuple[Callable[..., Any], ...], pauses: bool = False) -> Callable[..., Any]:
    if len(funcs) == 1 and not pauses:
        return funcs[0]

    def call(*args: Any) -> Any:
        for i, func in enumerate(funcs):
            result = func(*args)
            if result is not None and inspect.isawaitable(result):
                rest = _rest(result, funcs[i + 1 :], args)
                client = getattr(args[0], "client_conn", None) if pauses else None
                return rest if client is None else reading.while_paused(client, rest)
        return None

    return call


async def _rest(first: Any, funcs: tuple[Callable[..., Any], ...], args: tuple[Any, ...]) -> None:
    """Wait for the addon that returned an awaitable, then call the ones after it."""
    await first
    for func in funcs:
        result = func(*args)
        if result is not None and inspect.isawaitable(result):
            await result
