"""What the store checks before it writes: one place, messages that name no CLI flag.

A message names the operator's inputs as {placeholders} of InvalidInput (host, method,
credential, path, header, param, scheme), which the CLI words as its own flags.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from store.crypto import Secret
from store.errors import InvalidInput
from store.grammar import (
    HostPattern,
    parse_host,
    parse_rate,
    validate_header_name,
    validate_method,
    validate_param_name,
    validate_path_pattern,
)
from store.models import utcnow
from store.records import REQUEST_STATES

SCHEMES = ("bearer", "header", "basic", "query")
MAX_REQUEST_PATH = 2048
MAX_REQUEST_TEXT = 1000


def hosts(patterns: Sequence[str]) -> list[HostPattern]:
    return sorted({parse_host(h) for h in patterns}, key=lambda p: (p.host, p.port or 0))


def credential_hosts(patterns: Sequence[str]) -> list[HostPattern]:
    parsed = hosts(patterns)
    if not parsed:
        raise InvalidInput("a credential needs at least one {host}", host="host")
    return parsed


def scheme_options(
    scheme: str, header_name: str | None, param_name: str | None
) -> tuple[str | None, str | None]:
    if scheme not in SCHEMES:
        raise InvalidInput(f"invalid scheme {scheme!r}: use one of {', '.join(SCHEMES)}")
    if (scheme == "header") != (header_name is not None):
        raise InvalidInput(
            "{header} goes with {scheme} header, and only with it",
            header="a header name",
            scheme="scheme",
        )
    if (scheme == "query") != (param_name is not None):
        raise InvalidInput(
            "{param} goes with {scheme} query, and only with it",
            param="a parameter name",
            scheme="scheme",
        )
    if header_name is not None:
        validate_header_name(header_name)
    if param_name is not None:
        validate_param_name(param_name)
    return header_name, param_name


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def env_name(name: str) -> str:
    """A variable name for a placeholder: letters, digits and `_`, not starting with a digit."""
    if not _ENV_NAME.fullmatch(name):
        raise InvalidInput(
            "invalid {placeholder_env} {name!r}", placeholder_env="variable name", name=name
        )
    return name


def secret(scheme: str, value: Secret) -> None:
    plain = value.reveal()
    if not plain:
        raise InvalidInput("the secret is empty")
    # A CR or LF in a header value would let the secret split the request.
    if any(b < 0x20 or b == 0x7F for b in plain):
        raise InvalidInput("the secret contains control characters")
    if scheme in ("bearer", "header") and not plain.isascii():
        raise InvalidInput("a header secret must be ASCII")
    if scheme == "basic" and b":" not in plain:
        raise InvalidInput("a basic secret must be user:password")


@dataclass(frozen=True)
class GrantSpec:
    methods: list[str]
    paths: list[str]
    hosts: list[HostPattern]
    expires_at: datetime | None


MAX_BURST = 1_000_000_000


@dataclass(frozen=True)
class Limits:
    """A rate (as written) with its burst, and a use count; each None when not set."""

    rate: str | None = None
    burst: int | None = None
    max_uses: int | None = None


NO_LIMITS = Limits()


def limits(
    rate: str | None, burst: int | None, max_uses: int | None = None, once: bool = False
) -> Limits:
    if rate is not None:
        parse_rate(rate)
    if burst is not None:
        if rate is None:
            raise InvalidInput("{burst} goes with {rate}", burst="a burst", rate="a rate")
        if not 1 <= burst <= MAX_BURST:
            raise InvalidInput(f"invalid {{burst}} {burst}: 1 to {MAX_BURST}", burst="burst")
    if max_uses is not None:
        if once:
            raise InvalidInput(
                "{once} is {max_uses} 1: give one of them", once="once", max_uses="max-uses"
            )
        if not 1 <= max_uses <= MAX_BURST:
            raise InvalidInput(
                f"invalid {{max_uses}} {max_uses}: 1 to {MAX_BURST}", max_uses="max-uses"
            )
    return Limits(rate, burst, max_uses)


def grant_spec(
    methods: Sequence[str],
    host_patterns: Sequence[str],
    paths: Sequence[str],
    expires_at: datetime | None,
) -> GrantSpec:
    if not methods:
        raise InvalidInput("a grant needs at least one {method} (or '*')", method="method")
    method_list = sorted({validate_method(m) for m in methods})
    if "*" in method_list and len(method_list) > 1:
        raise InvalidInput("{method} '*' already allows every method", method="method")
    path_list = sorted({validate_path_pattern(p) for p in paths}) or ["/"]
    patterns = hosts(host_patterns)
    if expires_at is not None and expires_at <= utcnow():
        raise InvalidInput("the grant's expiry is in the past")
    return GrantSpec(method_list, path_list, patterns, expires_at)


def within_credential(spec: GrantSpec, credential: str | None, its_hosts: Sequence[str]) -> None:
    """A grant's hosts must lie within its credential's; without one it must name some."""
    if credential is None:
        if not spec.hosts:
            raise InvalidInput(
                "a grant without {credential} needs at least one {host}",
                credential="a credential",
                host="host",
            )
        return
    allowed = [parse_host(h) for h in its_hosts]
    for pattern in spec.hosts:
        if not any(a.covers(pattern) for a in allowed):
            raise InvalidInput(
                f"host {pattern} is outside credential {credential!r}'s hosts "
                f"({', '.join(its_hosts)})"
            )


def request(
    host: str, port: int, method: str, path: str, purpose: str | None, explicit: bool
) -> None:
    """An access request as the proxy passes it on from an agent."""
    if validate_method(method) == "*":
        raise InvalidInput("an access request names one method, not '*'")
    if not 0 < port < 65536:
        raise InvalidInput(f"invalid port {port}")
    # The path and purpose come from the agent and end up on the owner's terminal.
    if (
        not path.startswith("/")
        or len(path) > MAX_REQUEST_PATH
        or not (path.isascii() and path.isprintable())
        or " " in path
    ):
        raise InvalidInput(
            f"invalid path: must start with '/', be printable ASCII without spaces, "
            f"and be at most {MAX_REQUEST_PATH} characters"
        )
    if purpose is not None:
        text("purpose", purpose)
    if explicit:
        # The proxy has already normalised the host of a denied request; an asked-for one
        # is the agent's own text.
        pattern = parse_host(f"[{host}]" if ":" in host else host)
        if pattern.wildcard or pattern.port is not None or pattern.host != host:
            raise InvalidInput(f"invalid host {host!r}: name one host, without port or wildcard")


def approvable_path(request_id: int, path: str) -> None:
    """A requested path approved as it stands must not widen into a pattern."""
    if "*" in path.split("/"):
        raise InvalidInput(
            "request {id}'s path {requested} has a '*' segment, which a grant reads as any "
            "segment: approve it with {path}",
            id=str(request_id),
            requested=path,
            path="a path pattern",
        )


def request_state(state: str) -> str:
    if state not in REQUEST_STATES:
        raise InvalidInput(f"invalid state {state!r}: use one of {', '.join(REQUEST_STATES)}")
    return state


def text(what: str, value: str) -> None:
    if len(value) > MAX_REQUEST_TEXT or not value.isprintable():
        raise InvalidInput(
            f"invalid {what}: one line of printable text, at most {MAX_REQUEST_TEXT} characters"
        )
