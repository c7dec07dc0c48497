"""addon.mitm.connects: a connect reset between the handshake and the transport's set-up is
answered as a reset, never left waiting."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import pytest
from mitmproxy.connection import Client, Server
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.server import ConnectionHandler

from addon.mitm import connects, wire


class Handler(ConnectionHandler):
    """The real open_connection, with the layer stack replaced by a recorder."""

    def __init__(self) -> None:  # no layers: only open_connection is exercised
        self.client = Client(
            peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2), timestamp_start=0
        )
        self.transports = {}
        self.max_conns = collections.defaultdict(lambda: asyncio.Semaphore(5))
        self.events: list[events.Event] = []
        self.hooks: list[str] = []

    async def handle_hook(self, hook: commands.StartHook) -> None:
        self.hooks.append(hook.name)

    async def server_event(self, event: events.Event) -> None:
        self.events.append(event)

    def log(self, message: str, level: int = logging.INFO) -> None:
        pass


class ResetWriter:
    """What asyncio hands back when the peer reset the socket before the transport was made."""

    closed = False

    def get_extra_info(self, name: str) -> Any:
        return None

    def close(self) -> None:
        self.closed = True


async def test_a_connect_reset_before_set_up_completes_as_a_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    connects.install()
    writer = ResetWriter()

    async def open_connection(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return object(), writer

    monkeypatch.setattr(asyncio, "open_connection", open_connection)
    handler = Handler()
    server = Server(address=("127.0.0.1", 9))
    command = commands.OpenConnection(server)
    await handler.open_connection(command)
    [completed] = handler.events
    assert isinstance(completed, events.OpenConnectionCompleted)
    assert completed.command is command and completed.reply == connects.RESET
    assert handler.hooks == ["server_connect", "server_connect_error"]
    assert writer.closed and server.error == connects.RESET
    assert wire.classify(connects.RESET).error == "connection-reset"


def test_install_fails_at_start_when_mitmproxy_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    async def open_connection(self: Any, command: Any) -> None:
        pass

    monkeypatch.setattr(ConnectionHandler, "open_connection", open_connection)
    with pytest.raises(RuntimeError, match="mitmproxy changed"):
        connects.install.__wrapped__()  # type: ignore[attr-defined]  # the shape check, unguarded
