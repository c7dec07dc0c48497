"""A worker process of `credproxy run --workers N`: what its supervisor told it, and how it
shares the supervisor's port and audit state."""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from addon.observe import audit
from store.errors import InvalidInput

WORKER_ENV = "CREDPROXY_WORKER"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Role:
    """What a worker process is told by its supervisor (CREDPROXY_WORKER, JSON)."""

    index: int
    port: int
    admin: str  # its admin listener, a Unix socket
    avoid: tuple[tuple[str, int], ...]  # the supervisor's admin listener: never a destination
    supervisor: int = 0  # the supervisor's pid

    @classmethod
    def from_env(cls) -> Role | None:
        text = os.environ.get(WORKER_ENV)
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(
                int(data["index"]),
                int(data["port"]),
                str(data["admin"]),
                tuple((str(h), int(p)) for h, p in data["avoid"]),
                int(data.get("supervisor", 0)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidInput(f"{WORKER_ENV} is not a worker's role") from e

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def bind_to_supervisor(self) -> None:
        """Die with the supervisor, even with this process hung: SIGKILL when it is gone
        (PR_SET_PDEATHSIG), so a stuck worker never outlives it holding the port.

        Raises: InvalidInput, when the supervisor is already gone.
        """
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            prctl = libc.prctl
        except (OSError, AttributeError):  # not Linux: the end of stdin still stops workers
            return
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise InvalidInput(f"cannot tie the worker to its supervisor: errno {errno}")
        if self.supervisor and os.getppid() != self.supervisor:
            raise InvalidInput("the worker's supervisor is gone")

    def share_port(self) -> None:
        """Let mitmproxy's listener join the supervisor's SO_REUSEPORT group."""
        # A worker's only: the supervisor never loads mitmproxy's servers.
        from mitmproxy.proxy import mode_servers

        instance: Any = mode_servers.AsyncioServerInstance
        if not callable(getattr(instance, "listen", None)):
            raise InvalidInput("mitmproxy changed: cannot share the listen port")

        async def listen(self: Any, host: str, port: int) -> list[asyncio.Server]:
            if self.mode.transport_protocol != "tcp":
                raise AssertionError(self.mode.transport_protocol)
            return [await asyncio.start_server(self.handle_stream, host, port, reuse_port=True)]

        instance.listen = listen

    def follow(self, stop: Callable[[signal.Signals], None]) -> None:
        """Take the supervisor's audit state from stdin; its end (the supervisor is gone) stops
        the worker."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()

        async def read() -> None:
            await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(0, "rb", 0)
            )
            while line := await reader.readline():
                audit.relay_state(line.decode("ascii", "replace").strip())
            audit.relay_state(audit.FAILING)
            stop(signal.SIGTERM)

        _TASKS.add(loop.create_task(read(), name="supervisor"))


_TASKS: set[asyncio.Task[None]] = set()
