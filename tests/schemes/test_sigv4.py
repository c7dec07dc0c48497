"""SigV4: how a request's payload is signed, the query as forwarded, and botocore's signature
over exactly what is forwarded (checked by recomputing it from the real keys)."""

from __future__ import annotations

import json
import pickle

import pytest

from addon.core.reasons import Reason
from addon.schemes import awssdk
from addon.schemes.sigv4 import HELD, TRAILER, UNSIGNED, Signer, Unsignable, signed_query
from store.crypto import Secret
from store.records import CredentialRecord
from store.rules.aws import Scope
from store.rules.grammar import parse_host
from tests.e2e.fakeaws import Keys, verify

KEYS = Keys("AKIAREALKEYREALKEY00", "real-secret-access-key", "real-session-token")
LIMIT = 1000


def credential(**options: str) -> CredentialRecord:
    return CredentialRecord(
        name="aws",
        scheme="sigv4",
        header_name=None,
        param_name=None,
        hosts=(parse_host("s3.eu-west-1.amazonaws.com"),),
        secret=Secret(KEYS.json()),
        fingerprint="fp",
        options=dict(options),
    )


SIGNER = Signer(credential())
S3 = "s3.eu-west-1.amazonaws.com"
SQS = "sqs.eu-west-1.amazonaws.com"


def headers(*fields: tuple[bytes, bytes]) -> dict[bytes, list[bytes]]:
    index: dict[bytes, list[bytes]] = {}
    for name, value in fields:
        index.setdefault(name, []).append(value)
    return index


@pytest.mark.parametrize(
    ("host", "fields", "h2", "payload"),
    [
        pytest.param(S3, (), False, HELD, id="no body: held (empty) and hashed"),
        pytest.param(S3, ((b"content-length", b"1000"),), False, HELD, id="up to the limit"),
        pytest.param(
            S3, ((b"content-length", b"1001"),), False, UNSIGNED, id="S3 over the limit: unsigned"
        ),
        pytest.param(
            S3,
            ((b"transfer-encoding", b"chunked"),),
            False,
            UNSIGNED,
            id="S3 of unknown length: unsigned",
        ),
        pytest.param(
            S3,
            (
                (b"content-encoding", b"aws-chunked"),
                (b"x-amz-content-sha256", b"STREAMING-UNSIGNED-PAYLOAD-TRAILER"),
                (b"transfer-encoding", b"chunked"),
            ),
            False,
            TRAILER,
            id="aws-chunked with unsigned trailers: kept",
        ),
        pytest.param(
            SQS,
            ((b"transfer-encoding", b"chunked"),),
            False,
            HELD,
            id="another service of unknown length: held up to the limit",
        ),
        pytest.param(SQS, (), True, HELD, id="HTTP/2 without a length: held, bounded"),
    ],
)
def test_plan(host: str, fields: tuple[tuple[bytes, bytes], ...], h2: bool, payload: str):
    assert SIGNER.plan(host, headers(*fields), h2, LIMIT).payload == payload


@pytest.mark.parametrize(
    ("host", "fields", "reason", "says"),
    [
        pytest.param(
            SQS,
            ((b"content-length", b"1001"),),
            Reason.BODY_TOO_LARGE,
            "only S3 takes an unsigned payload",
            id="another service over the limit: 413",
        ),
        pytest.param(
            S3,
            (
                (b"content-encoding", b"aws-chunked"),
                (b"x-amz-content-sha256", b"STREAMING-AWS4-HMAC-SHA256-PAYLOAD"),
            ),
            Reason.SIGNING_UNSUPPORTED,
            "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
            id="chunk-signed aws-chunked: refused, saying so",
        ),
        pytest.param(
            S3,
            ((b"x-amz-content-sha256", b"STREAMING-AWS4-ECDSA-P256-SHA256-PAYLOAD"),),
            Reason.SIGNING_UNSUPPORTED,
            "cannot be re-signed",
            id="SigV4a chunk signatures: refused",
        ),
        pytest.param(
            SQS,
            (
                (b"content-encoding", b"aws-chunked"),
                (b"x-amz-content-sha256", b"STREAMING-UNSIGNED-PAYLOAD-TRAILER"),
            ),
            Reason.SIGNING_UNSUPPORTED,
            "to S3",
            id="unsigned trailers to another service: refused",
        ),
        pytest.param(
            "api.example.com", (), Reason.SIGNING_UNSUPPORTED, "no AWS service", id="no scope"
        ),
    ],
)
def test_plan_refuses(host: str, fields: tuple[tuple[bytes, bytes], ...], reason, says):
    with pytest.raises(Unsignable) as raised:
        SIGNER.plan(host, headers(*fields), False, LIMIT)
    assert raised.value.reason is reason and says in raised.value.detail


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        pytest.param(None, None, id="none"),
        pytest.param(b"", None, id="empty"),
        pytest.param(b"list-type=2&prefix=a/b", b"list-type=2&prefix=a%2Fb", id="re-encoded"),
        pytest.param(b"x=a+b&y=%7e%41", b"x=a%2Bb&y=~A", id="plus is a plus, unreserved plain"),
        pytest.param(b"flag&&z=1", b"flag=&z=1", id="no value, empty pairs"),
        pytest.param(
            b"X-Amz-Signature=s&x-amz-credential=c&X%2DAmz%2DDate=d&Signature=s&Expires=1"
            b"&AWSAccessKeyId=k&X-Amz-Security-Token=t&versionId=3",
            b"versionId=3",
            id="presigned parameters go, in any case or encoding",
        ),
        pytest.param(b"a=%3Bb%3D", b"a=%3Bb%3D", id="a ; stays inside its value"),
    ],
)
def test_signed_query(query: bytes | None, expected: bytes | None):
    assert signed_query(query) == expected


def _signed(host: str, target: str, fields, body: bytes | None, payload: str):
    plan = SIGNER.plan(host, headers(*fields), False, 10**9)._replace(payload=payload)
    added = SIGNER.sign("PUT", f"https://{host}{target}", fields, body, plan)
    return [(k.decode(), v.decode()) for k, v in (*fields, *added)]


@pytest.mark.parametrize(
    ("host", "payload", "body"),
    [
        pytest.param(S3, HELD, b"hello", id="S3, its body hashed"),
        pytest.param(S3, UNSIGNED, b"hello", id="S3, unsigned payload"),
        pytest.param(SQS, HELD, b"Action=SendMessage", id="another service, its body hashed"),
        pytest.param(SQS, HELD, b"", id="another service, no body"),
    ],
)
def test_the_signature_holds_for_exactly_what_is_forwarded(host: str, payload: str, body):
    target = "/mybucket/a%3Ab~c?prefix=a%2Fb&x="
    fields = ((b"host", host.encode()), (b"content-type", b"text/plain"))
    sent = _signed(host, target, fields, body, payload)
    assert verify(KEYS, "PUT", target, sent, body) == (None, ("eu-west-1", host.split(".")[0]))
    # Anything else than what was signed fails: another path, query, header value or body.
    assert verify(KEYS, "PUT", target.replace("a%3Ab", "a:b"), sent, body)[0] is not None
    assert verify(KEYS, "PUT", target + "1", sent, body)[0] is not None
    changed = [(k, "text/html" if k == "content-type" else v) for k, v in sent]
    assert verify(KEYS, "PUT", target, changed, body)[0] is not None
    if payload == HELD:
        assert verify(KEYS, "PUT", target, sent, body + b"!")[0] is not None


def test_the_session_token_is_sent_and_signed():
    sent = dict(_signed(SQS, "/", ((b"host", SQS.encode()),), b"", HELD))
    assert sent["x-amz-security-token"] == KEYS.session_token
    assert "x-amz-security-token" in sent["authorization"]


def test_flags_set_the_scope():
    signer = Signer(credential(service="execute-api", region="eu-west-2"))
    assert signer.scope("api.internal.example") == Scope("execute-api", "eu-west-2", False)


def test_a_signer_shows_no_key():
    text = repr(SIGNER) + str(SIGNER)
    assert all(v not in text for v in (KEYS.secret_access_key, KEYS.session_token))
    with pytest.raises(TypeError):
        pickle.dumps(SIGNER)
    assert set(SIGNER.secrets) == {
        KEYS.secret_access_key.encode(),
        KEYS.session_token.encode(),  # type: ignore[union-attr]
        KEYS.access_key_id.encode(),
    }
    assert json.loads(KEYS.json())["access_key_id"] == KEYS.access_key_id


def test_the_payload_markers_are_botocores() -> None:
    from botocore import auth

    assert awssdk.UNSIGNED_PAYLOAD == auth.UNSIGNED_PAYLOAD
    assert awssdk.STREAMING_UNSIGNED_PAYLOAD_TRAILER == auth.STREAMING_UNSIGNED_PAYLOAD_TRAILER
