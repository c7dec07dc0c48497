"""Reading audit streams back (JSON lines, gzip or not) into `store.policyfile.evidence`.

The audit is data an agent influenced: every field used is checked against the grammar the
proxy writes it with, and a line that fails is skipped and counted, never repaired. A line
longer than MAX_LINE is skipped without being held whole. An input that cannot be opened, is
a broken gzip stream, or has lines and not one of them JSON is an error (InvalidInput).
"""

from __future__ import annotations

import gzip
import io
import json
import re
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any, cast

from addon.core.reasons import Reason
from addon.observe import audit
from store.errors import InvalidInput
from store.policyfile.evidence import Evidence
from store.rules.grammar import PCHAR, parse_host, validate_method, validate_name

MAX_LINE = 64 * 1024
MAX_PATH = 2048
# The denials a grant could have allowed; the others (limits, the guard, smuggling, a body
# rule, an expired or used-up grant) are an operator's call, not a missing grant.
SUGGESTABLE = frozenset(
    {Reason.NO_GRANT.value, Reason.METHOD_NOT_ALLOWED.value, Reason.PATH_NOT_ALLOWED.value}
)
USES = frozenset({audit.ALLOW, audit.ERROR})
_CANONICAL = re.compile("/(?:[" + re.escape(PCHAR) + "/]|%[0-9A-F]{2})*")
_GZIP = b"\x1f\x8b"


@dataclass
class Counts:
    """What the inputs held, by what became of each line."""

    lines: int = 0
    requests: int = 0  # request lines within the window
    denials: int = 0
    uses: int = 0
    connects: int = 0  # refused CONNECTs: a host asked for, no method or path
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


def read(
    names: list[str],
    evidence: Evidence,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Counts:
    """Add every input's request lines within [since, until) to `evidence`."""
    counts = Counts()
    for name in names:
        parsed_before, lines_before = _parsed(counts), counts.lines
        with _opened(name) as stream:
            for line in _lines(name, stream, counts):
                _line(line, evidence, since, until, counts)
        if counts.lines > lines_before and _parsed(counts) == parsed_before:
            raise InvalidInput(f"{_shown(name)}: not one line is JSON: is it credproxy's audit?")
    return counts


def _parsed(counts: Counts) -> int:
    return counts.lines - counts.skipped.get("not JSON", 0) - counts.skipped.get("too long", 0)


def _shown(name: str) -> str:
    return "standard input" if name == "-" else json.dumps(name, ensure_ascii=True)[1:-1]


class _opened:
    """The input, gunzipped when it starts as gzip does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.raw: IO[bytes] | None = None

    def __enter__(self) -> IO[bytes]:
        try:
            raw = sys.stdin.buffer if self.name == "-" else open(self.name, "rb")  # noqa: SIM115
        except OSError as e:
            raise InvalidInput(f"cannot read {_shown(self.name)}: {e.strerror}") from e
        self.raw = raw
        buffered = cast(io.BufferedReader, raw)  # stdin's buffer and open(.., "rb") both are
        try:
            head = buffered.peek(2)[:2]
        except OSError as e:
            raise InvalidInput(f"cannot read {_shown(self.name)}: {e.strerror}") from e
        if head == _GZIP:
            return gzip.GzipFile(fileobj=buffered, mode="rb")  # type: ignore[return-value]
        return buffered

    def __exit__(self, *exc: object) -> None:
        if self.raw is not None and self.name != "-":
            self.raw.close()


def _lines(name: str, stream: IO[bytes], counts: Counts) -> Iterator[bytes]:
    try:
        while True:
            line = stream.readline(MAX_LINE + 1)
            if not line:
                return
            counts.lines += 1
            if len(line) > MAX_LINE and not line.endswith(b"\n"):
                counts.skip("too long")
                while line and not line.endswith(b"\n"):  # the rest, never held whole
                    line = stream.readline(MAX_LINE)
                continue
            yield line
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise InvalidInput(f"{_shown(name)}: not a whole gzip stream ({type(e).__name__})") from e
    except OSError as e:
        raise InvalidInput(f"cannot read {_shown(name)}: {e.strerror}") from e


def _line(
    raw: bytes,
    evidence: Evidence,
    since: datetime | None,
    until: datetime | None,
    counts: Counts,
) -> None:
    try:
        line = json.loads(raw.decode())  # UTF-8, as the proxy writes; a bad byte is no JSON
    except (ValueError, RecursionError):
        counts.skip("not JSON")
        return
    if not isinstance(line, dict) or line.get(audit.EVENT) != audit.REQUEST_EVENT:
        counts.skip("of other events")  # credproxy's own events, mitmproxy's, an OCSF line
        return
    when = _instant(line.get(audit.TS))
    if when is None:
        counts.skip("malformed")
        return
    if (since is not None and when < since) or (until is not None and when >= until):
        counts.skip("outside the window")
        return
    counts.requests += 1
    decision = line.get(audit.DECISION)
    if decision in USES and isinstance(line.get(audit.GRANT_ID), int):
        request = _request(line, need_principal=False)
        if request is None:
            counts.skip("malformed")
            return
        _, host, port, method, path = request
        evidence.use(line[audit.GRANT_ID], method, path, when, (host, port))
        counts.uses += 1
    elif (
        decision == audit.DENY
        and line.get(audit.REASON) == Reason.NO_GRANT
        and line.get(audit.METHOD) == "CONNECT"
    ):
        request = _request(line | {audit.PATH: "/"}, need_principal=True, connect=True)
        if request is None or line.get(audit.PATH) is not None:
            counts.skip("malformed")
            return
        evidence.connect(request[:3], when)
        counts.connects += 1
    elif decision == audit.DENY and line.get(audit.REASON) in SUGGESTABLE:
        request = _request(line, need_principal=True)
        if request is None:
            counts.skip("malformed")
            return
        evidence.deny(request, when, line[audit.REASON])
        counts.denials += 1
    else:
        counts.skip("neither a use nor a denial a grant would allow")


def _instant(value: Any) -> datetime | None:
    if not isinstance(value, str) or len(value) > 40:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def _request(
    line: dict[str, Any], *, need_principal: bool, connect: bool = False
) -> tuple[str, str, int, str, str] | None:
    """(principal, host, port, method, path), each as the proxy writes it, or None."""
    principal, host, port = line.get(audit.PRINCIPAL), line.get(audit.HOST), line.get(audit.PORT)
    method, path = line.get(audit.METHOD), line.get(audit.PATH)
    if not (isinstance(host, str) and isinstance(method, str) and isinstance(path, str)):
        return None
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        return None
    if len(path) > MAX_PATH or not _CANONICAL.fullmatch(path) or (method == "CONNECT") != connect:
        return None
    if principal is None and not need_principal:
        principal = ""  # a use's line may have none; the grant says whose it was
    if not isinstance(principal, str):
        return None
    who = _identity(principal, host, method)
    if who is None:
        return None
    name, bare = who
    return name, bare, port, method, path


_IDENTITIES: dict[tuple[str, str, str], tuple[str, str] | None] = {}
# A cache of pure checks, of short keys only (at most 4096 x 350 characters); past it, each
# line is checked again.
_MAX_IDENTITIES = 4096


def _identity(principal: str, host: str, method: str) -> tuple[str, str] | None:
    """(principal, host as the store keeps it) when the proxy could have written them."""
    if len(principal) > 63 or len(host) > 255 or len(method) > 32:
        return None  # longer than the grammar allows any of them
    key = (principal, host, method)
    if key in _IDENTITIES:
        return _IDENTITIES[key]
    found = _check_identity(principal, host, method)
    if len(_IDENTITIES) < _MAX_IDENTITIES:
        _IDENTITIES[key] = found
    return found


def _check_identity(principal: str, host: str, method: str) -> tuple[str, str] | None:
    spec = f"[{host}]" if ":" in host else host  # the audit writes an IPv6 host bare
    try:
        if principal != "":
            validate_name("principal", principal)
        if method != "CONNECT":
            validate_method(method)
        pattern = parse_host(spec)
    except InvalidInput:
        return None
    if pattern.port is not None or pattern.wildcard or str(pattern) != spec:
        return None
    return principal, pattern.host
