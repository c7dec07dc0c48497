"""AWS Signature Version 4 at the edge: the agent's own signature out, ours in as it leaves.

The sandbox holds dummy keys; its SDK signs with them. credproxy removes everything that
signature put on the request, then signs what it forwards (its canonical path, the query
re-encoded as SigV4 canonicalises it, the headers as sent) with botocore's SigV4Auth, or
S3SigV4Auth for S3: the reference implementation, never a signer of our own.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn
from urllib.parse import quote, unquote_to_bytes

from addon.core.reasons import Reason
from addon.schemes.assume import SESSIONS, RoleSession
from addon.schemes.awssdk import STREAMING_UNSIGNED_PAYLOAD_TRAILER, UNSIGNED_PAYLOAD, botocore
from addon.schemes.stamp import Refused, Signs, Stamp, Stamping, write
from store.records import CredentialRecord
from store.rules import aws
from store.rules.grammar import BadPath, canonicalize

if TYPE_CHECKING:
    from botocore.credentials import Credentials
    from mitmproxy import http

    from addon.core.policy import Rule
    from addon.core.verdict import HeaderScan, Verdict

# botocore logs canonical requests at debug level, the session token among their headers.
logging.getLogger("botocore").setLevel(logging.WARNING)

# What an SDK writes for its own signature: removed, whatever the agent put there.
AGENT_HEADERS = frozenset(
    (b"authorization", b"x-amz-date", b"x-amz-security-token", b"x-amz-content-sha256", b"date")
)
# What botocore writes for ours (Date only when asked for: it never is, Date is removed).
SIGNATURE_HEADERS = ("Authorization", "X-Amz-Date", "X-Amz-Security-Token", "X-Amz-Content-SHA256")
# Presigned-URL parameters, SigV4's and SigV2's; AWS reads their names without case.
PRESIGNED = frozenset(
    name.lower().encode()
    for name in (
        "X-Amz-Algorithm",
        "X-Amz-Credential",
        "X-Amz-Date",
        "X-Amz-Expires",
        "X-Amz-SignedHeaders",
        "X-Amz-Signature",
        "X-Amz-Security-Token",
        "AWSAccessKeyId",
        "Signature",
        "Expires",
    )
)
HELD = "held"  # the body is held whole and its SHA-256 signed
UNSIGNED = UNSIGNED_PAYLOAD
TRAILER = STREAMING_UNSIGNED_PAYLOAD_TRAILER
DEFAULT_BODY_LIMIT = 8 * 1024 * 1024
SCOPE_CACHE = 1024


class Unsignable(Refused):
    """A request that cannot be signed as it is; carries the deny's reason and detail."""


# Services whose answers can hold new AWS keys (AssumeRole, GetSessionToken, CreateAccessKey,
# GetCredentialsForIdentity, ...): signed with the stored keys, they would mint keys for the
# agent. Such an answer is refused (addon/proxy/responses.py).
MINTING_SERVICES = frozenset({"sts", "iam", "cognito-identity", "sso", "awsssoportal"})


class Plan(NamedTuple):
    """How one request is signed: its scope, how its payload is (or is not) hashed, and the
    role whose temporary keys sign it (None: the stored keys)."""

    scope: aws.Scope
    payload: str  # HELD, UNSIGNED or TRAILER
    role: RoleSession | None = None


class _S3Unsigned:
    """What S3SigV4Auth reads from a client config to leave a payload unsigned."""

    s3 = {"payload_signing_enabled": False}


def key_secrets(credential: CredentialRecord) -> tuple[bytes, ...]:
    """Redacted from responses: the secret key, the token, and the key id AWS errors echo."""
    keys = json.loads(credential.secret.reveal())
    found = (keys["secret_access_key"], keys.get("session_token"), keys["access_key_id"])
    return tuple(value.encode() for value in found if value)


class Signer:
    """One sigv4 credential, opened once per policy. Its repr never shows a key."""

    __slots__ = ("_credentials", "secrets", "service", "region", "_scopes", "role")

    def __init__(self, credential: CredentialRecord) -> None:
        keys = json.loads(credential.secret.reveal())
        token = keys.get("session_token")
        self._credentials = botocore().Credentials(
            keys["access_key_id"], keys["secret_access_key"], token
        )
        self.secrets = key_secrets(credential)
        self.service: str | None = credential.options.get("service")
        self.region: str | None = credential.options.get("region")
        self._scopes: dict[str, aws.Scope | None] = {}
        self.role: RoleSession | None = None
        if credential.options.get("assume_role"):
            self.role = SESSIONS.get(
                credential.name, credential.fingerprint, self._credentials, credential.options
            )

    def __repr__(self) -> str:
        return "Signer([secure])"

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Signer cannot be pickled")

    def scope(self, host: str) -> aws.Scope | None:
        found = self._scopes.get(host, False)
        if found is False:
            if len(self._scopes) >= SCOPE_CACHE:
                self._scopes.clear()
            found = self._scopes[host] = aws.scope_of(host, self.service, self.region)
        return found  # type: ignore[return-value]

    def plan(self, host: str, index: dict[bytes, list[bytes]], is_http2: bool, limit: int) -> Plan:
        """Decide from the head alone how the body is signed.

        Raises: Unsignable, before anything is spent or sent.
        """
        scope = self.scope(host)
        if scope is None:
            raise Unsignable(Reason.SIGNING_UNSUPPORTED, "no AWS service and region for this host")
        declared = b",".join(index.get(b"x-amz-content-sha256", ())).strip()
        codings = {
            c.strip().lower() for v in index.get(b"content-encoding", ()) for c in v.split(b",")
        }
        if declared.startswith(b"STREAMING-") or b"aws-chunked" in codings:
            if declared == TRAILER.encode() and b"aws-chunked" in codings and scope.s3:
                return Plan(scope, TRAILER, self.role)  # chunk framing and trailers go as they are
            raise Unsignable(
                Reason.SIGNING_UNSUPPORTED,
                "aws-chunked bodies are forwarded only with STREAMING-UNSIGNED-PAYLOAD-TRAILER "
                "(to S3); chunk-signed bodies (STREAMING-AWS4-HMAC-SHA256-PAYLOAD) cannot be "
                "re-signed",
            )
        lengths = index.get(b"content-length")
        length: int | None
        if lengths:
            length = int(lengths[0]) if lengths[0].strip().isdigit() else None
        elif b"transfer-encoding" in index or is_http2:
            length = None  # unknown until it has arrived
        else:
            length = 0
        if length is not None and length <= limit:
            return Plan(scope, HELD, self.role)
        if scope.s3:
            return Plan(scope, UNSIGNED, self.role)  # streamed; S3 takes it over TLS
        if length is None:
            return Plan(scope, HELD, self.role)  # held up to the limit, refused past it
        raise Unsignable(Reason.BODY_TOO_LARGE, too_large(limit, scope.service))

    def sign(
        self,
        method: str,
        url: str,
        fields: tuple[tuple[bytes, bytes], ...],
        body: bytes | None,
        plan: Plan,
        credentials: Credentials | None = None,
    ) -> tuple[tuple[bytes, bytes], ...]:
        """The header fields that sign this request, exactly as `url` and `fields` say, with
        `credentials` (temporary keys) or the stored keys."""
        sdk = botocore()
        request = sdk.AWSRequest(method=method, url=url, data=body)
        for name, value in fields:
            request.headers[name.decode("latin-1")] = value.decode("latin-1")
        context: dict[str, Any] = request.context
        if plan.payload == TRAILER:
            context["checksum"] = {"request_algorithm": {"in": "trailer"}}
        elif plan.payload == UNSIGNED:
            context["payload_signing_enabled"] = False
            context["client_config"] = _S3Unsigned
        auth = sdk.S3SigV4Auth if plan.scope.s3 else sdk.SigV4Auth
        keys = credentials or self._credentials
        auth(keys, plan.scope.service, plan.scope.region).add_auth(request)
        return tuple(
            (name.lower().encode(), request.headers[name].encode("latin-1"))
            for name in SIGNATURE_HEADERS
            if name in request.headers
        )


def too_large(limit: int, service: str) -> str:
    return (
        f"a body over {limit} bytes is not signed for {service}: only S3 takes an unsigned "
        "payload (raise --max-signed-body)"
    )


def signed_query(query: bytes | None) -> bytes | None:
    """The query without presigned-URL parameters, each name and value encoded the way SigV4
    canonicalises them (unreserved characters literal, the rest %XX), so that the upstream's
    reading and the signature agree on every byte. `+` is a plus sign, as in SigV4."""
    if not query:
        return None
    kept = []
    for pair in query.split(b"&"):
        if not pair:
            continue
        raw_name, _, raw_value = pair.partition(b"=")
        name = unquote_to_bytes(raw_name)
        if name.lower() in PRESIGNED:
            continue
        value = unquote_to_bytes(raw_value)
        kept.append(quote(name, safe="-_.~").encode() + b"=" + quote(value, safe="-_.~").encode())
    return b"&".join(kept) or None


class SigV4Stamp(Stamp):
    """sigv4: the agent's signature out, ours over what is forwarded (the stored keys', or
    its role's temporary ones)."""

    __slots__ = ("signer",)

    def __init__(self, credential: CredentialRecord) -> None:
        super().__init__(credential, removed=AGENT_HEADERS)
        self.signer = Signer(credential)
        self.redacts = self.signer.secrets

    @classmethod
    def stored(cls, credential: CredentialRecord) -> tuple[bytes, ...]:
        return key_secrets(credential)

    def prepare(
        self, verdict: Verdict, request: http.Request, headers: HeaderScan, limit: int
    ) -> Stamping:
        assert verdict.rule is not None and verdict.host is not None
        _check_s3_reach(verdict.rule, headers.index)
        return Signed(self, self.signer.plan(verdict.host, headers.index, request.is_http2, limit))


class Signed(Stamping):
    """One request's signing plan."""

    __slots__ = ("stamp", "plan", "minting")

    def __init__(self, stamp: SigV4Stamp, plan: Plan) -> None:
        self.stamp, self.plan = stamp, plan
        self.minting = plan.scope.service in MINTING_SERVICES

    def pending(self) -> RoleSession | None:
        role = self.plan.role
        return role if role is not None and role.now() is None else None

    def redacted(self) -> tuple[bytes, ...]:
        secrets = self.stamp.redacts
        if self.plan.role is not None:
            temporary = self.plan.role.now()
            secrets += temporary.secrets if temporary is not None else ()
        return secrets

    def apply(self, flow: http.HTTPFlow, path: str, query: bytes | None) -> None:
        write(flow.request, self.stamp.names, self.stamp.fields, path, signed_query(query))

    def sign(self, flow: http.HTTPFlow, signing: Signs) -> None:
        signing.apply(flow, self.stamp.signer, self.plan)


def _check_s3_reach(rule: Rule, index: dict[bytes, list[bytes]]) -> None:
    """Headers by which a signed S3 request reaches past its grant's paths: a copy reads its
    source with the stored keys (so the source must be one the grant lets it GET), and ACL
    headers open objects to others.

    Raises: Refused.
    """
    if b"x-amz-acl" in index or any(name.startswith(b"x-amz-grant-") for name in index):
        raise Refused(Reason.BAD_REQUEST, "S3 ACL headers are not sent with a stored key")
    for source in index.get(b"x-amz-copy-source", []):
        target = source.split(b"?", 1)[0].strip()
        target = target if target.startswith(b"/") else b"/" + target
        try:
            path, _ = canonicalize(target)
        except BadPath as e:
            raise Refused(Reason.BAD_REQUEST, "invalid x-amz-copy-source") from e
        if not rule.allows_method("GET") or rule.longest_path(path) < 0:
            raise Refused(
                Reason.PATH_NOT_ALLOWED, "the copy source is outside what the grant may read"
            )
