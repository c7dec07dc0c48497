"""The request line in OCSF 1.5.0's HTTP Activity shape (class 4002), for `--audit-format ocsf`.

Only request events change shape: credproxy's own events (proxy.started, policy.reloaded,
alert.*, audit.*) keep theirs, and carry no `class_uid`. What has no OCSF attribute of its
own stays under `unmapped`, by its audit name, so nothing of the JSON line is lost.
"""

from __future__ import annotations

from datetime import datetime
from importlib import metadata
from typing import Any

from addon.observe import audit

VERSION = "1.5.0"
# The profiles whose attributes are used: `host` brings `actor`, `security_control` brings
# `action`, `disposition`, `policy` and `authorizations`.
PROFILES = ("host", "security_control")
CLASS_UID = 4002
CATEGORY_UID = 4

# activity_id by method, as OCSF 1.5.0 numbers them; any other method is 99, Other.
ACTIVITIES = {
    "CONNECT": 1,
    "DELETE": 2,
    "GET": 3,
    "HEAD": 4,
    "OPTIONS": 5,
    "POST": 6,
    "PUT": 7,
    "TRACE": 8,
}
OTHER = 99

# (action_id, action, disposition_id, disposition, status_id, status) by decision.
_OUTCOMES: dict[str, tuple[int, str, int, str, int, str]] = {
    audit.ALLOW: (1, "Allowed", 1, "Allowed", 1, "Success"),
    audit.DENY: (2, "Denied", 2, "Blocked", 2, "Failure"),
    audit.CHALLENGE: (2, "Denied", 23, "Challenge", 2, "Failure"),
    # Granted, then the exchange failed: the grant allowed it, the agent got no answer whole.
    audit.ERROR: (1, "Allowed", 27, "Error", 2, "Failure"),
    audit.INTERNAL: (1, "Allowed", 1, "Allowed", 1, "Success"),
}
_UNKNOWN_OUTCOME = (0, "Unknown", 0, "Unknown", 0, "Unknown")

# The request line's fields that an OCSF attribute carries; the rest go under `unmapped`.
# DECISION stays there too: `disposition` cannot tell `internal` from `allow`.
_MAPPED = frozenset(
    {
        audit.EVENT,
        audit.TS,
        audit.REQUEST_ID,
        audit.PRINCIPAL,
        audit.CLIENT,
        audit.METHOD,
        audit.HOST,
        audit.PORT,
        audit.PATH,
        audit.REASON,
        audit.DETAIL,
        audit.GRANT_ID,
        audit.STATUS,
        audit.BYTES_IN,
        audit.BYTES_OUT,
        audit.DURATION_MS,
    }
)


def _product_version() -> str:
    try:
        return metadata.version("credproxy")
    except metadata.PackageNotFoundError:
        return "unknown"


_METADATA_BASE = {
    "version": VERSION,
    "product": {"name": "credproxy", "vendor_name": "credproxy", "version": _product_version()},
    "profiles": list(PROFILES),
    "log_name": "audit",
}


def shape(line: dict[str, Any]) -> dict[str, Any]:
    """A request line as an OCSF HTTP Activity event; any other event as it is."""
    if line.get(audit.EVENT) != audit.REQUEST_EVENT:
        return line
    method = line.get(audit.METHOD) or ""
    activity = ACTIVITIES.get(method, OTHER if method else 0)
    action_id, action, disposition_id, disposition, status_id, status = _OUTCOMES.get(
        line.get(audit.DECISION) or "", _UNKNOWN_OUTCOME
    )
    when = _epoch_ms(line.get(audit.TS))
    duration = line.get(audit.DURATION_MS) or 0
    host, port, path = line.get(audit.HOST), line.get(audit.PORT), line.get(audit.PATH)
    url: dict[str, Any] = {}
    if host:
        url["hostname"] = host
    if port is not None:
        url["port"] = port
    if path is not None:
        url["path"] = path
    else:  # CONNECT, or a target refused before it had a path: the authority form
        url["url_string"] = f"{host}:{port}"
    request: dict[str, Any] = {"url": url}
    if activity not in (0, OTHER):
        request["http_method"] = method  # 1.5.0's enum has no other method (PATCH: unmapped)
    event: dict[str, Any] = {
        "class_uid": CLASS_UID,
        "class_name": "HTTP Activity",
        "category_uid": CATEGORY_UID,
        "category_name": "Network Activity",
        "activity_id": activity,
        "activity_name": method.capitalize() if method else "Unknown",
        "type_uid": CLASS_UID * 100 + activity,
        "severity_id": 1,
        "severity": "Informational",
        "time": when,
        "start_time": when - int(duration),
        "duration": int(duration),
        "action_id": action_id,
        "action": action,
        "disposition_id": disposition_id,
        "disposition": disposition,
        "status_id": status_id,
        "status": status,
        "metadata": {**_METADATA_BASE, "uid": line.get(audit.REQUEST_ID) or ""},
        "http_request": request,
        "dst_endpoint": {k: v for k, v in (("hostname", host), ("port", port)) if v},
        "traffic": {
            "bytes_in": line.get(audit.BYTES_IN) or 0,
            "bytes_out": line.get(audit.BYTES_OUT) or 0,
        },
    }
    principal = line.get(audit.PRINCIPAL)
    if principal:
        event["actor"] = {"user": {"name": principal, "uid": principal}}
    src = _endpoint(line.get(audit.CLIENT))
    if src:
        event["src_endpoint"] = src
    if line.get(audit.STATUS) is not None:
        event["http_response"] = {"code": line[audit.STATUS]}
    reason = line.get(audit.REASON)
    if reason:
        event["status_code"] = reason
    detail = line.get(audit.DETAIL)
    if detail:
        event["status_detail"] = detail
    grant = line.get(audit.GRANT_ID)
    if grant is not None:
        event["policy"] = {"uid": str(grant), "name": "grant", "is_applied": True}
    unmapped = {k: v for k, v in line.items() if k not in _MAPPED and v is not None}
    if "http_method" not in request and method:
        unmapped[audit.METHOD] = method
    event["unmapped"] = unmapped
    return event


def _epoch_ms(ts: Any) -> int:
    if not isinstance(ts, str):
        return 0
    return int(datetime.fromisoformat(ts).timestamp() * 1000)


def _endpoint(client: Any) -> dict[str, Any]:
    """`address:port` (an IPv6 address unbracketed, as the audit line has it)."""
    if not client:
        return {}
    address, sep, port = str(client).rpartition(":")
    if not sep or not port.isdigit():
        return {"ip": str(client)}
    return {"ip": address.strip("[]"), "port": int(port)}
