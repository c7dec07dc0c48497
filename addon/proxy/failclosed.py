"""Fail closed: mitmproxy logs an exception raised in a hook and lets the flow through.

Every hook of every credproxy addon is wrapped: on the request side an exception denies
(internal-error), on the response side it kills the flow. `Denied` ends a hook with a
deny of a fixed reason; its `decision` says what the audit line calls it: a `deny`, a
`challenge` (407 to a request that offered no credentials) or an `error` (an upstream failure
found before forwarding, with its fixed `error` class).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from addon.core.reasons import Reason
from addon.observe import audit

if TYPE_CHECKING:
    from mitmproxy import http

F = TypeVar("F", bound=Callable[..., Any])


class Denied(Exception):
    """Raised inside a hook to answer the request from the proxy with a fixed reason and detail."""

    def __init__(
        self,
        reason: Reason,
        detail: str,
        extra: dict[str, Any] | None = None,
        *,
        decision: str = audit.DENY,
        error: str | None = None,
    ) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.detail = detail
        self.extra = extra or {}
        self.decision = decision
        self.error = error


class _Denies(Protocol):
    def deny(
        self,
        flow: http.HTTPFlow,
        reason: Reason,
        detail: str,
        extra: dict[str, Any] | None = None,
        *,
        decision: str = audit.DENY,
        error: str | None = None,
    ) -> None: ...


class _HasTrail(Protocol):
    trail: _Denies


def deny_on_error(hook: F) -> F:
    """A request-side hook: `Denied` denies with its reason, any other exception with
    internal-error, and if even the deny fails the flow is killed.

    The hook is a plain function that returns an awaitable when it has to wait (DNS, the
    store); the wrapper then returns one too, and mitmproxy awaits it. The common case
    makes no coroutine.
    """

    @functools.wraps(hook)
    def wrapper(self: _HasTrail, flow: http.HTTPFlow) -> Awaitable[None] | None:
        try:
            result = hook(self, flow)
        except Exception as e:  # noqa: BLE001 - the fail-closed wrapper: it denies
            _refuse(self, flow, hook, e)
            return None
        if result is None:
            return None
        return _awaited(self, flow, hook, result)

    return wrapper  # type: ignore[return-value]


async def _awaited(self: _HasTrail, flow: http.HTTPFlow, hook: Any, result: Any) -> None:
    try:
        await result
    except Exception as e:  # noqa: BLE001 - the fail-closed wrapper: it denies
        _refuse(self, flow, hook, e)


def _refuse(self: _HasTrail, flow: http.HTTPFlow, hook: Any, e: Exception) -> None:
    if isinstance(e, Denied):
        try:
            self.trail.deny(flow, e.reason, e.detail, e.extra, decision=e.decision, error=e.error)
            return
        except Exception as again:  # noqa: BLE001 - handled as any other failure below
            e = again
    audit.logger().error("hook.failed", hook=hook.__name__, error_type=type(e).__name__)
    try:
        self.trail.deny(flow, Reason.INTERNAL_ERROR, "internal error")
    except Exception:  # noqa: BLE001 - last resort: drop the connection
        flow.kill()


def kill_on_error(hook: F) -> F:
    """A response-side hook: the response was not vetted, so on any exception the flow dies."""

    @functools.wraps(hook)
    def wrapper(self: object, flow: http.HTTPFlow) -> None:
        try:
            hook(self, flow)
        except Exception as e:  # noqa: BLE001 - the fail-closed wrapper: it kills the flow
            audit.logger().error("hook.failed", hook=hook.__name__, error_type=type(e).__name__)
            flow.kill()

    return wrapper  # type: ignore[return-value]
