"""The OTLP export's parts without a collector: its flag, its attributes, its bounded queue,
and the tap that sees each line this process writes once (tests/e2e/test_otlp.py runs it
against a real receiver)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from addon.observe import audit, otlp
from addon.observe.metrics import Metrics
from store.errors import InvalidInput


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("ftp://collector:4318", id="a scheme other than http and https"),
        pytest.param("http://:4318", id="no host"),
        pytest.param("https://user:token@collector", id="a token in the URL, where argv shows it"),
        pytest.param("https://collector/?token=x", id="a query"),
        pytest.param("http://collector:99999", id="a port out of range"),
    ],
)
def test_the_endpoint_is_refused_at_start(url: str) -> None:
    with pytest.raises(InvalidInput, match="--otlp-endpoint"):
        otlp.OtlpSettings.parse(url)


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("ftp://user:s3cr3t@collector", id="user info, and a scheme refused"),
        pytest.param("http://user:s3cr3t@", id="user info, and no host"),
        pytest.param("user:s3cr3t@collector:4318", id="user info, and no scheme"),
        pytest.param("https://user:s3cr3t@collector:99999", id="user info, and a bad port"),
        pytest.param("http://collector:s3cr3t", id="a port that is a token"),
    ],
)
def test_an_error_never_quotes_the_endpoint(url: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        otlp.OtlpSettings.parse(url)
    assert "s3cr3t" not in str(refused.value)


def test_records_go_to_the_endpoints_v1_logs() -> None:
    assert otlp.OtlpSettings.parse("http://127.0.0.1:4318/").logs_url == (
        "http://127.0.0.1:4318/v1/logs"
    )


def test_attributes_are_the_lines_fields_under_credproxy_nested_ones_dotted() -> None:
    line = {
        "event": "request",
        "grant_id": 7,
        "credential": None,
        "duration_ms": 1.5,
        "body": {"mcp": [{"method": "tools/call", "tool": "search"}]},
        "listen": ["127.0.0.1:8080"],
        "unmapped": {"redactions": 0},
    }
    assert otlp.attributes(line) == {
        "credproxy.event": "request",
        "credproxy.grant_id": 7,
        "credproxy.duration_ms": 1.5,
        "credproxy.body.mcp": '[{"method":"tools/call","tool":"search"}]',
        "credproxy.listen": ["127.0.0.1:8080"],
        "credproxy.unmapped.redactions": 0,
    }


class FakeLogger:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.fail = False

    def emit(self, **record: Any) -> None:
        if self.fail:
            raise ValueError("refused")
        self.records.append(record)


@pytest.fixture
def export(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[otlp.Export, FakeLogger]]:
    monkeypatch.setattr(otlp, "REPORT_SECONDS", 0.0)
    logger = FakeLogger()
    severity = {level: n for level, n in otlp._SEVERITY.items()}
    made = otlp.Export(otlp.OtlpSettings("http://c", queue=2), logger, None, severity)
    monkeypatch.setattr(otlp, "_export", made)
    yield made, logger
    made.close()


def test_past_the_queue_records_are_dropped_and_counted(
    export: tuple[otlp.Export, FakeLogger],
) -> None:
    made, logger = export
    for n in range(5):
        made({"event": "request", "n": n})
    assert [r["attributes"]["credproxy.n"] for r in logger.records] == [0, 1]
    assert otlp.dropped() == {otlp.QUEUE_FULL: 3} and otlp.waiting() == 2
    made.exported(2, ok=False)  # the SDK gave up on the batch
    made({"event": "request", "n": 5})
    assert otlp.dropped() == {otlp.QUEUE_FULL: 3, otlp.EXPORT_FAILED: 2}
    logger.fail = True
    made("{not json")
    made({"event": "request"})
    assert otlp.dropped()[otlp.UNEXPORTABLE] == 2 and otlp.waiting() == 1
    text = Metrics(lambda: 0.0, lambda: True).render().decode()
    assert 'credproxy_audit_export_dropped_total{reason="queue-full"} 3.0' in text
    assert "credproxy_audit_export_queue 1.0" in text


def test_text_lines_are_exported_by_their_fields_with_their_level(
    export: tuple[otlp.Export, FakeLogger],
) -> None:
    made, logger = export
    made(json.dumps({"event": "mitmproxy says", "level": "warning"}) + "\n")
    (record,) = logger.records
    assert record["event_name"] == "credproxy.mitmproxy says"
    assert record["severity_text"] == "WARNING"
    assert record["severity_number"] == otlp._SEVERITY["warning"]


@pytest.fixture
def tapped() -> Iterator[list[Any]]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    seen: list[Any] = []
    audit.set_tap(seen.append)
    audit.configure(-1, write=lambda fd, chunk: len(chunk))
    yield seen
    audit.set_tap(None)
    if audit._writer is not None:
        audit._writer.close()
    audit._writer = None
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_the_tap_sees_each_line_this_process_writes_once_and_no_relayed_one(
    tapped: list[Any],
) -> None:
    audit.emit("request", {"decision": "allow"})
    audit.logger().info("policy.reloaded", counter=1)
    logging.getLogger("mitmproxy").warning("foreign ?key=secret")
    audit.relay('{"worker":1,"event":"request"}\n')  # the worker exported it itself
    audit.drain()
    assert tapped[0]["event"] == "request"
    assert [json.loads(t)["event"] for t in tapped[1:]] == ["policy.reloaded", "foreign ?[query]"]


def test_without_the_extra_the_flag_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk._logs", None)
    with pytest.raises(InvalidInput) as raised:
        otlp.start(otlp.OtlpSettings("http://127.0.0.1:4318"))
    assert str(raised.value) == (
        "--otlp-endpoint needs the OpenTelemetry SDK: pip install 'credproxy[otel]'"
    )


@pytest.mark.parametrize(
    ("flag", "environ", "logs_url"),
    [
        pytest.param(None, {}, None, id="off without the flag or a variable"),
        pytest.param(
            None,
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"},
            "http://c:4318/v1/logs",
            id="the base endpoint variable, /v1/logs added",
        ),
        pytest.param(
            None,
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "http://logs:4318/custom/path",
            },
            "http://logs:4318/custom/path",
            id="the logs endpoint variable, as it is, before the base one",
        ),
        pytest.param(
            "http://flag:4318",
            {"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "http://logs:4318/v1/logs"},
            "http://flag:4318/v1/logs",
            id="the flag before either variable",
        ),
    ],
)
def test_the_endpoint_defaults_to_the_standard_variables(
    flag: str | None, environ: dict[str, str], logs_url: str | None
) -> None:
    found = otlp.OtlpSettings.configured(flag, 5, environ)
    assert (found.logs_url if found else None) == logs_url


def test_a_bad_endpoint_variable_is_named_and_not_quoted() -> None:
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://user:s3cr3t@c"}
    with pytest.raises(InvalidInput, match="OTEL_EXPORTER_OTLP_ENDPOINT") as refused:
        otlp.OtlpSettings.configured(None, 5, environ)
    assert "s3cr3t" not in str(refused.value)
