"""addon/runtime/stopping.py: a signal drains, a second one hurries the drain but never the
close of the connections it cancelled, and what still runs ends before the last line."""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace
from typing import Any

from structlog.testing import capture_logs

from addon.observe import audit
from addon.runtime import stopping
from addon.runtime.stopping import Stopping, settle


class Server:
    is_running = True

    async def stop(self) -> None:
        self.is_running = False


class Proxy:
    """mitmproxy's master, as far as stopping reads it: listeners and connection handlers."""

    def __init__(self, connections: int, close_after: float) -> None:
        self.servers = [Server()]
        self.connections: dict[int, Any] = {}
        self.cancelled: list[str] = []
        self.left_at_shutdown: int | None = None
        for key in range(connections):
            io = SimpleNamespace(handler=SimpleNamespace(cancel=self._closer(key, close_after)))
            self.connections[key] = SimpleNamespace(client=key, transports={key: io})
        self.addons = SimpleNamespace(get=lambda name: self)

    def _closer(self, key: int, after: float) -> Any:
        def cancel(message: str) -> None:
            self.cancelled.append(message)
            asyncio.get_running_loop().call_later(after, self.connections.pop, key)

        return cancel

    def shutdown(self) -> None:
        self.left_at_shutdown = len(self.connections)


async def _until_shutdown(proxy: Proxy) -> None:
    while proxy.left_at_shutdown is None:
        await asyncio.sleep(0.01)


async def test_a_signal_stops_listening_waits_for_requests_then_shuts_down() -> None:
    proxy, trail = Proxy(connections=1, close_after=0.05), SimpleNamespace(open=1)
    with capture_logs() as logs:
        stop = Stopping(proxy, trail, drain_timeout=5.0, log=audit.logger())
        stop.begin(signal.SIGTERM)
        await asyncio.sleep(0.1)
        assert not proxy.servers[0].is_running and proxy.left_at_shutdown is None
        trail.open = 0  # the last request in flight ends
        await asyncio.wait_for(_until_shutdown(proxy), 2.0)
    assert stop.cut == 0 and proxy.left_at_shutdown == 0
    assert proxy.cancelled == ["credproxy is stopping"]
    assert logs[0]["event"] == "proxy.stopping" and logs[0]["in_flight"] == 1


async def test_a_second_signal_hurries_the_drain_but_not_the_close() -> None:
    assert stopping.CLOSE_TIMEOUT > 0.3
    proxy, trail = Proxy(connections=2, close_after=0.3), SimpleNamespace(open=2)
    stop = Stopping(proxy, trail, drain_timeout=30.0, log=audit.logger())
    stop.begin(signal.SIGTERM)
    await asyncio.sleep(0.05)
    stop.begin(signal.SIGINT)
    await asyncio.wait_for(_until_shutdown(proxy), 2.0)
    assert stop.cut == 2  # still in flight when the drain was cut short
    # The cancelled connections ended (their audit lines written) before the shutdown.
    assert proxy.left_at_shutdown == 0


async def test_settle_cancels_what_still_runs_and_lets_it_end() -> None:
    ended: list[str] = []

    async def poller() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ended.append("poller")
            raise

    task = asyncio.get_running_loop().create_task(poller())
    await asyncio.sleep(0)
    await settle(1.0)
    assert task.cancelled() and ended == ["poller"]
