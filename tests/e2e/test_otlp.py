"""`--otlp-endpoint` end to end: a real `credproxy run` exporting to an OTLP/HTTP receiver on
127.0.0.1, which decodes what it gets with the protocol's own protobuf messages
(opentelemetry-proto). No OpenTelemetry Collector binary can be installed here: this small
server stands in for one.

One record per audit line, with the line's fields as `credproxy.*` attributes; no secret,
token, header value, query or body in any byte received; and a receiver that hangs, answers
500 or refuses the connection neither slows requests nor costs a JSON line on stdout, its
failures counted."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import trustme
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from store.crypto import Secret
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

CREDENTIAL = b"sk-otlp-credential-3141"
QUERY = "qs-otlp-5926"
HEADER = "hv-otlp-5358"
BODY = b"body-otlp-9793"
QUEUE = 16
WAIT = 5.0  # the export's batches leave every 50 ms here: seconds mean it is broken


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class Receiver:
    """What an OTLP/HTTP logs endpoint received: every byte, and the decoded records."""

    server: ThreadingHTTPServer
    raw: list[bytes] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    hang: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def requests(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.records if r["attributes"].get("credproxy.event") == "request"]


def _receiver() -> Receiver:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            head = "".join(f"{k}: {v}\n" for k, v in self.headers.items()).encode()
            with receiver.lock:
                receiver.raw.append(self.requestline.encode() + b"\n" + head + body)
            if receiver.hang.is_set():
                receiver.release.wait(30)  # never answers while the test runs
                return
            assert self.path == "/v1/logs"
            assert self.headers["content-type"] == "application/x-protobuf"
            request = ExportLogsServiceRequest.FromString(body)
            with receiver.lock:
                for resource_logs in request.resource_logs:
                    resource = {a.key: _value(a.value) for a in resource_logs.resource.attributes}
                    receiver.resources.append(resource)
                    for scope in resource_logs.scope_logs:
                        for record in scope.log_records:
                            receiver.records.append(
                                {
                                    "event_name": record.event_name,
                                    "body": _value(record.body),
                                    "severity": record.severity_text,
                                    "attributes": {
                                        a.key: _value(a.value) for a in record.attributes
                                    },
                                }
                            )
            answer = ExportLogsServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver = Receiver(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return receiver


@dataclass
class Setup:
    proxy: Proxy
    receiver: Receiver
    token: str
    admin: str


@pytest.fixture(scope="module")
def exported(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Setup]:
    receiver = _receiver()
    home = tmp_path_factory.mktemp("otlp")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BLRP_SCHEDULE_DELAY", "50")
        env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "5")
        env.delenv("OTEL_EXPORTER_OTLP_COMPRESSION", raising=False)
        proxy = start_proxy(
            home,
            upstream_ca,
            [f"api.test=127.0.0.1:{shared_upstream.port}"],
            extra=[
                "--otlp-endpoint",
                receiver.url,
                "--otlp-queue",
                str(QUEUE),
                "--admin",
                "127.0.0.1:0",
            ],
            template=initialised_home,
        )
    token = proxy.store.add_principal("agent")
    proxy.store.add_credential("cred", "bearer", ["api.test"], Secret(CREDENTIAL))
    proxy.store.add_grant("agent", ["GET", "POST"], credential="cred", paths=["/v1/"])
    proxy.wait_reload()
    started = next(line for line in proxy.audit() if line.get("event") == "proxy.started")
    try:
        yield Setup(proxy, receiver, token, started["admin"][0])
    finally:
        receiver.release.set()
        stop_proxy(proxy)
        receiver.server.shutdown()
        receiver.server.server_close()


def _until(check: Any, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return bool(check())


def test_each_decision_is_one_record_with_its_fields_and_no_secret_in_any_byte(
    exported: Setup,
) -> None:
    proxy, receiver = exported.proxy, exported.receiver
    with proxy.client("agent", exported.token, timeout=WAIT) as client:
        assert client.get(f"https://api.test/v1/a?key={QUERY}", headers={"x-k": HEADER}).is_success
        assert client.post("https://api.test/v1/b", content=BODY).is_success
        assert client.get("https://api.test/elsewhere").status_code == 403
    assert _until(lambda: len(receiver.requests()) >= 3), receiver.records
    lines = {line["request_id"]: line for line in proxy.requests("agent")}
    records = {r["attributes"]["credproxy.request_id"]: r for r in receiver.requests()}
    assert records.keys() == lines.keys() and len(lines) == 3
    for request_id, line in lines.items():
        record = records[request_id]
        assert record["event_name"] == "credproxy.request" and record["body"] == "request"
        attributes = record["attributes"]
        # The JSON line's fields, each as credproxy.<field>; nulls are absent, as OTLP has none.
        expected = {f"credproxy.{k}": v for k, v in line.items() if v is not None}
        assert attributes == expected
    by_path = {r["attributes"]["credproxy.path"]: r["attributes"] for r in records.values()}
    assert by_path["/v1/a"]["credproxy.decision"] == "allow"
    assert by_path["/v1/a"]["credproxy.credential_fp"]
    assert by_path["/v1/b"]["credproxy.method"] == "POST"
    assert by_path["/elsewhere"]["credproxy.decision"] == "deny"
    assert "credproxy.grant_id" not in by_path["/elsewhere"]
    assert {"service.name": "credproxy"}.items() <= receiver.resources[0].items()
    # Other events are exported too: the proxy's start.
    assert any(r["event_name"] == "credproxy.proxy.started" for r in receiver.records)
    received = b"".join(receiver.raw)
    for secret in (CREDENTIAL, exported.token.encode(), QUERY.encode(), HEADER.encode(), BODY):
        assert secret not in received


def test_a_receiver_that_hangs_slows_no_request_and_costs_no_json_line(exported: Setup) -> None:
    proxy, receiver = exported.proxy, exported.receiver
    receiver.hang.set()
    before = {line["request_id"] for line in proxy.requests("agent")}
    slowest = 0.0
    count = QUEUE * 2 + 8  # past the export's queue while the receiver holds a batch
    with proxy.client("agent", exported.token, timeout=WAIT) as client:
        for n in range(count):
            start = time.monotonic()
            assert client.get(f"https://api.test/v1/hang-{n}").is_success
            slowest = max(slowest, time.monotonic() - start)
    # The receiver holds its request for seconds (OTEL_EXPORTER_OTLP_TIMEOUT is 5): a request
    # that waited on the export would take that long.
    assert slowest < 1.0
    lines = [line for line in proxy.requests("agent") if line["request_id"] not in before]
    assert sorted(line["path"] for line in lines) == sorted(f"/v1/hang-{n}" for n in range(count))
    # What the full queue dropped is counted, in a line on stdout and in the metrics.
    assert _until(
        lambda: any(line.get("event") == "audit.export_dropped" for line in proxy.audit())
    )
    dropped = [line for line in proxy.audit() if line.get("event") == "audit.export_dropped"]
    assert sum(line["reasons"].get("queue-full", 0) for line in dropped) > 0
    with urllib.request.urlopen(f"http://{exported.admin}/metrics", timeout=WAIT) as reply:
        metrics = reply.read().decode()
    assert 'credproxy_audit_export_dropped_total{reason="queue-full"}' in metrics
    assert "credproxy_audit_export_queue " in metrics


def test_the_ocsf_form_is_written_and_exported(
    tmp_path: Path,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> None:
    from jsonschema import Draft202012Validator

    schema = Path(__file__).parents[1] / "observe" / "ocsf_schema" / "http_activity-1.5.0.json"
    validator = Draft202012Validator(json.loads(schema.read_text()))
    receiver = _receiver()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BLRP_SCHEDULE_DELAY", "50")
        proxy = start_proxy(
            tmp_path / "home",
            upstream_ca,
            [f"api.test=127.0.0.1:{shared_upstream.port}"],
            extra=["--audit-format", "ocsf", "--otlp-endpoint", receiver.url],
            template=initialised_home,
        )
    try:
        token = proxy.store.add_principal("agent")
        proxy.store.add_credential("cred", "bearer", ["api.test"], Secret(CREDENTIAL))
        proxy.store.add_grant("agent", ["GET"], credential="cred", paths=["/v1/"])
        proxy.wait_reload()
        with proxy.client("agent", token, timeout=WAIT) as client:
            assert client.get("https://api.test/v1/ocsf").is_success
        assert _until(
            lambda: any(
                r["attributes"].get("credproxy.class_uid") == 4002 for r in receiver.records
            )
        )
        (line,) = [line for line in proxy.audit() if line.get("class_uid") == 4002]
        assert not list(validator.iter_errors(line))
        assert line["actor"]["user"]["name"] == "agent"
        assert line["http_request"]["url"]["path"] == "/v1/ocsf"
        (record,) = [r for r in receiver.records if r["event_name"] == "credproxy.request"]
        assert record["attributes"]["credproxy.disposition"] == "Allowed"
        assert record["attributes"]["credproxy.http_request.url.hostname"] == "api.test"
        # credproxy's own events keep their JSON shape.
        assert any(line.get("event") == "proxy.started" for line in proxy.audit())
    finally:
        stop_proxy(proxy)
        receiver.server.shutdown()
        receiver.server.server_close()


def _answering_500() -> tuple[ThreadingHTTPServer, list[int]]:
    """An OTLP endpoint that takes every batch and answers 500."""
    posts: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            posts.append(1)
            self.send_response(500)
            self.send_header("content-length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, posts


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once it is closed


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param("500", id="a receiver that answers 500"),
        pytest.param(
            "refused", id="a refused connection, the endpoint from OTEL_EXPORTER_OTLP_ENDPOINT"
        ),
    ],
)
def test_a_failing_receiver_is_counted_and_costs_no_request_or_json_line(
    failure: str,
    tmp_path: Path,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> None:
    server, posts = _answering_500() if failure == "500" else (None, [])
    extra = ["--admin", "127.0.0.1:0"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BLRP_SCHEDULE_DELAY", "50")
        env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # the SDK's retries end within it
        env.delenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", raising=False)
        if server is not None:
            env.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
            extra += ["--otlp-endpoint", f"http://127.0.0.1:{server.server_address[1]}"]
        else:
            env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
        proxy = start_proxy(
            tmp_path / "home",
            upstream_ca,
            [f"api.test=127.0.0.1:{shared_upstream.port}"],
            extra=extra,
            template=initialised_home,
        )
    try:
        token = proxy.store.add_principal("agent")
        proxy.store.add_credential("cred", "bearer", ["api.test"], Secret(CREDENTIAL))
        proxy.store.add_grant("agent", ["GET"], credential="cred", paths=["/v1/"])
        proxy.wait_reload()
        started = next(line for line in proxy.audit() if line.get("event") == "proxy.started")
        with proxy.client("agent", token, timeout=WAIT) as client:
            for n in range(5):
                assert client.get(f"https://api.test/v1/failing-{n}").is_success
        paths = sorted(line["path"] for line in proxy.requests("agent"))
        assert paths == [f"/v1/failing-{n}" for n in range(5)]

        counted = 'credproxy_audit_export_dropped_total{reason="export-failed"} '

        def failed() -> float:
            with urllib.request.urlopen(f"http://{started['admin'][0]}/metrics", timeout=WAIT) as r:
                found = [x for x in r.read().decode().splitlines() if x.startswith(counted)]
            return float(found[0].split()[-1]) if found else 0.0

        assert _until(lambda: failed() > 0), "no failed export counted"
        assert _until(
            lambda: any(
                line.get("event") == "audit.export_dropped"
                and line["reasons"].get("export-failed", 0) > 0
                for line in proxy.audit()
            )
        )
        assert (len(posts) > 0) == (server is not None)  # the 500s were answered to batches
    finally:
        stop_proxy(proxy)
        if server is not None:
            server.shutdown()
            server.server_close()
