"""Fail closed: mitmproxy logs an exception raised in a hook and lets the flow through.

Every hook of every credproxy addon is wrapped: on the request side an exception denies
(internal-error), on the response side it kills the flow. `Denied` ends a hook with a
deny of a fixed reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from addon import audit
from addon.policy import Reason

if TYPE_CHECKING:
    from mitmproxy import http

F = TypeVar("F", bound=Callable[..., Any])


class Denied(Exception):
    """Raised inside a hook to end it with a deny; carries a fixed reason and detail."""

    def __init__(self, reason: Reason, detail: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.detail = detail
        self.extra = extra or {}


class _Denies(Protocol):
    def deny(
        self,
        flow: http.HTTPFlow,
        reason: Reason,
        detail: str,
        extra: dict[str, Any] | None = None,
    ) -> None: ...


class _HasTrail(Protocol):
    trail: _Denies


def deny_on_error(hook: F) -> F:
    """A request-side hook: `Denied` denies with its reason, any other exception with
    internal-error, and if even the deny fails the flow is killed."""

    @functools.wraps(hook)
    async def wrapper(self: _HasTrail, flow: http.HTTPFlow) -> None:
        try:
            result = hook(self, flow)
            if result is not None:
                await result
        except Denied as d:
            self.trail.deny(flow, d.reason, d.detail, d.extra)
        except Exception as e:  # noqa: BLE001 - the fail-closed wrapper: it denies
            audit.logger().error("hook.failed", hook=hook.__name__, error_type=type(e).__name__)
            try:
                self.trail.deny(flow, Reason.INTERNAL_ERROR, "internal error")
            except Exception:  # noqa: BLE001 - last resort: drop the connection
                flow.kill()

    return wrapper  # type: ignore[return-value]


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
