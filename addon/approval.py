"""Requests held for an owner's approval (grants with `--approval each|first`).

The forwarder calls `Holds.wait` after every check that can refuse a request and before a
use is spent or anything is dialled: a held request sends nothing upstream and spends
nothing until an owner approves it with `credproxy request approve ID`. The decision is
read from the store, so it may come from any machine and reaches the holding replica
within one poll.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from addon import audit
from addon.failclosed import Denied
from addon.policy import Reason, Rule
from store.errors import CredproxyError
from store.records import APPROVED, DENIED, PENDING

if TYPE_CHECKING:
    from mitmproxy import connection, http

    from addon.live import LivePolicy
    from addon.metrics import Metrics
    from addon.state import Record, Step

# How often the store is asked about the requests held here (one query for all of them).
POLL_INTERVAL = 0.25


@dataclass(frozen=True)
class HoldSettings:
    total: int = 256  # requests held at once on this replica
    per_principal: int = 8


class Holds:
    def __init__(
        self,
        live: LivePolicy,
        metrics: Metrics,
        settings: HoldSettings = HoldSettings(),
        poll_interval: float = POLL_INTERVAL,
    ) -> None:
        self.live = live
        self.metrics = metrics
        self.settings = settings
        self.poll_interval = poll_interval
        self.log = audit.logger()
        # Called with a flow as it starts to wait: the limits addon suspends its head deadline.
        self.on_hold: Callable[[http.HTTPFlow], None] = lambda flow: None
        # Called with each new held request's event and fields (the notifier).
        self.notify: Callable[[str, dict[str, Any]], None] = lambda event, fields: None
        self._held: dict[str, int] = {}  # principal -> requests held now
        self._waiters: dict[int, list[asyncio.Future[str]]] = {}
        self._poller: asyncio.Task[None] | None = None
        self._paused: weakref.WeakKeyDictionary[connection.Client, int] = (
            weakref.WeakKeyDictionary()
        )
        metrics.held = self.count

    def count(self) -> int:
        return sum(self._held.values())

    def done(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def wait(self, flow: http.HTTPFlow, step: Step, rec: Record) -> None:
        """Return once an owner approved the request; raise Denied otherwise."""
        v = step.verdict
        assert v is not None and v.rule is not None
        assert v.host is not None and v.port is not None
        assert v.method is not None and v.path is not None
        rule = v.rule
        now = datetime.now(UTC)
        cover = step.policy.covering(rule.grant_id, v.method, v.host, v.port, v.path, now)
        if cover is not None and (not cover.counted or await self._spend(cover.id)):
            rec.approval = cover.id
            return
        principal = step.principal
        if self.count() >= self.settings.total:
            raise Denied(Reason.TOO_MANY_HOLDS, "too many requests are held for approval")
        if self._held.get(principal, 0) >= self.settings.per_principal:
            raise Denied(
                Reason.TOO_MANY_HOLDS,
                f"this principal has {self.settings.per_principal} requests held for approval",
            )
        if not self.live.store_up:
            raise Denied(Reason.STORE_UNAVAILABLE, "held requests need the store")
        self._held[principal] = self._held.get(principal, 0) + 1
        started = time.monotonic()
        try:
            request_id = await self._record(step, rule, v.host, v.port, v.method, v.path)
            rec.approval = request_id
            self.on_hold(flow)
            self._pause(flow)
            try:
                state = await self._decision(request_id, rule.hold)
            finally:
                self._resume(flow)
        finally:
            self._held[principal] -= 1
            if not self._held[principal]:
                del self._held[principal]
        self.metrics.hold_seconds.observe(time.monotonic() - started)
        asked = {"access_request": {"id": request_id, "state": state}}
        if state == APPROVED:
            self.metrics.holds.labels("approved").inc()
            self._still_granted(rule, step)
            return
        if state == DENIED:
            self.metrics.holds.labels("denied").inc()
            raise Denied(Reason.APPROVAL_DENIED, "an owner denied this request", asked)
        self.metrics.holds.labels("timeout").inc()
        raise Denied(Reason.APPROVAL_TIMEOUT, f"no owner decided within {rule.hold} s", asked)

    async def _record(
        self, step: Step, rule: Rule, host: str, port: int, method: str, path: str
    ) -> int:
        try:
            request_id, created = await self.live.call(
                self.live.store.hold_request,
                step.principal,
                rule.grant_id,
                host,
                port,
                method,
                path,
                rule.hold,
                rule.approval == "first",
            )
        except CredproxyError as e:
            raise Denied(Reason.STORE_UNAVAILABLE, "the store did not answer") from e
        event = {
            "id": request_id,
            "principal": step.principal,
            "grant_id": rule.grant_id,
            "host": host,
            "port": port,
            "method": method,
            "path": path,
            "hold_s": rule.hold,
        }
        self.log.info("approval.pending", **event)
        if created:
            self.notify("approval.pending", event)
        return request_id

    async def _spend(self, request_id: int) -> bool:
        """One request of an approval counted with --next; False once they are spent."""
        try:
            return await self.live.call(self.live.store.use_approval, request_id)
        except CredproxyError as e:
            raise Denied(Reason.STORE_UNAVAILABLE, "the store did not answer") from e

    async def _decision(self, request_id: int, hold: int) -> str:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        waiting = self._waiters.setdefault(request_id, [])
        waiting.append(future)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        try:
            return await asyncio.wait_for(future, hold)
        except TimeoutError:
            pass
        finally:
            if future in waiting:
                waiting.remove(future)
            if not waiting:
                self._waiters.pop(request_id, None)
        # Expire it, unless a decision landed first: that one stands.
        try:
            return await self.live.call(self.live.store.settle_hold, request_id)
        except CredproxyError:
            return "expired"

    async def _poll(self) -> None:
        while self._waiters:
            await asyncio.sleep(self.poll_interval)
            ids = list(self._waiters)
            try:
                found = await self.live.call(self.live.store.hold_states, ids)
            except CredproxyError:
                continue  # held requests wait on; their deadline still ends them
            except Exception as e:  # noqa: BLE001 - the poller must live; holds time out
                self.log.error("hook.failed", hook="holds.poll", error_type=type(e).__name__)
                continue
            for request_id, state in found.items():
                if state == PENDING:
                    continue
                for future in self._waiters.pop(request_id, []):
                    if not future.done():
                        future.set_result(state)

    def _still_granted(self, rule: Rule, step: Step) -> None:
        """The grant, or the token the request came with, may have gone while the request
        waited: both must still serve it."""
        policy = self.live.current()
        if policy is None:
            raise Denied(Reason.STORE_UNAVAILABLE, "the policy is stale")
        now = datetime.now(UTC)
        principal = step.principal
        if step.token is not None and not policy.token_live(principal, step.token, now):
            raise Denied(
                Reason.AUTH_REQUIRED, "the token was revoked or expired while the request was held"
            )
        current = policy.rule(rule.grant_id)
        if current is None or principal not in policy.principals():
            raise Denied(Reason.NO_GRANT, "the grant was revoked while the request was held")
        if current.expires_at is not None and current.expires_at <= now:
            raise Denied(Reason.GRANT_EXPIRED, "the grant expired while the request was held")
        if current.consumed:
            raise Denied(Reason.GRANT_CONSUMED, "this grant was already used up")
        was = rule.credential.fingerprint if rule.credential else None
        now_fp = current.credential.fingerprint if current.credential else None
        if was != now_fp:
            raise Denied(
                Reason.APPROVAL_DENIED, "the grant's credential changed while the request was held"
            )

    # A held request's body must not pile up in the proxy: its connection is not read while
    # it waits (the socket's buffers fill, then the client's writes block).

    def _pause(self, flow: http.HTTPFlow) -> None:
        transport = _transport(flow.client_conn)
        if transport is None:
            return
        client = flow.client_conn
        count = self._paused.get(client, 0)
        if count == 0:
            transport.pause_reading()
            # asyncio's StreamReader resumes a transport it paused itself once its buffer
            # drains: it must not resume ours.
            transport.resume_reading = _stay_paused
        self._paused[client] = count + 1

    def _resume(self, flow: http.HTTPFlow) -> None:
        client = flow.client_conn
        count = self._paused.get(client, 0)
        if count == 0:
            return
        if count > 1:
            self._paused[client] = count - 1
            return
        del self._paused[client]
        transport = _transport(client)
        if transport is None:
            return
        transport.__dict__.pop("resume_reading", None)
        if not transport.is_closing():
            transport.resume_reading()


def _stay_paused() -> None:
    pass


def _transport(client: connection.Client) -> Any:
    from mitmproxy import ctx

    try:
        proxyserver = ctx.master.addons.get("proxyserver")
    except AttributeError:  # no master: a unit test calling hooks directly
        return None
    handler = proxyserver.connections.get(client.id) if proxyserver is not None else None
    io = handler.transports.get(client) if handler is not None else None
    writer = io.writer if io is not None else None
    return getattr(writer, "transport", None)
