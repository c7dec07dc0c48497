"""One renewal loop for every credential value that expires: a minted token, a role's STS keys.

The first request that finds no usable value waits for a renewal; every request at the same
time waits for the same one (single flight). A value is renewed in the background ahead of
its expiry, for as long as requests use it: a session nobody used for IDLE seconds stops
renewing, and the next request renews first. After a failure the next attempt waits the
delay the kind chooses; while `_retry_at` lies ahead, a request is refused at once instead
of asking again (minted tokens back off so; a role retries every RETRY seconds and never
sets it). A closed session (its credential rotated or removed) is never renewed again.

Each kind says how a value is obtained (`_obtain`, dialling and calling in a thread), when
it stops being usable (`_usable`), and what a renewal or a failure logs, counts and waits
(`_renewed`, `_failed`).
"""

from __future__ import annotations

import asyncio
import time
from typing import ClassVar, Generic, TypeVar

IDLE = 900.0  # a value nobody used for this long is not renewed in the background

T = TypeVar("T")


class Unavailable(Exception):
    """No value that is still usable. `detail` says why, in words safe to show the agent;
    `error` is the audit line's error class."""

    def __init__(self, detail: str, error: str) -> None:
        super().__init__(detail)
        self.detail, self.error = detail, error


class Renewal(Generic[T]):
    """One credential's current value and the task renewing it."""

    error: ClassVar[str]  # the audit's error class when there is no usable value
    changed: ClassVar[str]  # the detail when the session was closed while a request waited
    # Whether the audit line shows how long a request waited for it (token_ms).
    timed: ClassVar[bool] = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.current: T | None = None
        self.closed = False
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._used = time.monotonic()
        self._retry_at = 0.0
        self._failure = ""  # the detail of the last failure, for requests refused meanwhile

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def now(self) -> T | None:
        """The value to use, if it is usable for a while yet (a request is using it)."""
        self._used = time.monotonic()
        return self._valid()

    def _valid(self) -> T | None:
        current = self.current
        if current is None or self.closed or not self._usable(current):
            return None
        return current

    async def ensure(self) -> T:
        """A usable value, renewed first if there is none. Raises: Unavailable."""
        if self.closed:
            raise Unavailable(self.changed, self.error)
        if self.now() is None:
            if time.monotonic() < self._retry_at:
                raise Unavailable(self._failure, self.error)  # the endpoint is not asked
            task = self._renewal()
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this request itself was cancelled
                raise Unavailable(self.changed, self.error) from None
        found = self.now()
        if found is None:
            raise Unavailable(self._failure, self.error)
        return found

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()

    def _renewal(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._renew())
        return self._task

    def _refresh(self) -> None:
        if not self.closed:
            self._renewal()

    async def _renew(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            fresh = await self._obtain()
        except Exception as e:  # noqa: BLE001 - the old value serves until it expires, then deny
            self._schedule(loop, self._failed(e))
            return
        self.current = fresh
        self._schedule(loop, self._renewed(fresh))

    def _schedule(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.closed and time.monotonic() - self._used < IDLE:
            self._timer = loop.call_later(delay, self._refresh)

    async def _obtain(self) -> T:
        """A fresh value, in the redaction set before it is returned. Raises on any failure."""
        raise NotImplementedError

    def _usable(self, value: T) -> bool:
        raise NotImplementedError

    def _renewed(self, fresh: T) -> float:
        """Log and count the fresh value (already current); the seconds until the next
        renewal."""
        raise NotImplementedError

    def _failed(self, e: Exception) -> float:
        """Log and count the failure; the seconds until the next attempt."""
        raise NotImplementedError
