"""Audit streams read back: gzip or not, hostile lines skipped and counted, bad input refused."""

from __future__ import annotations

import gzip
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from addon.observe import audit, auditread
from store.errors import InvalidInput
from store.policyfile.evidence import Evidence

GH = "api.github.com"


def _line(**fields: Any) -> str:
    line = {
        audit.EVENT: audit.REQUEST_EVENT,
        audit.TS: "2026-12-07T10:00:00.000001Z",
        audit.PRINCIPAL: "agent",
        audit.HOST: GH,
        audit.PORT: 443,
        audit.METHOD: "GET",
        audit.PATH: "/repos/acme/app",
        audit.DECISION: audit.DENY,
        audit.REASON: "no-grant",
        audit.GRANT_ID: None,
    }
    return json.dumps(line | fields)


def _read(tmp_path: Path, data: bytes, **kw: Any) -> tuple[Evidence, auditread.Counts]:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(data)
    evidence = Evidence([7])
    return evidence, auditread.read([str(path)], evidence, **kw)


def test_denials_and_uses_are_gathered_and_gzip_is_read_as_it_is(tmp_path: Path) -> None:
    text = "\n".join(
        [
            _line(),
            _line(),
            _line(**{audit.DECISION: audit.ALLOW, audit.GRANT_ID: 7, audit.REASON: None}),
            _line(**{audit.DECISION: audit.ERROR, audit.GRANT_ID: 7, audit.PATH: "/b"}),
            json.dumps({audit.EVENT: "proxy.started", audit.TS: "2026-12-07T10:00:00Z"}),
        ]
    )
    for data in (text.encode(), gzip.compress(text.encode())):
        evidence, counts = _read(tmp_path, data)
        assert (counts.lines, counts.denials, counts.uses) == (5, 2, 2)
        assert evidence.denied[("agent", GH, 443, "GET", "/repos/acme/app")].count == 2
        assert set(evidence.used[7]) == {("GET", "/repos/acme/app"), ("GET", "/b")}
        assert counts.skipped == {"of other events": 1}


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({audit.PATH: "/a\x1b[31m"}, id="an ANSI escape in the path"),
        pytest.param({audit.PATH: '/a"\n[[grant]]'}, id="TOML in the path"),
        pytest.param({audit.PATH: "/a b"}, id="a space in the path"),
        pytest.param({audit.PATH: "/%zz"}, id="a broken escape"),
        pytest.param({audit.PATH: "a"}, id="a path without its slash"),
        pytest.param({audit.PATH: "/" + "a" * 3000}, id="a path past its bound"),
        pytest.param({audit.HOST: "API.github.com"}, id="a host the proxy never writes"),
        pytest.param({audit.HOST: "*.github.com"}, id="a wildcard host"),
        pytest.param({audit.HOST: "github.com:443"}, id="a host with a port"),
        pytest.param({audit.PORT: "443"}, id="a port as text"),
        pytest.param({audit.PORT: 0}, id="port zero"),
        pytest.param({audit.METHOD: "get"}, id="a lower-case method"),
        pytest.param({audit.METHOD: "CONNECT", audit.PATH: "/"}, id="a CONNECT"),
        pytest.param({audit.PRINCIPAL: "Agent"}, id="a principal the grammar refuses"),
        pytest.param({audit.PRINCIPAL: None}, id="a denial without principal"),
        pytest.param({audit.TS: "yesterday"}, id="a time that is none"),
    ],
)
def test_a_field_the_proxy_would_not_write_skips_the_line(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    evidence, counts = _read(tmp_path, (_line() + "\n" + _line(**fields) + "\n").encode())
    assert counts.denials == 1 and counts.skipped == {"malformed": 1}
    assert list(evidence.denied) == [("agent", GH, 443, "GET", "/repos/acme/app")]


def test_an_ipv6_host_is_read_as_the_audit_writes_it(tmp_path: Path) -> None:
    evidence, counts = _read(tmp_path, _line(**{audit.HOST: "2001:db8::1"}).encode())
    assert list(evidence.denied) == [("agent", "2001:db8::1", 443, "GET", "/repos/acme/app")]


def test_lines_not_json_and_too_long_are_counted_and_never_held_whole(tmp_path: Path) -> None:
    huge = b'{"event": "request", "path": "/' + b"a" * (3 * auditread.MAX_LINE) + b'"}'
    data = b"\n".join([_line().encode(), b"not json", huge, b"\xff\xfe", _line().encode()])
    evidence, counts = _read(tmp_path, data)
    assert counts.denials == 2
    assert counts.skipped == {"not JSON": 2, "too long": 1}


def test_other_denials_are_not_evidence_for_a_grant(tmp_path: Path) -> None:
    data = "\n".join(
        [
            _line(**{audit.REASON: "destination-denied"}),
            _line(**{audit.REASON: "grant-expired"}),
            _line(**{audit.DECISION: audit.CHALLENGE, audit.REASON: "auth-required"}),
        ]
    )
    evidence, counts = _read(tmp_path, data.encode())
    assert evidence.denied == {} and counts.denials == 0


def test_the_window_keeps_since_and_drops_until(tmp_path: Path) -> None:
    data = "\n".join(_line(**{audit.TS: f"2026-12-07T1{h}:00:00Z"}) for h in range(4)).encode()
    since = datetime(2026, 12, 7, 11, tzinfo=UTC)
    until = datetime(2026, 12, 7, 13, tzinfo=UTC)
    evidence, counts = _read(tmp_path, data, since=since, until=until)
    tally = evidence.denied[("agent", GH, 443, "GET", "/repos/acme/app")]
    assert (tally.count, tally.first, tally.last) == (
        2,
        since,
        datetime(2026, 12, 7, 12, tzinfo=UTC),
    )
    assert counts.skipped == {"outside the window": 2}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            gzip.compress((_line() + "\n").encode() * 50)[:-10],
            "not a whole gzip stream",
            id="a cut gzip, however good its lines so far",
        ),
        pytest.param(b"\x1f\x8b\x08garbage", "not a whole gzip stream", id="a broken gzip"),
        pytest.param(b"hello\nworld\n", "not one line is JSON", id="not an audit at all"),
    ],
)
def test_bad_input_is_one_error(tmp_path: Path, data: bytes, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        _read(tmp_path, data)


def test_an_unreadable_file_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match=r"cannot read .*missing\.jsonl: No such file"):
        auditread.read([str(tmp_path / "missing.jsonl")], Evidence([]))


def test_a_refused_connect_is_a_host_asked_for_and_nothing_more(tmp_path: Path) -> None:
    connect = {audit.METHOD: "CONNECT", audit.PATH: None, audit.HOST: "evil.test"}
    data = "\n".join(
        [
            _line(**connect),
            _line(**connect | {audit.PORT: 8443}),
            _line(**connect | {audit.PATH: "/smuggled"}),  # the proxy never writes one
            _line(**connect | {audit.REASON: "too-many-connections"}),
        ]
    )
    evidence, counts = _read(tmp_path, data.encode())
    assert sorted(evidence.hosts) == [("agent", "evil.test", 443), ("agent", "evil.test", 8443)]
    assert evidence.denied == {} and counts.connects == 2
    assert counts.skipped == {
        "malformed": 1,
        "neither a use nor a denial a grant would allow": 1,
    }
