"""The fixed reason codes: every deny, challenge and upstream failure names one, and the HTTP
status it is answered with. The same codes appear in responses, headers and audit lines."""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """Every deny reason; the same codes appear in responses, headers and audit lines."""

    AUTH_REQUIRED = "auth-required"
    NO_GRANT = "no-grant"
    METHOD_NOT_ALLOWED = "method-not-allowed"
    PATH_NOT_ALLOWED = "path-not-allowed"
    HOST_MISMATCH = "host-mismatch"
    INSECURE_SCHEME = "insecure-scheme"
    GRANT_EXPIRED = "grant-expired"
    GRANT_CONSUMED = "grant-consumed"
    BAD_REQUEST = "bad-request"
    DESTINATION_FORBIDDEN = "destination-forbidden"
    UPGRADE_NOT_ALLOWED = "upgrade-not-allowed"
    STORE_UNAVAILABLE = "store-unavailable"
    INTERNAL_ERROR = "internal-error"
    BODY_TOO_LARGE = "body-too-large"
    RATE_LIMITED = "rate-limited"
    BUDGET_EXHAUSTED = "budget-exhausted"  # a grant's token budget is spent for its window
    # Upstream failures: the grant allowed the request, the upstream did not answer usably.
    UPSTREAM_PROTOCOL_ERROR = "upstream-protocol-error"
    UPSTREAM_UNREACHABLE = "upstream-unreachable"
    UPSTREAM_UNRESOLVABLE = "upstream-unresolvable"
    UPSTREAM_TLS_ERROR = "upstream-tls-error"
    UPSTREAM_TIMEOUT = "upstream-timeout"
    # The upstream refused the client certificate (scheme mtls), or wanted one and got none.
    UPSTREAM_TLS_CLIENT_CERT_REFUSED = "upstream-tls-client-cert-refused"
    # The corporate proxy of `run --upstream-proxy` refused or failed the CONNECT.
    UPSTREAM_PROXY_REFUSED = "upstream-proxy-refused"
    UPSTREAM_PROXY_AUTH = "upstream-proxy-auth"
    AUDIT_UNAVAILABLE = "audit-unavailable"
    REQUEST_TOO_LARGE = "request-too-large"
    REQUEST_TIMEOUT = "request-timeout"
    TOO_MANY_CONNECTIONS = "too-many-connections"
    # Answers of credproxy.internal, the access-request endpoint.
    NOT_FOUND = "not-found"
    TOO_MANY_ACCESS_REQUESTS = "too-many-access-requests"
    SIGNING_UNSUPPORTED = "signing-unsupported"
    CREDENTIALS_IN_RESPONSE = "credentials-in-response"
    CREDENTIALS_UNAVAILABLE = "credentials-unavailable"
    # An mtls credential whose certificate has expired (or is not valid yet): never presented.
    CLIENT_CERT_EXPIRED = "client-cert-expired"
    # Requests held for an owner's approval (grant add --approval).
    APPROVAL_DENIED = "approval-denied"
    APPROVAL_TIMEOUT = "approval-timeout"
    TOO_MANY_HOLDS = "too-many-holds"
    CLIENT_GONE = "client-gone"
    # Grants with a body rule (GraphQL, MCP, JSON-RPC): what the body asks.
    OPERATION_NOT_ALLOWED = "operation-not-allowed"
    TOOL_NOT_ALLOWED = "tool-not-allowed"
    RPC_METHOD_NOT_ALLOWED = "rpc-method-not-allowed"
    BODY_UNDECIDABLE = "body-undecidable"


STATUS = {
    Reason.AUTH_REQUIRED: 407,
    Reason.BAD_REQUEST: 400,
    Reason.STORE_UNAVAILABLE: 503,
    Reason.INTERNAL_ERROR: 500,
    Reason.BODY_TOO_LARGE: 413,
    Reason.RATE_LIMITED: 429,
    Reason.BUDGET_EXHAUSTED: 429,
    Reason.UPSTREAM_PROTOCOL_ERROR: 502,
    Reason.UPSTREAM_UNREACHABLE: 502,
    Reason.UPSTREAM_UNRESOLVABLE: 502,
    Reason.UPSTREAM_TLS_ERROR: 502,
    Reason.UPSTREAM_TIMEOUT: 504,
    # 502, never 407: a 407 to the agent would read as credproxy's own challenge.
    Reason.UPSTREAM_PROXY_REFUSED: 502,
    Reason.UPSTREAM_PROXY_AUTH: 502,
    Reason.AUDIT_UNAVAILABLE: 503,
    Reason.REQUEST_TOO_LARGE: 431,
    Reason.REQUEST_TIMEOUT: 408,
    Reason.TOO_MANY_CONNECTIONS: 429,
    Reason.NOT_FOUND: 404,
    Reason.TOO_MANY_ACCESS_REQUESTS: 429,
    Reason.SIGNING_UNSUPPORTED: 400,
    Reason.CREDENTIALS_IN_RESPONSE: 502,
    Reason.CREDENTIALS_UNAVAILABLE: 502,
    Reason.UPSTREAM_TLS_CLIENT_CERT_REFUSED: 502,
    Reason.CLIENT_CERT_EXPIRED: 502,
    Reason.TOO_MANY_HOLDS: 429,
    Reason.CLIENT_GONE: 499,  # nobody reads it: the agent closed its connection
    # 400, not 415: most undecidable bodies are malformed or ambiguous (a syntax error, a
    # duplicate key, several operations and no operationName), and one code has one status.
    Reason.BODY_UNDECIDABLE: 400,
}
# The grant allowed the request and the upstream failed it: never a denial.
UPSTREAM_REASONS = frozenset(
    {
        Reason.UPSTREAM_PROTOCOL_ERROR,
        Reason.UPSTREAM_UNREACHABLE,
        Reason.UPSTREAM_UNRESOLVABLE,
        Reason.UPSTREAM_TLS_ERROR,
        Reason.UPSTREAM_TIMEOUT,
        Reason.UPSTREAM_PROXY_REFUSED,
        Reason.UPSTREAM_PROXY_AUTH,
        Reason.CREDENTIALS_UNAVAILABLE,
        Reason.UPSTREAM_TLS_CLIENT_CERT_REFUSED,
    }
)
