"""Requests held for an owner's approval (grants with `--approval each|first`).

The forwarder calls `Holds.wait` after every check that can refuse a request and before a
use is spent or anything is dialled: a held request sends nothing upstream and spends
nothing until an owner approves it with `credproxy request approve ID`. The decision is
read from the store, so it may come from any machine and reaches the holding replica
within one poll.

One module, about 400 lines: holding, polling and settling a request are one protocol with
the store.
"""

from __future__ import annotations

import asyncio
import select
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from addon.core.policy import Rule
from addon.core.reasons import Reason
from addon.observe import audit
from addon.proxy import reading
from addon.proxy.failclosed import Denied
from store.errors import CredproxyError
from store.records import APPROVED, DENIED, PENDING

if TYPE_CHECKING:
    from mitmproxy import http

    from addon.observe.metrics import Metrics
    from addon.proxy.live import LivePolicy
    from addon.proxy.state import Record, Step

# How often the store is asked about the requests held here (one query for all of them), and
# their clients' connections are looked at.
POLL_INTERVAL = 0.25
GONE = "gone"  # the held request's client closed its connection: it must never be sent
# The peer closed (or half-closed) the connection, or it broke: seen while reading is paused.
_HUNG_UP = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


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
        self._waiters: dict[int, list[tuple[asyncio.Future[str], http.HTTPFlow]]] = {}
        self._poller: asyncio.Task[None] | None = None
        # Flows that waited for a decision (not those an approval covered at once).
        self.waited: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
        metrics.held = self.count

    def count(self) -> int:
        return sum(self._held.values())

    def done(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def wait(
        self, flow: http.HTTPFlow, step: Step, rec: Record, spent: str | None = None
    ) -> None:
        """Return once an owner approved the request; raise Denied otherwise. With `spent`
        (the grant's budget limits found spent) the request is held to go over its budget:
        never covered by an earlier approval, never sharing a decision with another."""
        v = step.verdict
        assert v is not None and v.rule is not None
        assert v.host is not None and v.port is not None
        assert v.method is not None and v.path is not None
        rule = v.rule
        now = datetime.now(UTC)
        operation = operation_of(rec.body)
        cover = step.policy.covering(
            rule.grant_id, v.method, v.host, v.port, v.path, now, operation
        )
        if spent is not None:
            cover = None
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
        keep = 0.0  # how long the place stays taken after the request is answered
        try:
            where = (v.host, v.port, v.method, v.path)
            request_id = await self._record(step, rule, where, operation, spent)
            rec.approval = request_id
            self.waited.add(flow)
            self.on_hold(flow)
            reading.pause(flow.client_conn)  # its body must not pile up here
            try:
                state = await self._decision(request_id, rule.hold, flow)
                if state == GONE:
                    await self._leave(request_id)
                    # A client that leaves keeps its place to the hold's end, as one that
                    # stayed would: connecting and leaving must not record (and notify)
                    # holds faster than the caps allow.
                    keep = max(0.0, started + rule.hold - time.monotonic())
            finally:
                reading.resume(flow.client_conn)
        finally:
            if keep:
                asyncio.get_running_loop().call_later(keep, self._release, principal)
            else:
                self._release(principal)
        self.metrics.hold_seconds.observe(time.monotonic() - started)
        asked = {"access_request": {"id": request_id, "state": state}}
        if state == GONE:
            self.metrics.holds.labels("gone").inc()
            raise Denied(Reason.CLIENT_GONE, "the client left while its request was held", asked)
        if state == APPROVED:
            self.metrics.holds.labels("approved").inc()
            self._still_granted(rule, principal, flow, step)
            await settle_reads(flow)
            if gone(flow):  # it left just before the approval was seen: never send it
                raise Denied(Reason.CLIENT_GONE, "the client left while its request was held")
            return
        if state == DENIED:
            self.metrics.holds.labels("denied").inc()
            raise Denied(Reason.APPROVAL_DENIED, "an owner denied this request", asked)
        self.metrics.holds.labels("timeout").inc()
        raise Denied(Reason.APPROVAL_TIMEOUT, f"no owner decided within {rule.hold} s", asked)

    def _release(self, principal: str) -> None:
        self._held[principal] -= 1
        if not self._held[principal]:
            del self._held[principal]

    async def _record(
        self,
        step: Step,
        rule: Rule,
        where: tuple[str, int, str, str],
        operation: str | None,
        spent: str | None,
    ) -> int:
        host, port, method, path = where
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
                rule.approval == "first" and spent is None,
                operation,
                spent,
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
        if operation is not None:
            event["operation"] = operation
        if spent is not None:
            event["spent"] = spent
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

    async def _leave(self, request_id: int) -> None:
        try:
            await self.live.call(self.live.store.leave_hold, request_id)
        except CredproxyError:
            pass  # its deadline still ends it; this request is refused either way

    async def _decision(self, request_id: int, hold: int, flow: http.HTTPFlow) -> str:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        waiting = self._waiters.setdefault(request_id, [])
        waiting.append((future, flow))
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        try:
            return await asyncio.wait_for(future, hold)
        except TimeoutError:
            pass
        finally:
            if (future, flow) in waiting:
                waiting.remove((future, flow))
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
            # First the clients (the store may be down): one that left is answered now.
            for waiting in list(self._waiters.values()):
                for future, flow in waiting:
                    # A stream reset is not read while the connection is paused: the
                    # socket is all there is to look at until the hold ends.
                    if not future.done() and gone(flow, streams=False):
                        future.set_result(GONE)
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
                for future, _ in self._waiters.pop(request_id, []):
                    if not future.done():
                        future.set_result(state)

    def _still_granted(self, rule: Rule, principal: str, flow: http.HTTPFlow, step: Step) -> None:
        """The grant may have gone or changed while the request waited (a policy file
        updates a grant in place), and the token it came with may have been revoked: both
        must still serve this request, as they are now."""
        v = step.verdict
        assert v is not None and v.host is not None and v.port is not None
        assert v.method is not None and v.path is not None
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
        if (
            current is None
            or principal not in policy.principals()
            or policy.owner(rule.grant_id) != principal
        ):
            raise Denied(Reason.NO_GRANT, "the grant was revoked while the request was held")
        if not current.allows_host(v.host, v.port, flow.request.scheme):
            raise Denied(Reason.NO_GRANT, "the grant no longer allows this host")
        if not current.allows_method(v.method):
            raise Denied(Reason.METHOD_NOT_ALLOWED, "the grant no longer allows this method")
        if current.longest_path(v.path) < 0:
            raise Denied(Reason.PATH_NOT_ALLOWED, "the grant no longer allows this path")
        if b"upgrade" in step.headers.index and not current.websocket:
            raise Denied(Reason.UPGRADE_NOT_ALLOWED, "the grant no longer allows an upgrade")
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


def gone(flow: http.HTTPFlow, streams: bool = True) -> bool:
    """Has the client of this held flow closed or broken its connection (or, with
    `streams`, reset its HTTP/2 stream)? Its reading is paused, so mitmproxy would only see
    that once it was sent: ask the socket."""
    try:
        transport = reading.transport(flow.client_conn, strict=True)
    except LookupError:
        return True  # its connection's handler is gone
    if transport is None:
        return False  # no master: a unit test calling hooks directly
    if transport.is_closing():
        return True
    sock = transport.get_extra_info("socket")
    fd = sock.fileno() if sock is not None else -1
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, _HUNG_UP)
    return bool(poller.poll(0)) or (streams and _stream_reset(flow))


async def settle_reads(flow: http.HTTPFlow) -> None:
    """After a hold, let mitmproxy read what the client sent meanwhile (an HTTP/2 stream
    reset waits in the socket while its reading is paused), so that `gone` can see it."""
    if not flow.request.is_http2:
        return
    transport = reading.transport(flow.client_conn)
    sock = transport.get_extra_info("socket") if transport is not None else None
    fd = sock.fileno() if sock is not None else -1
    if fd < 0:
        return
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    # The hook that waits keeps the connection paused (addon/proxy/chain.py): read it meanwhile.
    pauses = reading.lift(flow.client_conn)
    try:
        for _ in range(_SETTLE_ROUNDS):
            # Read, handed to the TLS and HTTP/2 layers, then queued at the held stream.
            for _ in range(3):
                await asyncio.sleep(0)
            if not poller.poll(0):
                return
    finally:
        reading.restore(flow.client_conn, pauses)


_SETTLE_ROUNDS = 16


def _stream_reset(flow: http.HTTPFlow) -> bool:
    """Did the client reset this flow's HTTP/2 stream while it was held? mitmproxy queues
    that at the stream's layer, which waits on the hook: look there."""
    if not flow.request.is_http2:
        return False
    # mitmproxy's ctx holds the running master: bound once it runs, read when used.
    from mitmproxy import ctx
    from mitmproxy.proxy.layers.http import HttpStream
    from mitmproxy.proxy.layers.http._events import RequestProtocolError

    try:
        proxyserver = ctx.master.addons.get("proxyserver")
        handler = proxyserver.connections.get(flow.client_conn.id)
    except AttributeError:
        return False
    if handler is None:
        return True
    stack: list[Any] = [handler.layer]
    seen: set[int] = set()
    while stack:
        layer = stack.pop()
        if layer is None or id(layer) in seen or len(seen) > _MAX_LAYERS:
            continue
        seen.add(id(layer))
        if isinstance(layer, HttpStream) and layer.flow is flow:
            queued = getattr(layer, "_paused_event_queue", ())
            return any(isinstance(e, RequestProtocolError) for e in queued)
        stack.extend(
            getattr(getattr(layer, name, None), "__self__", None)
            for name in ("_handle_event", "_handle")
        )
        stack.extend((getattr(layer, "layer", None), getattr(layer, "child_layer", None)))
        for name in ("streams", "connections"):
            children = getattr(layer, name, None)
            if isinstance(children, dict):
                stack.extend(children.values())
    return False


_MAX_LAYERS = 4096


def operation_of(body: dict[str, Any] | None) -> str | None:
    """What a request's body asked, in words an owner approves: `mutation addComment`,
    `tools/call search_issues`, `eth_call`. None without a body rule. Names only: a body rule's
    summary holds no argument or value."""
    if not body:
        return None
    parts: list[str] = []
    for kind, found in body.items():
        for item in found:
            if kind == "graphql":
                fields = ",".join(item.get("fields") or ())
                parts.append(f"{item.get('type')} {fields}".strip())
            elif kind == "mcp":
                target = item.get("tool") or item.get("resource") or item.get("prompt")
                parts.append(
                    f"{item.get('method')} {target}" if target else str(item.get("method"))
                )
            else:
                parts.append(str(item))
    return "; ".join(parts)[:500] or None
