"""A local fake AWS over TLS: S3, Bedrock Runtime, STS and a bot API, on 127.0.0.1.

Every request must carry a SigV4 signature that botocore, recomputing it from the real keys
and the request exactly as received, agrees with; anything else (the dummy keys' signature
above all) is answered 403 and recorded as refused. The services answer just enough for
boto3 to parse: S3 objects in memory, Converse and ConverseStream (an event stream sent
event by event), GetCallerIdentity. Bedrock's answers report USAGE (BEDROCK_INPUT tokens in,
cache reads and writes beside inputTokens as Bedrock splits them, BEDROCK_OUTPUT out); the
model `no-usage` leaves usage out (a stream without its metadata event), `huge` streams a
content event larger than the proxy reads for usage.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from botocore.auth import S3SigV4Auth, SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tests.e2e.upstream import Log, Received, _Handler, _Server, context_for

_AUTH = re.compile(
    r"AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request, "
    r"SignedHeaders=([a-z0-9;-]+), Signature=([0-9a-f]{64})"
)
UNSIGNED = {"UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"}
BEDROCK_INPUT, BEDROCK_OUTPUT = 100, 20
USAGE = {
    "inputTokens": BEDROCK_INPUT - 30,
    "outputTokens": BEDROCK_OUTPUT,
    "totalTokens": BEDROCK_INPUT + BEDROCK_OUTPUT,
    "cacheReadInputTokens": 20,
    "cacheWriteInputTokens": 10,
}
HUGE_EVENT = 80 * 1024  # bytes of text in the `huge` model's one content event


@dataclass(frozen=True)
class Keys:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None

    def json(self) -> bytes:
        data = {"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}
        if self.session_token:
            data["session_token"] = self.session_token
        return json.dumps(data).encode()


@dataclass
class Checked:
    """One request as received, and what the verifier said of it (None: verified)."""

    received: Received
    host: str
    refused: str | None
    scope: tuple[str, str] | None = None  # (region, service) signed for
    payload: bytes = b""  # the body with aws-chunked framing removed


def verify(
    keys: Keys, method: str, target: str, headers: list[tuple[str, str]], body: bytes
) -> tuple[str | None, tuple[str, str] | None]:
    """Recompute the request's signature with botocore; (None, scope) if it holds."""
    lower = [(k.lower(), v) for k, v in headers]

    def values(name: str) -> list[str]:
        return [v for k, v in lower if k == name]

    auths = values("authorization")
    if len(auths) != 1:
        return "MissingAuthenticationToken", None
    m = _AUTH.fullmatch(auths[0])
    if m is None:
        return "IncompleteSignature", None
    key_id, day, region, service, signed_names, signature = m.groups()
    if key_id != keys.access_key_id:
        return "InvalidAccessKeyId", None
    signed = signed_names.split(";")
    amz_date = values("x-amz-date")
    if len(amz_date) != 1 or not amz_date[0].startswith(day) or "host" not in signed:
        return "IncompleteSignature", None
    # AWS's rule: every x-amz-* header the request carries is signed.
    if any(k.startswith("x-amz-") and k not in signed for k, _ in lower):
        return "AccessDenied", None
    if keys.session_token is not None and values("x-amz-security-token") != [keys.session_token]:
        return "InvalidToken", None
    declared = values("x-amz-content-sha256")
    if service == "s3":
        if len(declared) != 1:
            return "InvalidRequest", None
        if declared[0] not in UNSIGNED and declared[0] != hashlib.sha256(body).hexdigest():
            return "XAmzContentSHA256Mismatch", None
    host = values("host")[0]
    request = AWSRequest(method=method, url=f"https://{host}{target}", data=body or None)
    for name in signed:
        found = values(name)
        if not found:
            return "SignatureDoesNotMatch", None
        for value in found:
            request.headers[name] = value
    request.context["timestamp"] = amz_date[0]
    auth_cls = S3SigV4Auth if service == "s3" else SigV4Auth
    credentials = Credentials(keys.access_key_id, keys.secret_access_key, keys.session_token)
    signer = auth_cls(credentials, service, region)
    canonical = signer.canonical_request(request)
    expected = signer.signature(signer.string_to_sign(request, canonical), request)
    if not hmac.compare_digest(expected, signature):
        return "SignatureDoesNotMatch", None
    return None, (region, service)


def aws_chunked(body: bytes) -> tuple[bytes, dict[str, str]]:
    """The data and trailers of an aws-chunked body."""
    out, pos = [], 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";")[0], 16)
        pos = end + 2
        if size == 0:
            break
        out.append(body[pos : pos + size])
        pos += size + 2
    trailers = {}
    for line in body[pos:].split(b"\r\n"):
        if line:
            name, _, value = line.decode().partition(":")
            trailers[name.strip().lower()] = value.strip()
    return b"".join(out), trailers


def crc32(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def event(event_type: str, payload: dict[str, Any] | bytes, message_type: str = "event") -> bytes:
    """One message of AWS's event-stream encoding (what ConverseStream sends); an
    `exception` message names its type in :exception-type."""
    headers = b""
    for name, value in (
        (":message-type", message_type),
        (":event-type" if message_type == "event" else ":exception-type", event_type),
        (":content-type", "application/json"),
    ):
        headers += bytes([len(name)]) + name.encode() + b"\x07"
        headers += struct.pack(">H", len(value)) + value.encode()
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    prelude = struct.pack(">II", 12 + len(headers) + len(body) + 4, len(headers))
    message = prelude + struct.pack(">I", binascii.crc32(prelude)) + headers + body
    return message + struct.pack(">I", binascii.crc32(message))


@dataclass
class State:
    keys: Keys
    checked: list[Checked] = field(default_factory=list)
    objects: dict[tuple[str, str], bytes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # ConverseStream sends its first event, then waits for this before the rest.
    release: threading.Event = field(default_factory=threading.Event)
    released_late: list[bool] = field(default_factory=list)
    echo: bytes = b""  # what /echo answers with (an upstream that echoes the keys)
    # AssumeRole: temporary keys by key id, with their expiry (time.time()).
    temporary: dict[str, tuple[Keys, float]] = field(default_factory=dict)
    lifetime: float = 6.0
    sts_fails: bool = False
    assumed: list[str] = field(default_factory=list)  # the role ARNs asked for
    issued: list[tuple[float, float]] = field(default_factory=list)  # (when, expires)
    expired_uses: int = 0  # requests signed with temporary keys past their expiry

    def keys_for(self, authorization: str) -> tuple[Keys, bool]:
        """The keys a request claims to be signed with, and whether they are still valid."""
        m = _AUTH.fullmatch(authorization)
        found = self.temporary.get(m.group(1)) if m else None
        if found is None:
            return self.keys, True
        return found[0], time.time() < found[1]


class _AwsHandler(_Handler):
    server: _AwsServer

    def _handle(self) -> None:
        body = self.read_body()
        state = self.server.state
        received = Received(self.command, self.path, list(self.headers.items()), body, None)
        host = (self.headers.get("host") or "").lower()
        keys, valid = state.keys_for(self.headers.get("authorization") or "")
        refused, scope = verify(keys, self.command, self.path, received.headers, body)
        if refused is None and not valid:
            with state.lock:
                state.expired_uses += 1
            refused = "ExpiredToken"
        checked = Checked(received, host, refused, scope, body)
        with state.lock:
            state.checked.append(checked)
        if refused is not None:
            return self._send(
                403,
                b'{"__type": "%s"}' % refused.encode(),
                "application/json",
                [("x-amzn-errortype", refused)],
            )
        encodings = (self.headers.get("content-encoding") or "").lower()
        if "aws-chunked" in encodings:
            checked.payload, trailers = aws_chunked(body)
            declared = self.headers.get("x-amz-decoded-content-length")
            trailer = (self.headers.get("x-amz-trailer") or "").lower()
            if declared != str(len(checked.payload)) or trailers.get(trailer) != crc32(
                checked.payload
            ):
                return self._send(400, b'{"__type": "BadDigest"}', "application/json")
        if host.startswith("sts."):
            return self._sts(body, keys)
        if host.startswith("sqs."):
            return self._send(200, b"{}", "application/x-amz-json-1.0")
        if host.startswith("bedrock-runtime."):
            return self._bedrock()
        return self._s3(host, checked.payload)

    def _send(
        self, status: int, payload: bytes, kind: str, extra: list[tuple[str, str]] = ()
    ) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(payload)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _sts(self, body: bytes, keys: Keys) -> None:
        form = dict(parse_qsl(body.decode()))
        if form.get("Action") == "AssumeRole":
            return self._assume_role(form, keys)
        if form.get("Action") != "GetCallerIdentity":
            return self._send(400, b"<Error><Code>InvalidAction</Code></Error>", "text/xml")
        xml = (
            '<GetCallerIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            "<GetCallerIdentityResult><Arn>arn:aws:iam::123456789012:user/agent</Arn>"
            "<UserId>AIDAEXAMPLEUSERID</UserId><Account>123456789012</Account>"
            "</GetCallerIdentityResult><ResponseMetadata><RequestId>r-1</RequestId>"
            "</ResponseMetadata></GetCallerIdentityResponse>"
        )
        self._send(200, xml.encode(), "text/xml")

    def _assume_role(self, form: dict[str, str], keys: Keys) -> None:
        state = self.server.state
        if state.sts_fails or keys != state.keys:
            return self._send(403, b"<Error><Code>AccessDenied</Code></Error>", "text/xml")
        temporary = Keys(
            "ASIA" + secrets.token_hex(8).upper(),
            "temp/" + secrets.token_urlsafe(30),
            "temp-token-" + secrets.token_urlsafe(60),
        )
        expires = time.time() + state.lifetime
        with state.lock:
            state.temporary[temporary.access_key_id] = (temporary, expires)
            state.assumed.append(form.get("RoleArn", ""))
            state.issued.append((time.time(), expires))
        when = datetime.fromtimestamp(expires, UTC).isoformat(timespec="seconds")
        xml = (
            '<AssumeRoleResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            "<AssumeRoleResult><Credentials>"
            f"<AccessKeyId>{temporary.access_key_id}</AccessKeyId>"
            f"<SecretAccessKey>{temporary.secret_access_key}</SecretAccessKey>"
            f"<SessionToken>{temporary.session_token}</SessionToken>"
            f"<Expiration>{when}</Expiration>"
            "</Credentials></AssumeRoleResult></AssumeRoleResponse>"
        )
        self._send(200, xml.encode(), "text/xml")

    def _bedrock(self) -> None:
        path = urlsplit(self.path).path
        state = self.server.state
        usage = {} if path.startswith("/model/no-usage/") else {"usage": USAGE}
        if path.endswith("/converse"):
            answer = {
                "output": {"message": {"role": "assistant", "content": [{"text": "hello"}]}},
                "stopReason": "end_turn",
                **usage,
                "metrics": {"latencyMs": 1},
            }
            if path.startswith("/model/echo"):
                answer["output"]["message"]["content"] = [{"text": state.echo.decode()}]
            return self._send(200, json.dumps(answer).encode(), "application/json")
        if not path.endswith("/converse-stream"):
            return self._send(404, b'{"__type": "UnknownOperationException"}', "application/json")
        self.send_response(200)
        self.send_header("content-type", "application/vnd.amazon.eventstream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        text = state.echo.decode() if path.startswith("/model/echo") else "world"
        if path.startswith("/model/huge/"):
            text = "x" * HUGE_EVENT
        events = [
            event("messageStart", {"role": "assistant"}),
            event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "hello "}}),
            event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": text}}),
            event("contentBlockStop", {"contentBlockIndex": 0}),
            event("messageStop", {"stopReason": "end_turn"}),
            event("metadata", {**usage, "metrics": {"latencyMs": 1}}),
        ][: 6 if usage else 5]
        for i, message in enumerate(events):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(message), message))
            self.wfile.flush()
            if i == 1:
                # Only the agent having read the first events lets the rest go.
                state.released_late.append(state.release.wait(10))
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _s3(self, host: str, payload: bytes) -> None:
        state = self.server.state
        parts = urlsplit(self.path)
        path = parts.path
        if host.endswith(".s3.eu-west-1.amazonaws.com") and host != "s3.eu-west-1.amazonaws.com":
            bucket, key = host.split(".", 1)[0], path[1:]
        else:
            bucket, _, key = path[1:].partition("/")
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        if self.command == "PUT" and key:
            with state.lock:
                state.objects[(bucket, key)] = payload
            etag = f'"{hashlib.md5(payload).hexdigest()}"'  # noqa: S324 - S3's ETag
            return self._send(200, b"", "application/xml", [("etag", etag)])
        if self.command == "GET" and key == "echo":
            return self._send(200, state.echo, "application/octet-stream")
        if self.command in ("GET", "HEAD") and key:
            found = state.objects.get((bucket, key))
            if found is None:
                return self._send(404, b"<Error><Code>NoSuchKey</Code></Error>", "application/xml")
            return self._send(200, found, "application/octet-stream")
        if self.command == "GET" and query.get("list-type") == "2":
            prefix = query.get("prefix", "")
            keys = sorted(k for b, k in state.objects if b == bucket and k.startswith(prefix))
            contents = "".join(
                f"<Contents><Key>{k}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                f'<ETag>"e"</ETag><Size>{len(state.objects[(bucket, k)])}</Size>'
                "<StorageClass>STANDARD</StorageClass></Contents>"
                for k in keys
            )
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>'
                '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Name>{bucket}</Name><Prefix>{prefix}</Prefix><KeyCount>{len(keys)}</KeyCount>"
                f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{contents}"
                "</ListBucketResult>"
            )
            return self._send(200, xml.encode(), "application/xml")
        self._send(400, b"<Error><Code>NotImplemented</Code></Error>", "application/xml")

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle


class _AwsServer(_Server):
    state: State


class FakeAws:
    """Serves HTTPS for `names` (certificate from a trustme CA), verifying with `keys`."""

    def __init__(self, ca: Any, names: list[str], keys: Keys) -> None:
        self.state = State(keys)
        self.server = _AwsServer(("127.0.0.1", 0), _AwsHandler)
        self.server.log = Log()
        self.server.context = context_for(ca, names, lambda name: None)
        self.server.state = self.state
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeAws:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def clear(self) -> list[Checked]:
        with self.state.lock:
            seen = list(self.state.checked)
            self.state.checked.clear()
        self.state.release.clear()
        self.state.released_late.clear()
        self.state.assumed.clear()
        self.state.issued.clear()
        self.state.expired_uses, self.state.sts_fails = 0, False
        return seen

    @property
    def checked(self) -> list[Checked]:
        with self.state.lock:
            return list(self.state.checked)
