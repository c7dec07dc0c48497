"""How `credproxy run` stops: SIGTERM or SIGINT drains in-flight requests, then stops; SIGHUP
reloads the policy. Everything still running ends before the last line, proxy.stopped."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

DRAIN_POLL = 0.05
# After the drain deadline, how long closing the remaining connections may take.
CLOSE_TIMEOUT = 2.0


class Stopping:
    """SIGTERM/SIGINT: stop accepting, drain in-flight requests, then stop. SIGHUP: reload."""

    def __init__(self, master: Any, trail: Any, drain_timeout: float, log: Any) -> None:
        self.master = master
        self.trail = trail
        self.drain_timeout = drain_timeout
        self.log = log
        self.cut = 0  # requests still in flight at the deadline
        self._draining = False
        self._hurry = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def begin(self, sig: signal.Signals) -> None:
        if self._draining:
            self._hurry.set()  # a second signal: stop waiting
            return
        self._draining = True
        self.log.info(
            "proxy.stopping",
            signal=sig.name,
            in_flight=self.trail.open,
            drain_timeout_s=self.drain_timeout,
        )
        self._spawn(self._drain(), "drain")

    def reload(self, live: Any) -> None:
        self.log.info("proxy.reload_requested", signal="SIGHUP")
        self._spawn(live.poll(force=True), "reload")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        try:
            proxyserver: Any = self.master.addons.get("proxyserver")
            for server in list(proxyserver.servers):
                if server.is_running:
                    await server.stop()
            await self._wait(lambda: not self.trail.open, self.drain_timeout)
            self.cut = self.trail.open
            # Idle keep-alives, open tunnels and WebSockets, and whatever missed the deadline:
            # closed here, so their audit lines are written before proxy.stopped.
            for handler in list(proxyserver.connections.values()):
                io = handler.transports.get(handler.client)
                if io is not None and io.handler is not None:
                    io.handler.cancel("credproxy is stopping")
            # Not cut short by a second signal: the handlers are already cancelled, and their
            # own lines (audit, disconnects) must come before proxy.stopped.
            await self._wait(lambda: not proxyserver.connections, CLOSE_TIMEOUT, hurry=False)
        finally:
            self.master.shutdown()

    async def _wait(self, done: Any, timeout: float, hurry: bool = True) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done() and loop.time() < deadline and not (hurry and self._hurry.is_set()):
            await asyncio.sleep(DRAIN_POLL)


async def settle(timeout: float) -> None:
    """Cancel what still runs (pollers, a connection past the close deadline) and let it end.

    asyncio.run would cancel these after serve() returns, when their hooks' lines would come
    after proxy.stopped and find the store closed; here they end first.
    """
    current = asyncio.current_task()
    pending = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=timeout)
