"""credproxy's own answers: one RFC 9457 problem document for every response the proxy writes.

Denials, challenges, limits, upstream failures, the pages that replace mitmproxy's and the
errors of credproxy.internal are all built here, so the agent reads one shape everywhere:
`type`, `title`, `status`, `detail`, then credproxy's `error`, `reason` and, where known,
`request_id` (the audit line's) and the access-request fields. Nothing in it comes from
upstream bytes: callers pass a fixed detail.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mitmproxy import http
from mitmproxy.net.http import http1

from addon.core.reasons import STATUS, UPSTREAM_REASONS, Reason

CONTENT_TYPE = "application/problem+json"
# Not dereferenceable (RFC 9457, 3.1.1 allows that): the README's Deny reasons table defines them.
TYPE_PREFIX = "urn:credproxy:reason:"
CHALLENGE = 'Basic realm="credproxy"'

# The `error` member: what kind of answer this is, the same for every reason of a kind.
DENIED, CHALLENGED, UPSTREAM_FAILED = "denied", "challenge", "upstream-failed"

TITLES = {
    Reason.AUTH_REQUIRED: "Proxy authentication required",
    Reason.NO_GRANT: "No grant for this host",
    Reason.METHOD_NOT_ALLOWED: "Method not allowed",
    Reason.PATH_NOT_ALLOWED: "Path not allowed",
    Reason.HOST_MISMATCH: "Destination mismatch",
    Reason.INSECURE_SCHEME: "Credentials only over https",
    Reason.GRANT_EXPIRED: "Grant expired",
    Reason.GRANT_CONSUMED: "Grant already used",
    Reason.BAD_REQUEST: "Bad request",
    Reason.DESTINATION_FORBIDDEN: "Destination forbidden",
    Reason.UPGRADE_NOT_ALLOWED: "Upgrade not allowed",
    Reason.STORE_UNAVAILABLE: "Store unavailable",
    Reason.INTERNAL_ERROR: "Internal error",
    Reason.BODY_TOO_LARGE: "Body too large",
    Reason.UPSTREAM_PROTOCOL_ERROR: "Upstream answer unusable",
    Reason.UPSTREAM_UNREACHABLE: "Upstream unreachable",
    Reason.UPSTREAM_UNRESOLVABLE: "Upstream name does not resolve",
    Reason.UPSTREAM_TLS_ERROR: "Upstream TLS failed",
    Reason.UPSTREAM_TIMEOUT: "Upstream timed out",
    Reason.UPSTREAM_PROXY_REFUSED: "Upstream proxy refused the connection",
    Reason.UPSTREAM_PROXY_AUTH: "Upstream proxy refused credproxy's credentials",
    Reason.AUDIT_UNAVAILABLE: "Audit stream unavailable",
    Reason.REQUEST_TOO_LARGE: "Request head too large",
    Reason.REQUEST_TIMEOUT: "Request timed out",
    Reason.TOO_MANY_CONNECTIONS: "Too many connections",
    Reason.NOT_FOUND: "Not found",
    Reason.TOO_MANY_ACCESS_REQUESTS: "Too many pending access requests",
    Reason.RATE_LIMITED: "Rate limited",
    Reason.BUDGET_EXHAUSTED: "Token budget spent",
    Reason.SIGNING_UNSUPPORTED: "Request cannot be signed",
    Reason.CREDENTIALS_IN_RESPONSE: "Upstream answer carried credentials",
    Reason.CREDENTIALS_UNAVAILABLE: "Credentials unavailable",
    Reason.UPSTREAM_TLS_CLIENT_CERT_REFUSED: "Upstream refused the client certificate",
    Reason.CLIENT_CERT_EXPIRED: "Client certificate expired",
    Reason.APPROVAL_DENIED: "Denied by an owner",
    Reason.APPROVAL_TIMEOUT: "No owner's decision in time",
    Reason.TOO_MANY_HOLDS: "Too many requests held for approval",
    Reason.CLIENT_GONE: "The client left while its request was held",
    Reason.OPERATION_NOT_ALLOWED: "GraphQL operation not allowed",
    Reason.TOOL_NOT_ALLOWED: "MCP tool, resource or prompt not allowed",
    Reason.RPC_METHOD_NOT_ALLOWED: "JSON-RPC method not allowed",
    Reason.BODY_UNDECIDABLE: "Request body cannot be decided",
}


@dataclass(frozen=True, slots=True)
class Problem:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]  # content-length included
    body: bytes

    def response(self) -> http.Response:
        return http.Response.make(self.status, self.body, list(self.headers))

    def http1(self) -> bytes:
        """The whole HTTP/1.1 response, for layers that write bytes themselves."""
        return bytes(http1.assemble_response(self.response()))


def problem(
    reason: Reason,
    detail: str,
    *,
    status: int | None = None,
    error: str | None = None,
    request_id: str | None = None,
    extra: dict[str, Any] | None = None,
    close: bool = False,
) -> Problem:
    """The answer for `reason`; `error` defaults to the reason's kind (denied/upstream-failed)."""
    status = status or STATUS.get(reason, 403)
    if error is None:
        error = UPSTREAM_FAILED if reason in UPSTREAM_REASONS else DENIED
    document: dict[str, Any] = {
        "type": TYPE_PREFIX + reason.value,
        "title": TITLES[reason],
        "status": status,
        "detail": detail,
        "error": error,
        "reason": reason.value,
    }
    if request_id is not None:
        document["request_id"] = request_id
    if extra:
        document.update(extra)
    body = json.dumps(document).encode()
    headers = [
        (b"content-type", CONTENT_TYPE.encode()),
        (b"x-credproxy-reason", reason.value.encode()),
    ]
    if reason is Reason.AUTH_REQUIRED:
        headers.append((b"proxy-authenticate", CHALLENGE.encode()))
    if extra and "retry_after" in extra:
        headers.append((b"retry-after", str(extra["retry_after"]).encode()))
    if close:
        headers.append((b"connection", b"close"))
    headers.append((b"content-length", str(len(body)).encode()))
    return Problem(status, tuple(headers), body)
