"""`--audit-format ocsf`: request lines as OCSF 1.5.0 HTTP Activity events, validated against
the class's JSON Schema (ocsf_schema/, derived from OCSF's own export: see its README)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from jsonschema import Draft202012Validator

from addon.observe import audit, ocsf

SCHEMA = Path(__file__).parent / "ocsf_schema" / f"http_activity-{ocsf.VERSION}.json"


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schema = json.loads(SCHEMA.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def request_line(**fields: Any) -> dict[str, Any]:
    """A request line as Trail.write builds it, with `ts` as emit() adds it."""
    line: dict[str, Any] = {
        audit.EVENT: audit.REQUEST_EVENT,
        audit.TS: "2026-05-04T10:11:12.345678Z",
        audit.REQUEST_ID: "3f0c9d2e-flow",
        audit.PRINCIPAL: "agent",
        audit.CLIENT: "127.0.0.1:50312",
        audit.METHOD: "GET",
        audit.HOST: "api.github.com",
        audit.PORT: 443,
        audit.PATH: "/repos/o/r/issues",
        audit.DECISION: audit.ALLOW,
        audit.GRANT_ID: 7,
        audit.CREDENTIAL: "gh",
        audit.CREDENTIAL_FP: "fp:1a2b3c4d",
        audit.BYTES_IN: 2048,
        audit.BYTES_OUT: 0,
        audit.DURATION_MS: 12.5,
        audit.STATUS: 200,
        "redactions": 0,
    }
    line.update(fields)
    return line


DENY = {
    audit.DECISION: audit.DENY,
    audit.GRANT_ID: None,
    audit.CREDENTIAL: None,
    audit.CREDENTIAL_FP: None,
    audit.STATUS: 403,
    audit.REASON: "no-grant",
    audit.DETAIL: "no grant allows this request",
}

CASES = [
    pytest.param({}, (1, 1, 1), id="an allowed request is Allowed, with its grant as policy"),
    pytest.param(DENY, (2, 2, 2), id="a denied request is Denied and Blocked, a Failure"),
    pytest.param(
        {**DENY, audit.DECISION: audit.CHALLENGE, audit.PRINCIPAL: None, audit.STATUS: 407},
        (2, 23, 2),
        id="a challenge is Denied with the Challenge disposition, and has no actor",
    ),
    pytest.param(
        {
            audit.DECISION: audit.ERROR,
            audit.REASON: "upstream-unreachable",
            audit.STATUS: 502,
            "error": "connection-refused",
        },
        (1, 27, 2),
        id="an upstream failure was Allowed by its grant, with the Error disposition",
    ),
    pytest.param(
        {audit.DECISION: audit.ALLOW, audit.METHOD: "PATCH", "approval": 12, "dns_ms": 3.1},
        (1, 1, 1),
        id="a method OCSF 1.5.0 does not number is Other (99), by its name",
    ),
    pytest.param(
        {audit.METHOD: "CONNECT", audit.PATH: None, audit.STATUS: None},
        (1, 1, 1),
        id="a CONNECT has no path, its URL is the authority, and it has no response code",
    ),
    pytest.param(
        {audit.CLIENT: "::1:50312", audit.BODY: {"graphql": [{"type": "query", "fields": ["a"]}]}},
        (1, 1, 1),
        id="an IPv6 client and a body rule's verdict (kept under unmapped)",
    ),
]


@pytest.mark.parametrize(("fields", "ids"), CASES)
def test_request_lines_are_valid_http_activity_events(
    validator: Draft202012Validator, fields: dict[str, Any], ids: tuple[int, int, int]
) -> None:
    line = request_line(**fields)
    event = ocsf.shape(dict(line))
    errors = sorted(validator.iter_errors(event), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    assert (event["action_id"], event["disposition_id"], event["status_id"]) == ids
    assert event["class_uid"] == 4002 and event["category_uid"] == 4
    assert event["type_uid"] == 400200 + event["activity_id"]
    assert event["metadata"]["version"] == "1.5.0"
    assert event["metadata"]["uid"] == line[audit.REQUEST_ID]
    # Nothing of the JSON line is lost: each field is mapped or kept under `unmapped`.
    for key, value in line.items():
        if key not in ocsf._MAPPED and value is not None:
            assert event["unmapped"][key] == value, key
    if line[audit.METHOD] not in ocsf.ACTIVITIES:
        assert event["activity_id"] == ocsf.OTHER
        assert event["unmapped"][audit.METHOD] == line[audit.METHOD]


def test_the_mapping_names_credproxys_fields_where_security_teams_look_for_them() -> None:
    event = ocsf.shape(request_line(**DENY))
    assert event["actor"] == {"user": {"name": "agent", "uid": "agent"}}
    assert event["http_request"] == {
        "http_method": "GET",
        "url": {"hostname": "api.github.com", "port": 443, "path": "/repos/o/r/issues"},
    }
    assert event["dst_endpoint"] == {"hostname": "api.github.com", "port": 443}
    assert event["src_endpoint"] == {"ip": "127.0.0.1", "port": 50312}
    assert event["http_response"] == {"code": 403}
    assert event["status_code"] == "no-grant"
    assert event["status_detail"] == "no grant allows this request"
    assert (event["action"], event["disposition"]) == ("Denied", "Blocked")
    assert "policy" not in event
    assert event["unmapped"]["decision"] == "deny"
    allowed = ocsf.shape(request_line())
    assert allowed["policy"] == {"uid": "7", "name": "grant", "is_applied": True}
    assert allowed["unmapped"]["credential_fp"] == "fp:1a2b3c4d"
    assert allowed["time"] - allowed["start_time"] == allowed["duration"] == 12


def test_other_events_keep_their_json_shape() -> None:
    line = {audit.EVENT: "policy.reloaded", "counter": 3, "grants": 2}
    assert ocsf.shape(line) is line


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out: list[bytes] = []

    def write(fd: int, chunk: bytes) -> int:
        out.append(chunk)
        return len(chunk)

    audit.configure(-1, write=write, shape=ocsf.shape)
    yield out
    if audit._writer is not None:
        audit._writer.close()
    audit._writer = None
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_the_stream_writes_request_lines_in_ocsf_and_the_rest_as_json(
    validator: Draft202012Validator, written: list[bytes]
) -> None:
    line = request_line()
    line.pop(audit.EVENT)
    line.pop(audit.TS)
    audit.emit(audit.REQUEST_EVENT, line)
    audit.logger().info("policy.reloaded", counter=3)
    audit.drain()
    first, second = (json.loads(raw) for raw in b"".join(written).splitlines())
    assert not list(validator.iter_errors(first))
    assert first["class_uid"] == 4002 and first["unmapped"]["credential"] == "gh"
    assert second == {"counter": 3, "event": "policy.reloaded", "ts": second["ts"]}
