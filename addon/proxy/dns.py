"""Name resolution for the destination guard: one lookup per name at a time, vetted answers kept.

Every answer is vetted by the guard when it arrives, and only a vetted address is ever
returned, so the address dialled is always one the guard permitted: a cached answer cannot
rebind. A fresh entry is used as it is. Past its TTL an entry is still served for one more TTL
while a single background lookup refreshes it, so requests on an open connection never wait
for DNS; past that, the request waits for the lookup. Failed lookups are kept briefly too
(negative caching), so a name that does not resolve costs one lookup, not one per request.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from addon.core.guard import DestinationGuard

Lookup = Callable[[str, int], Awaitable[list[str]]]

DEFAULT_TTL = 30.0
NEGATIVE_TTL = 2.0
LOOKUP_TIMEOUT = 5.0
MAX_ENTRIES = 4096
# getaddrinfo blocks a thread and cannot be cancelled; these threads serve only lookups, a
# name holds at most one of them (lookups are shared, and a timed-out one is not started
# again until its thread returns), and the store's threads are never taken.
LOOKUP_THREADS = 32

UNRESOLVABLE = "the host does not resolve"
FORBIDDEN = "the host resolves to a forbidden address"


class LookupFailed(Exception):
    """The name cannot be dialled; `detail` is one of the fixed messages above."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@dataclass(slots=True, frozen=True)
class _Entry:
    address: str | None  # the vetted address, or None for a failure
    failure: str | None
    fresh_until: float
    stale_until: float


@dataclass(slots=True)
class Stats:
    """Counters read by the metrics collector at scrape time."""

    lookups: int = 0
    hits: int = 0
    failures: int = 0
    lookup_seconds: float = 0.0


class Resolver:
    def __init__(
        self,
        guard: DestinationGuard,
        *,
        ttl: float = DEFAULT_TTL,
        negative_ttl: float = NEGATIVE_TTL,
        timeout: float = LOOKUP_TIMEOUT,
        max_entries: int = MAX_ENTRIES,
        lookup: Lookup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.guard = guard
        self.ttl = ttl
        self.negative_ttl = negative_ttl
        self.timeout = timeout
        self.max_entries = max_entries
        self.stats = Stats()
        self._lookup = lookup or _system_lookup
        self._clock = clock
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._inflight: dict[tuple[str, int], asyncio.Future[_Entry]] = {}
        # Names whose lookup timed out while its thread still waits on the resolver.
        self._hung: set[tuple[str, int]] = set()

    def reconfigure(self, guard: DestinationGuard) -> None:
        """A new guard judges answers differently: nothing vetted by the old one is kept."""
        self.guard = guard
        self._entries.clear()

    def cached(self, host: str, port: int) -> tuple[str, int] | None:
        """The vetted address if one serves without waiting (None: call `resolve`).

        Raises LookupFailed for a failure that is still cached.
        """
        key = (host, port)
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self._clock()
        if now < entry.fresh_until:
            self.stats.hits += 1
            if entry.address is None:
                assert entry.failure is not None
                raise LookupFailed(entry.failure)
            return entry.address, port
        if entry.address is not None and now < entry.stale_until:
            self.stats.hits += 1
            self._start(key)  # refresh in the background; this request dials the vetted one
            return entry.address, port
        return None

    async def resolve(self, host: str, port: int) -> tuple[tuple[str, int], float]:
        """The vetted address to dial, and how long this request waited for DNS (seconds).

        Raises LookupFailed when the name does not resolve or resolves to a forbidden address.
        """
        key = (host, port)
        now = self._clock()
        entry = self._entries.get(key)
        waited = 0.0
        if entry is not None and now < entry.fresh_until:
            self.stats.hits += 1
        elif entry is not None and entry.address is not None and now < entry.stale_until:
            self.stats.hits += 1
            self._start(key)  # refresh in the background; this request dials the vetted one
        else:
            entry = await asyncio.shield(self._start(key))
            waited = self._clock() - now
        if entry.address is None:
            assert entry.failure is not None
            raise LookupFailed(entry.failure)
        return (entry.address, port), waited

    def _start(self, key: tuple[str, int]) -> asyncio.Future[_Entry]:
        """The one lookup in flight for this name and port, started if there is none."""
        future = self._inflight.get(key)
        if future is None:
            future = self._inflight[key] = asyncio.ensure_future(self._refresh(key))
        return future

    async def _refresh(self, key: tuple[str, int]) -> _Entry:
        host, port = key
        start = self._clock()
        try:
            if key in self._hung:
                # The last lookup of this name still holds a thread: never a second one.
                entry = self._failed(UNRESOLVABLE)
                self._store(key, entry)
                return entry
            self.stats.lookups += 1
            lookup = asyncio.ensure_future(self._lookup(host, port))
            try:
                answers = await asyncio.wait_for(asyncio.shield(lookup), self.timeout)
            except TimeoutError:
                self._hung.add(key)
                lookup.add_done_callback(lambda done: self._unhang(key, done))
                entry = self._failed(UNRESOLVABLE)
            except (OSError, ValueError):
                entry = self._failed(UNRESOLVABLE)
            else:
                # Vetted by the guard of the moment the answers arrive, with no wait before
                # they are kept: a guard replaced during the lookup judges them.
                address = self.guard.vet(answers, port)
                if address is None:
                    entry = self._failed(FORBIDDEN)
                else:
                    entry = _Entry(str(address), None, start + self.ttl, start + 2 * self.ttl)
            self.stats.lookup_seconds += self._clock() - start
            self._store(key, entry)
            return entry
        finally:
            del self._inflight[key]

    def _failed(self, detail: str) -> _Entry:
        """A failure, remembered from the moment it is known (a timeout's end, not its start)."""
        self.stats.failures += 1
        until = self._clock() + self.negative_ttl
        return _Entry(None, detail, until, until)

    def _unhang(self, key: tuple[str, int], done: asyncio.Future[list[str]]) -> None:
        self._hung.discard(key)
        if not done.cancelled():
            done.exception()  # retrieved: a late failure is not reported as unhandled

    def _store(self, key: tuple[str, int], entry: _Entry) -> None:
        entries = self._entries
        entries.pop(key, None)
        while len(entries) >= self.max_entries:
            del entries[next(iter(entries))]  # the oldest answer goes first
        entries[key] = entry


_executor: ThreadPoolExecutor | None = None


async def _system_lookup(host: str, port: int) -> list[str]:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="credproxy-dns")
    loop = asyncio.get_running_loop()
    answers = await loop.run_in_executor(
        _executor, lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    )
    return [str(info[4][0]) for info in answers]
