"""Stop reading a client's connection while one of its requests waits.

While a hook is awaited, mitmproxy keeps reading the client's socket and queues what arrives
at the waiting stream's layer, with no bound: a request body pushed during a store write, a
token mint or an owner's approval would pile up in the proxy. Pausing the connection's
transport leaves those bytes in the socket's buffers instead (then the client's writes
block). Pauses are counted per client: the connection is read again when the last one ends.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mitmproxy import connection

_paused: weakref.WeakKeyDictionary[connection.Client, int] = weakref.WeakKeyDictionary()


def pause(client: connection.Client) -> None:
    """Stop reading `client`'s connection until the matching `resume`."""
    count = _paused.get(client, 0)
    if count == 0:
        found = transport(client)
        if found is None:
            return
        found.pause_reading()
        # asyncio's StreamReader resumes a transport it paused itself once its buffer
        # drains: it must not resume ours.
        found.resume_reading = _stay_paused
    _paused[client] = count + 1


def resume(client: connection.Client) -> None:
    """End one `pause`; the last one reads the connection again."""
    count = _paused.get(client, 0)
    if count == 0:
        return
    if count > 1:
        _paused[client] = count - 1
        return
    del _paused[client]
    found = transport(client)
    if found is None:
        return
    found.__dict__.pop("resume_reading", None)
    if not found.is_closing():
        found.resume_reading()


def paused(client: connection.Client) -> bool:
    return _paused.get(client, 0) > 0


def lift(client: connection.Client) -> int:
    """Read `client`'s connection again for a moment, whoever paused it; returns the pauses
    that `restore` puts back."""
    count = _paused.get(client, 0)
    if count:
        _paused[client] = 1
        resume(client)
    return count


def restore(client: connection.Client, count: int) -> None:
    """Put back the pauses `lift` took away."""
    if count:
        pause(client)
        _paused[client] = count


async def while_paused(client: connection.Client, waiting: Any) -> None:
    """Await `waiting` with `client`'s connection not read."""
    pause(client)
    try:
        await waiting
    finally:
        resume(client)


def _stay_paused() -> None:
    pass


def transport(client: connection.Client, strict: bool = False) -> Any:
    """The client's asyncio transport; None without a master. Without one for this client:
    None, or with `strict` LookupError."""
    # mitmproxy's ctx holds the running master: bound once it runs, read when used.
    from mitmproxy import ctx

    try:
        proxyserver = ctx.master.addons.get("proxyserver")
    except AttributeError:  # no master: a unit test calling hooks directly
        return None
    if proxyserver is None:  # a test master without a proxy server
        return None
    handler = proxyserver.connections.get(client.id)
    io = handler.transports.get(client) if handler is not None else None
    writer = io.writer if io is not None else None
    found = getattr(writer, "transport", None)
    if found is None and strict:
        raise LookupError(client.id)
    return found
