"""`credproxy run --notify URL`: new access requests and held requests posted to a webhook.

Events go through a bounded queue to one sender task: a request never waits for the webhook,
and one that fails or hangs only delays or drops notifications (counted). The webhook is
dialled like an upstream (--resolve, or a lookup the destination guard vetted) over verified
TLS, through the corporate proxy of --upstream-proxy as the requests are. A payload holds
what the audit line of the event holds: never a secret, a token or a query string.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import certifi

from addon.mitm.via import ProxyFailed, Route
from addon.observe import audit
from addon.proxy.dns import LookupFailed
from store.errors import InvalidInput
from store.rules.grammar import parse_authority

if TYPE_CHECKING:
    from addon.observe.metrics import Metrics

QUEUE_SIZE = 256  # events waiting to be sent; beyond it they are dropped and counted
ATTEMPTS = 3
TIMEOUT = 5.0  # per attempt: connect, TLS, request and the answer's status line
BACKOFF = 1.0  # seconds before the second attempt, doubled for each later one
MAX_STATUS_LINE = 8 * 1024

Dial = Callable[[str, int], Awaitable[tuple[str, int]]]


@dataclass(frozen=True)
class Webhook:
    """Where events go: an https URL, parsed once at start."""

    host: str
    port: int
    target: str  # path and query, as given

    @classmethod
    def parse(cls, url: str) -> Webhook:
        """Raises: InvalidInput, naming the flag but never the URL (it may hold a token)."""
        try:
            parts = urlsplit(url)
            host, port = parse_authority(parts.netloc)
        except (ValueError, InvalidInput) as e:
            raise InvalidInput("invalid --notify URL: use https://HOST[:PORT]/PATH") from e
        if parts.scheme != "https" or "@" in parts.netloc or parts.fragment:
            raise InvalidInput("invalid --notify URL: use https://HOST[:PORT]/PATH")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if any(ord(c) < 0x21 or ord(c) > 0x7E for c in target):
            raise InvalidInput("invalid --notify URL: use https://HOST[:PORT]/PATH")
        return cls(host, port or 443, target)


def payload(event: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A Slack-compatible body (`text`), with the event's fields beside it."""
    where = f"{fields['method']} {fields['host']}:{fields['port']}{fields['path']}"
    if event == "budget_request.recorded":
        text = (
            f"credproxy: {fields['principal']}'s grant {fields['grant_id']} has spent its budget "
            f"({fields['spent']}) at {where}: credproxy request approve {fields['id']} "
            "--budget KIND=TOKENS/WINDOW (or deny)"
        )
    elif event == "approval.pending" and "spent" in fields:
        text = (
            f"credproxy: {fields['principal']} waits to go over grant {fields['grant_id']}'s "
            f"spent budget ({fields['spent']}) with {where} (held up to {fields['hold_s']} s): "
            f"credproxy request approve {fields['id']} lets this one request go (or deny)"
        )
    elif event == "approval.pending":
        text = (
            f"credproxy: {fields['principal']} waits for approval of {where} (grant "
            f"{fields['grant_id']}, held up to {fields['hold_s']} s): credproxy request approve "
            f"{fields['id']} (or deny)"
        )
    else:
        text = (
            f"credproxy: {fields['principal']} asks for access to {where}: credproxy request "
            f"approve {fields['id']} (or deny)"
        )
    return {"text": text, "event": event, **fields}


class Notifier:
    def __init__(
        self,
        webhook: Webhook,
        dial: Dial,
        metrics: Metrics,
        cafile: str | None = None,
        *,
        queue_size: int = QUEUE_SIZE,
        attempts: int = ATTEMPTS,
        timeout: float = TIMEOUT,
        backoff: float = BACKOFF,
        route: Route | None = None,
    ) -> None:
        self.webhook = webhook
        self.route = route  # the corporate proxy, if there is one
        self.dial = dial
        self.metrics = metrics
        self.attempts = attempts
        self.timeout = timeout
        self.backoff = backoff
        self.log = audit.logger()
        self._context = ssl.create_default_context(cafile=cafile or certifi.where())
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(queue_size)
        self._sender: asyncio.Task[None] | None = None

    def running(self) -> None:
        self._sender = asyncio.get_running_loop().create_task(self._send_forever())

    def done(self) -> None:
        if self._sender is not None:
            self._sender.cancel()

    def post(self, event: str, fields: dict[str, Any]) -> None:
        """Queue an event; never waits, never raises for a full queue (the event is dropped)."""
        body = json.dumps(payload(event, fields)).encode()
        try:
            self._queue.put_nowait(body)
        except asyncio.QueueFull:
            self.metrics.notifications.labels("dropped").inc()

    async def _send_forever(self) -> None:
        while True:
            body = await self._queue.get()
            try:
                await self._deliver(body)
            except Exception as e:  # noqa: BLE001 - the sender must outlive one bad event
                self.metrics.notifications.labels("failed").inc()
                self.log.error("hook.failed", hook="notify", error_type=type(e).__name__)

    async def _deliver(self, body: bytes) -> None:
        error = "error"
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                status = await asyncio.wait_for(self._send(body), self.timeout)
            except (OSError, TimeoutError, LookupFailed, ValueError, ProxyFailed) as e:
                error = type(e).__name__
                continue
            if 200 <= status < 300:
                self.metrics.notifications.labels("sent").inc()
                return
            error = f"status {status}"
        self.metrics.notifications.labels("failed").inc()
        self.log.warning(
            "notify.failed", host=self.webhook.host, attempts=self.attempts, error=error
        )

    async def _send(self, body: bytes) -> int:
        """One POST; the answer's status code. Raises on any failure."""
        hook = self.webhook
        address = await self.dial(hook.host, hook.port)  # vetted, through a proxy or not
        if self.route is not None and not self.route.direct(hook.host, address):
            opened = self.route.open(hook.host, hook.port, self._context, self.timeout)
            reader, writer = await opened
        else:
            reader, writer = await asyncio.open_connection(
                address[0], address[1], ssl=self._context, server_hostname=hook.host
            )
        try:
            authority = hook.host if hook.port == 443 else f"{hook.host}:{hook.port}"
            head = (
                f"POST {hook.target} HTTP/1.1\r\nHost: {authority}\r\n"
                "Content-Type: application/json\r\nUser-Agent: credproxy\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("ascii") + body)
            await writer.drain()
            line = await reader.readline()
            if len(line) > MAX_STATUS_LINE:
                raise ValueError("status line too long")
            version, _, rest = line.partition(b" ")
            code = rest[:3]
            if not version.startswith(b"HTTP/1.") or not code.isdigit():
                raise ValueError("not an HTTP answer")
            return int(code)
        finally:
            writer.close()
