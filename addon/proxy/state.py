"""Where the addons keep what outlives one hook: per flow, per flow beside it, per connection.

A flow's `Record` lives in `flow.metadata` and holds no secret (mitmproxy serialises
metadata). What may hold one (the header scan with Proxy-Authorization, the policy, the
verdict's rule) waits in `STEPS`, beside the flow and keyed weakly, from the first request
addon to the last. Per-connection state is keyed weakly by mitmproxy's `Client` object:
it goes when mitmproxy lets the connection go, with nothing to clean by hand.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from addon.core.verdict import HeaderScan, Tunnel, Verdict

if TYPE_CHECKING:
    from mitmproxy import connection, http

    from addon.core.policy import Policy
    from addon.mitm import wire
    from addon.proxy.ratelimit import Limit

KEY = "credproxy"


@dataclass(slots=True)
class Record:
    """One request's audit line, filled in as the flow moves (in `flow.metadata[KEY]`)."""

    start: float
    request_id: str
    client: str
    principal: str | None = None
    method: str | None = None
    host: str | None = None
    port: int | None = None
    path: str | None = None
    allowed: bool = False  # a grant allowed it: its id and credential are below
    grant_id: int | None = None
    credential: str | None = None
    credential_fp: str | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    redactions: int = 0
    internal: bool = False
    buffered: bool = False
    streamed: bool = False  # the response head has gone to the agent
    failure: wire.Failure | None = None
    dns_ms: float | None = None  # how long the request waited for a name lookup
    token_ms: float | None = None  # how long it waited for a token to be minted
    token_fp: str | None = None  # the minted token stamped on it
    # Signed for a service that issues AWS keys (STS, IAM, ...): an answer holding keys is
    # refused, so that the agent never gets keys minted with the stored ones.
    minting: bool = False
    replaced: bool = False  # credproxy answered in the upstream's place
    approval: int | None = None  # the held request (its approval) that let it through
    # What a grant's body rule decided: operations, tools or methods, never their arguments.
    body: dict[str, Any] | None = None
    # A model call charged to a grant's budget (addon/proxy/budgets.py): None otherwise.
    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    tokens_estimated: bool = False
    cost_micros: int | None = None  # by the price table (`run --prices`), in micro-US dollars
    max_tokens: int | None = None  # the output limit it was forwarded with, capped (capping.py)


def record(flow: http.HTTPFlow) -> Record | None:
    found: Record | None = flow.metadata.get(KEY)
    return found


@dataclass(slots=True)
class Step:
    """What one request addon hands the next within `requestheaders` (may hold secrets)."""

    headers: HeaderScan
    principal: str
    tunnel: Tunnel | None
    policy: Policy
    verdict: Verdict | None = None
    limits: tuple[Limit, ...] = ()  # the principal's rate, looked at by the gate
    token: int | None = None  # which of the principal's tokens it came with (Policy.token_of)


STEPS: weakref.WeakKeyDictionary[http.HTTPFlow, Step] = weakref.WeakKeyDictionary()


@dataclass(slots=True)
class ClientState:
    """What one client connection to the proxy carries from request to request."""

    tunnel: Tunnel | None = None
    token: int = 0  # which of the principal's tokens authenticated the tunnel (policy.py)
    principal: str | None = None  # of its plain-proxy (absolute-form) requests
    broken: bool = False  # a TLS hook failed on it: every request is refused
    # dialled address -> the host name to use as upstream SNI
    upstream: dict[tuple[str, int], str] = field(default_factory=dict)


class Clients(weakref.WeakKeyDictionary["connection.Client", ClientState]):
    """Per-connection state, keyed weakly by mitmproxy's `Client` object."""

    def state(self, client: connection.Client) -> ClientState:
        """The connection's state, made on first use."""
        found = self.get(client)
        if found is None:
            found = self[client] = ClientState()
        return found

    def tunnel(self, client: connection.Client) -> Tunnel | None:
        found = self.get(client)
        return found.tunnel if found is not None else None
