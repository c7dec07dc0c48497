"""`--otlp-endpoint`: every audit line this process writes, also as an OTLP log record.

The OpenTelemetry SDK (the `otel` extra) is imported only when the export is on. A line is
handed to the SDK's BatchLogRecordProcessor, whose own thread posts batches over OTLP/HTTP
(protobuf): the event loop never waits for the collector. At most `queue` records wait; past
that, records are dropped and counted (`credproxy_audit_export_dropped_total`, and an
`audit.export_dropped` line on stdout, the source of truth, which always has every line).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from addon.observe import audit
from store.errors import InvalidInput

PREFIX = "credproxy."
QUEUE = 2048
BATCH = 512
# At shutdown, what is still queued gets this long to reach the collector.
SHUTDOWN_SECONDS = 2.0
# Drops are reported at most once in this long, in one line.
REPORT_SECONDS = 1.0

QUEUE_FULL, EXPORT_FAILED, UNEXPORTABLE, SHUTDOWN = (
    "queue-full",
    "export-failed",
    "unexportable",
    "shutdown",
)

_SEVERITY = {"debug": 5, "info": 9, "warning": 13, "warn": 13, "error": 17, "critical": 21}


# When --otlp-endpoint is not given, as the OpenTelemetry SDKs read them: the logs URL itself,
# else a base URL that /v1/logs is added to.
LOGS_ENDPOINT, ENDPOINT = "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"


@dataclass(frozen=True)
class OtlpSettings:
    """Where records go: OTLP/HTTP under `endpoint` (its `/v1/logs`, unless `whole`: the
    endpoint is the logs URL itself), at most `queue` waiting."""

    endpoint: str
    queue: int = QUEUE
    whole: bool = False

    @classmethod
    def configured(
        cls, flag: str | None, queue: int, environ: Mapping[str, str]
    ) -> OtlpSettings | None:
        """--otlp-endpoint, else the standard variables; None: no export. Raises InvalidInput."""
        if flag:
            return cls.parse(flag, queue)
        for name in (LOGS_ENDPOINT, ENDPOINT):
            if environ.get(name, "").strip():
                return cls.parse(environ[name].strip(), queue, name, whole=name == LOGS_ENDPOINT)
        return None

    @classmethod
    def parse(
        cls, url: str, queue: int = QUEUE, source: str = "--otlp-endpoint", whole: bool = False
    ) -> OtlpSettings:
        """Raises InvalidInput, in a line that never quotes the URL (it may hold a token)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidInput(f"invalid {source}: use http(s)://HOST[:PORT][/PATH]")
        if parts.username or parts.password or parts.query or parts.fragment:
            # A collector's token belongs in OTEL_EXPORTER_OTLP_HEADERS, never in argv.
            raise InvalidInput(
                f"invalid {source}: no user, password, query or fragment "
                "(put a collector's token in OTEL_EXPORTER_OTLP_HEADERS)"
            )
        try:
            parts.port  # noqa: B018 - raises on a port out of range
        except ValueError:
            raise InvalidInput(f"invalid {source}: its port is not a number to 65535") from None
        return cls(url if whole else url.rstrip("/"), queue, whole)

    @property
    def logs_url(self) -> str:
        return self.endpoint if self.whole else f"{self.endpoint}/v1/logs"


def attributes(line: dict[str, Any]) -> dict[str, Any]:
    """The line's fields as OTLP attributes: `credproxy.<field>`, nested objects dotted."""
    out: dict[str, Any] = {}
    _flatten(PREFIX, line, out)
    return out


_PRIMITIVE = (str, int, float, bool)


def _flatten(prefix: str, fields: dict[str, Any], out: dict[str, Any]) -> None:
    for key, value in fields.items():
        if value is None:
            continue
        name = prefix + key
        if type(value) in _PRIMITIVE:  # the common case, checked first: once per field
            out[name] = value
        elif isinstance(value, dict):
            _flatten(name + ".", value, out)
        elif isinstance(value, _PRIMITIVE):
            out[name] = value
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out[name] = value
        else:  # mixed or nested lists: OTLP arrays hold one primitive type
            out[name] = json.dumps(value, separators=(",", ":"))


class Export:
    """The audit stream's tap: turns lines into log records, counts what it cannot queue."""

    def __init__(
        self, settings: OtlpSettings, logger: Any, provider: Any, severity: dict[str, Any]
    ) -> None:
        self._limit = settings.queue
        self._logger = logger
        self._provider = provider
        self._severity = severity
        self._lock = threading.Lock()
        self.waiting = 0  # handed to the SDK, not yet exported or given up
        self.dropped: Counter[str] = Counter()
        self._unreported: Counter[str] = Counter()
        self._wake = threading.Event()
        self._stopped = False
        self._reporter = threading.Thread(target=self._report, name="otlp-report", daemon=True)
        self._reporter.start()

    def __call__(self, item: dict[str, Any] | str) -> None:
        with self._lock:
            if self._stopped:
                return  # shut down: stdout alone has what follows
            if self.waiting >= self._limit:
                self._drop(QUEUE_FULL, 1)
                return
            self.waiting += 1
        try:
            line = json.loads(item) if isinstance(item, str) else item
            # An OCSF event (--audit-format ocsf) has no `event`: it is a request's line.
            event = str(
                line.get(audit.EVENT) or (audit.REQUEST_EVENT if "class_uid" in line else "")
            )
            level = str(line.get("level", "info"))
            self._logger.emit(
                timestamp=time.time_ns(),
                severity_number=self._severity.get(level, self._severity["info"]),
                severity_text=level.upper(),
                body=event,
                event_name=PREFIX + event,
                attributes=attributes(line),
            )
        except Exception:  # noqa: BLE001 - a line the SDK refuses is counted, never raised
            self.exported(1, ok=False, reason=UNEXPORTABLE)

    def exported(self, count: int, ok: bool, reason: str = EXPORT_FAILED) -> None:
        """`count` records left the queue: sent, or given up after the SDK's retries."""
        with self._lock:
            self.waiting -= count
            if not ok:
                self._drop(reason, count)

    def _drop(self, reason: str, count: int) -> None:
        self.dropped[reason] += count
        self._unreported[reason] += count
        self._wake.set()

    def _report(self) -> None:
        """One `audit.export_dropped` line a REPORT_SECONDS at most, while records drop."""
        while True:
            self._wake.wait()
            if not self._stopped:
                time.sleep(REPORT_SECONDS)
            with self._lock:
                if self._stopped:
                    return  # shutdown() reports what is left
                self._wake.clear()
                counts, self._unreported = self._unreported, Counter()
            _report_dropped(counts)

    def close(self) -> None:
        """Take no more lines; the reporter ends."""
        with self._lock:
            self._stopped = True
        self._wake.set()

    def shutdown(self) -> None:
        """Give what is queued SHUTDOWN_SECONDS to go, then say how many did not."""
        stopper = threading.Thread(target=self._provider.shutdown, name="otlp-stop", daemon=True)
        stopper.start()
        stopper.join(SHUTDOWN_SECONDS)
        self.close()
        with self._lock:
            if self.waiting:
                self._drop(SHUTDOWN, self.waiting)
            counts, self._unreported = self._unreported, Counter()
        if counts:
            _report_dropped(counts)
            audit.drain()


def _report_dropped(counts: Counter[str]) -> None:
    if counts:
        audit.emit("audit.export_dropped", {"count": sum(counts.values()), "reasons": dict(counts)})


_export: Export | None = None


def dropped() -> dict[str, int]:
    """Records dropped from the export so far, by reason (none while it is off)."""
    return {} if _export is None else dict(_export.dropped)


def waiting() -> int:
    return 0 if _export is None else _export.waiting


def start(settings: OtlpSettings) -> Export:
    """Build the SDK's pipeline and tap the audit stream with it.

    Raises:
        InvalidInput: the `otel` extra is not installed.
    """
    global _export
    try:
        from opentelemetry._logs import SeverityNumber
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExportResult
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    except ImportError as e:
        raise InvalidInput(
            "--otlp-endpoint needs the OpenTelemetry SDK: pip install 'credproxy[otel]'"
        ) from e
    # The SDK's own log lines quote collectors' answers and would be exported in turn: its
    # failures reach the audit stream as counted drops instead.
    sdk_log = logging.getLogger("opentelemetry")
    sdk_log.propagate = False
    sdk_log.addHandler(logging.NullHandler())

    class Counted(OTLPLogExporter):  # type: ignore[misc]
        def export(self, batch: Any) -> Any:
            result = LogRecordExportResult.FAILURE
            try:
                result = super().export(batch)
            finally:
                export.exported(len(batch), ok=result == LogRecordExportResult.SUCCESS)
            return result

    resource = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "credproxy"}
    provider = LoggerProvider(resource=Resource.create(resource), shutdown_on_exit=False)
    severity = {level: SeverityNumber(n) for level, n in _SEVERITY.items()}
    export = Export(settings, provider.get_logger("credproxy"), provider, severity)
    # The SDK's queue holds more than ours: it never drops on its own, uncounted.
    processor = BatchLogRecordProcessor(
        Counted(endpoint=settings.logs_url),
        max_queue_size=settings.queue + BATCH,
        max_export_batch_size=min(BATCH, settings.queue),
    )
    provider.add_log_record_processor(processor)
    _export = export
    audit.set_tap(export)
    atexit.register(export.shutdown)
    return export
