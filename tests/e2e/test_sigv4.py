"""SigV4 at the edge, end to end: boto3 in the sandbox with dummy keys, a real credproxy, and a
fake AWS (tests/e2e/fakeaws.py) that accepts only signatures botocore recomputes from the real
keys over the request exactly as it arrived.

Secrets are only ever asserted with `not in`; nothing prints them.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import trustme
from botocore.config import Config
from botocore.exceptions import ClientError

from store.crypto import Secret
from tests.e2e.conftest import CREDPROXY, Proxy, start_proxy, stop_proxy
from tests.e2e.fakeaws import Checked, FakeAws, Keys

pytestmark = pytest.mark.e2e

S3 = "s3.eu-west-1.amazonaws.com"
BUCKET_HOST = "mybucket.s3.eu-west-1.amazonaws.com"
BEDROCK = "bedrock-runtime.us-east-1.amazonaws.com"
STS = "sts.amazonaws.com"
SQS = "sqs.eu-west-1.amazonaws.com"
NAMES = [S3, BUCKET_HOST, BEDROCK, STS, SQS]
ROLE_ARN = "arn:aws:iam::123456789012:role/agent"
LIMIT = 1024 * 1024  # --max-signed-body for this module's proxy
REAL = Keys(
    "AKIA" + secrets.token_hex(8).upper(),
    "real/" + secrets.token_urlsafe(30),
    "FwoG" + secrets.token_urlsafe(300),
)
DUMMY = Keys("AKIADUMMYDUMMYDUMMY1", "dummy-secret-access-key")
MODEL = "anthropic.claude-3-haiku-20240307-v1:0"


class Sandbox:
    """The proxy, the fake AWS, and the principals with their grants."""

    def __init__(self, proxy: Proxy, aws: FakeAws, cli_output: list[str]) -> None:
        self.proxy, self.aws, self.cli_output = proxy, aws, cli_output
        store = proxy.store
        self.agent = store.add_principal("agent")
        self.narrow = store.add_principal("narrow")
        for host, method, path in [
            (S3, "GET", "/mybucket"),
            (S3, "PUT", "/mybucket/data/"),
            (BUCKET_HOST, "GET", "/"),
            (BUCKET_HOST, "PUT", "/data/"),
            (BEDROCK, "POST", "/model/"),
            (STS, "POST", "/"),
        ]:
            store.add_grant("agent", [method], credential="aws", hosts=[host], paths=[path])
        store.add_grant(
            "narrow", ["GET", "PUT"], credential="aws", hosts=[S3], paths=["/mybucket/data/"]
        )
        options = {"assume_role": ROLE_ARN, "external_id": "ext-1"}
        store.add_credential("role", "sigv4", [SQS], Secret(REAL.json()), options=options)
        store.add_grant("agent", ["POST"], credential="role", hosts=[SQS], paths=["/"])
        proxy.wait_reload()

    def client(self, service: str, region: str, principal: str = "agent", **config: Any) -> Any:
        token = self.agent if principal == "agent" else self.narrow
        extra = {"endpoint_url": f"https://{STS}"} if service == "sts" else {}
        session = boto3.session.Session(
            aws_access_key_id=DUMMY.access_key_id,
            aws_secret_access_key=DUMMY.secret_access_key,
            region_name=region,
        )
        return session.client(
            service,
            verify=str(self.proxy.ca_file),
            config=Config(
                proxies={"https": self.proxy.url(principal, token)},
                retries={"max_attempts": 1, "mode": "standard"},
                **config,
            ),
            **extra,
        )

    def s3(self, style: str = "path", principal: str = "agent", **config: Any) -> Any:
        return self.client("s3", "eu-west-1", principal, s3={"addressing_style": style}, **config)

    def httpx(self, principal: str = "agent") -> httpx.Client:
        token = self.agent if principal == "agent" else self.narrow
        return self.proxy.client(principal, token, timeout=30)


@pytest.fixture(scope="module")
def sandbox(
    tmp_path_factory: pytest.TempPathFactory, upstream_ca: trustme.CA, initialised_home: Path
) -> Iterator[Sandbox]:
    with FakeAws(upstream_ca, NAMES, REAL) as aws:
        home = tmp_path_factory.mktemp("sigv4")
        resolve = [f"{name}=127.0.0.1:{aws.port}" for name in NAMES]
        proxy = start_proxy(
            home,
            upstream_ca,
            resolve,
            extra=["--max-signed-body", str(LIMIT)],
            template=initialised_home,
        )
        try:
            outputs = []
            add = [*CREDPROXY, "credential", "add", "aws", "--scheme", "sigv4", "--json"]
            for name in NAMES:
                add += ["--host", name]
            for args, stdin in [(add, REAL.json()), ([*CREDPROXY, "credential", "list"], b"")]:
                done = subprocess.run(
                    args, input=stdin, env=proxy.env, cwd=home, capture_output=True, check=True
                )
                outputs.append(done.stdout.decode() + done.stderr.decode())
            yield Sandbox(proxy, aws, outputs)
        finally:
            stop_proxy(proxy)


@pytest.fixture
def aws(sandbox: Sandbox) -> FakeAws:
    sandbox.aws.clear()
    return sandbox.aws


def _verified(checked: list[Checked]) -> list[Checked]:
    assert checked, "the fake AWS received nothing"
    assert [c.refused for c in checked] == [None] * len(checked)
    return checked


# -- real clients, signed at the edge -----------------------------------------------------


def test_s3_put_get_and_list_with_a_prefix_are_signed_for_s3(sandbox: Sandbox, aws: FakeAws):
    s3 = sandbox.s3()
    s3.put_object(Bucket="mybucket", Key="data/a.txt", Body=b"alpha")
    s3.put_object(Bucket="mybucket", Key="data/b.txt", Body=b"beta")
    s3.put_object(Bucket="mybucket", Key="data/sub/c.txt", Body=b"gamma")
    assert s3.get_object(Bucket="mybucket", Key="data/a.txt")["Body"].read() == b"alpha"
    listed = s3.list_objects_v2(Bucket="mybucket", Prefix="data/sub/")
    assert [o["Key"] for o in listed["Contents"]] == ["data/sub/c.txt"]
    checked = _verified(aws.checked)
    assert {c.scope for c in checked} == {("eu-west-1", "s3")}
    puts = [c for c in checked if c.received.method == "PUT"]
    # boto3 sends uploads aws-chunked with a CRC32 trailer: kept as sent, headers re-signed.
    assert {c.received.header("x-amz-content-sha256")[0] for c in puts} == {
        "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
    }


def test_virtual_hosted_s3_and_a_held_body_signed_with_its_hash(sandbox: Sandbox, aws: FakeAws):
    s3 = sandbox.s3("virtual", request_checksum_calculation="when_required")
    s3.put_object(Bucket="mybucket", Key="data/v.txt", Body=b"virtual")
    assert s3.get_object(Bucket="mybucket", Key="data/v.txt")["Body"].read() == b"virtual"
    put, get = _verified(aws.checked)
    assert put.host == BUCKET_HOST and put.received.target == "/data/v.txt"
    # Held whole and hashed: the fake checked x-amz-content-sha256 against the body.
    assert put.received.header("x-amz-content-sha256")[0] not in (
        "UNSIGNED-PAYLOAD",
        "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
    )


def test_20_mib_uploads_stream_unsigned_or_with_trailers(sandbox: Sandbox, aws: FakeAws):
    big = secrets.token_bytes(20 * 1024 * 1024)
    sandbox.s3().put_object(Bucket="mybucket", Key="data/big-trailer", Body=big)
    plain = sandbox.s3(request_checksum_calculation="when_required")
    plain.put_object(Bucket="mybucket", Key="data/big-plain", Body=big)
    # The download streams through the proxy, redacted chunk by chunk, and arrives whole.
    assert plain.get_object(Bucket="mybucket", Key="data/big-plain")["Body"].read() == big
    trailer, unsigned, _ = _verified(aws.checked)
    assert trailer.payload == big and unsigned.payload == big
    assert unsigned.received.header("x-amz-content-sha256") == ["UNSIGNED-PAYLOAD"]
    assert trailer.received.header("x-amz-content-sha256") == ["STREAMING-UNSIGNED-PAYLOAD-TRAILER"]


def test_bedrock_converse_signs_as_bedrock(sandbox: Sandbox, aws: FakeAws):
    bedrock = sandbox.client("bedrock-runtime", "us-east-1")
    answer = bedrock.converse(
        modelId=MODEL, messages=[{"role": "user", "content": [{"text": "hi"}]}]
    )
    assert answer["output"]["message"]["content"] == [{"text": "hello"}]
    (checked,) = _verified(aws.checked)
    assert checked.scope == ("us-east-1", "bedrock")
    assert checked.received.target == "/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse"


def test_an_event_stream_flows_event_by_event(sandbox: Sandbox, aws: FakeAws):
    bedrock = sandbox.client("bedrock-runtime", "us-east-1")
    stream = bedrock.converse_stream(
        modelId=MODEL, messages=[{"role": "user", "content": [{"text": "hi"}]}]
    )["stream"]
    kinds = []
    for item in stream:
        kinds.append(next(iter(item)))
        if len(kinds) == 1:
            # The fake holds the rest back until the first event has reached the agent.
            aws.state.release.set()
    assert kinds[:3] == ["messageStart", "contentBlockDelta", "contentBlockDelta"]
    assert kinds[-1] == "metadata"
    assert aws.state.released_late == [True]
    _verified(aws.checked)


def test_sts_get_caller_identity_on_the_global_endpoint(sandbox: Sandbox, aws: FakeAws):
    identity = sandbox.client("sts", "us-east-1").get_caller_identity()
    assert identity["Account"] == "123456789012"
    (checked,) = _verified(aws.checked)
    assert checked.scope == ("us-east-1", "sts")
    assert checked.received.body == b"Action=GetCallerIdentity&Version=2011-06-15"


def test_keys_minted_with_the_stored_ones_never_reach_the_agent(sandbox: Sandbox, aws: FakeAws):
    """A grant on STS lets the agent's SDK call AssumeRole (or GetSessionToken) signed with
    the real keys; the answer would hand the agent working keys. It is refused whole."""
    sts = sandbox.client("sts", "us-east-1")
    # botocore reads the problem document as an unparsable XML answer.
    with pytest.raises(Exception, match="credentials-in-response") as refused:
        sts.assume_role(RoleArn=ROLE_ARN, RoleSessionName="agent-mints")
    minted = [keys for keys, _ in aws.state.temporary.values()]
    assert minted, "the fake issued no keys: the test proves nothing"
    seen = str(refused.value) + sandbox.proxy.output()
    for keys in minted:
        assert keys.secret_access_key not in seen and keys.session_token not in seen
    (line,) = [r for r in sandbox.proxy.requests("agent") if r.get("status") == 502][-1:]
    assert (line["decision"], line["reason"], line["error"]) == (
        "deny",
        "credentials-in-response",
        "minted-credentials",
    )


def test_a_copy_or_an_acl_never_reaches_past_the_grants_paths(sandbox: Sandbox, aws: FakeAws):
    """A PUT inside the granted prefix whose x-amz-copy-source names an object outside it
    would read that object with the stored keys; ACL headers would open objects to others."""
    s3 = sandbox.s3(principal="narrow")
    with pytest.raises(ClientError) as outside:
        s3.copy_object(
            Bucket="mybucket", Key="data/stolen", CopySource="mybucket/private/secret.txt"
        )
    assert outside.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    with pytest.raises(ClientError) as public:
        s3.put_object(Bucket="mybucket", Key="data/open.txt", Body=b"x", ACL="public-read")
    assert public.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert aws.checked == []
    reasons = [r.get("reason") for r in sandbox.proxy.requests("narrow")][-2:]
    assert reasons == ["path-not-allowed", "bad-request"]


# -- what is signed is what is forwarded ----------------------------------------------------


def test_the_signature_covers_the_forwarded_path_and_query(sandbox: Sandbox, aws: FakeAws):
    """The agent's target is not what leaves: dot segments resolved, unreserved escapes
    decoded, presigned parameters removed, the query re-encoded. Signing the agent's form
    instead of the forwarded one fails the fake's verification."""
    presigned = (
        "X-Amz-Algorithm=AWS4-HMAC-SHA256"
        f"&X-Amz-Credential={DUMMY.access_key_id}%2F20260101%2Feu-west-1%2Fs3%2Faws4_request"
        "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=60&X-Amz-SignedHeaders=host"
        "&X-Amz-Signature=" + "ab" * 32 + f"&AWSAccessKeyId={DUMMY.access_key_id}"
        "&Signature=c2lnbmF0dXJl&Expires=1999999999&x-amz-security-token=dummy"
    )
    with sandbox.httpx() as client:
        answer = client.get(
            f"https://{S3}/mybucket/./data/%7Emissing?{presigned}&versionId=a+b&prefix=x/y&flag",
            headers={
                "authorization": f"AWS4-HMAC-SHA256 Credential={DUMMY.access_key_id}/x",
                "x-amz-date": "20200101T000000Z",
                "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
                "x-amz-security-token": "dummy-token",
            },
        )
    assert answer.status_code == 404  # verified, then the object is not there
    (checked,) = _verified(aws.checked)
    assert checked.received.target == "/mybucket/data/~missing?versionId=a%2Bb&prefix=x%2Fy&flag="


def test_the_verifier_refuses_a_signature_over_anything_else(sandbox: Sandbox, aws: FakeAws):
    """The fake's check can fail: the agent's own (dummy) signature, sent straight to it,
    and a real signature over another path, are both refused."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from tests.e2e.fakeaws import verify

    def signed(keys: Keys, path: str) -> list[tuple[str, str]]:
        request = AWSRequest(method="GET", url=f"https://{S3}{path}")
        request.headers["host"] = S3
        credentials = Credentials(keys.access_key_id, keys.secret_access_key, keys.session_token)
        S3SigV4Auth(credentials, "s3", "eu-west-1").add_auth(request)
        return list(request.headers.items())

    assert verify(REAL, "GET", "/mybucket/data/x", signed(REAL, "/mybucket/data/x"), b"")[0] is None
    assert verify(REAL, "GET", "/mybucket/data/x", signed(DUMMY, "/mybucket/data/x"), b"")[0] == (
        "InvalidAccessKeyId"
    )
    assert (
        verify(REAL, "GET", "/mybucket/data/x", signed(REAL, "/mybucket/./data/x"), b"")[0]
        == "SignatureDoesNotMatch"
    )


def test_the_agents_signature_and_dummy_key_never_reach_the_upstream(
    sandbox: Sandbox, aws: FakeAws
):
    s3 = sandbox.s3()
    s3.put_object(Bucket="mybucket", Key="data/k", Body=b"k")
    s3.get_object(Bucket="mybucket", Key="data/k")
    sandbox.client("sts", "us-east-1").get_caller_identity()
    for checked in _verified(aws.checked):
        seen = checked.received.target + json.dumps(checked.received.headers)
        assert DUMMY.access_key_id not in seen and DUMMY.secret_access_key not in seen
        assert f"Credential={REAL.access_key_id}/" in checked.received.header("authorization")[0]


def _h2_exchange(
    tls: Any, requests: list[tuple[str, str, str, bytes]]
) -> list[tuple[int, dict[str, str], bytes]]:
    """Each (method, host, path, body) as a stream of one HTTP/2 connection, in turn; a body
    goes as DATA frames with no Content-Length. Replies: status, fields, body."""
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    replies = []
    for method, host, path, body in requests:
        sid = conn.get_next_available_stream_id()
        fields = [(":method", method), (":scheme", "https"), (":authority", host), (":path", path)]
        conn.send_headers(sid, fields, end_stream=not body)
        if body:
            half = len(body) // 2
            conn.send_data(sid, body[:half])
            conn.send_data(sid, body[half:], end_stream=True)
        tls.sendall(conn.data_to_send())
        status, headers, received, ended = 0, {}, b"", False
        while not ended:
            data = tls.recv(65536)
            assert data, "the proxy closed the h2 connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived) and event.stream_id == sid:
                    headers = {k.decode(): v.decode() for k, v in event.headers}
                    status = int(headers[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    received += event.data
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    ended = ended or event.stream_id == sid
            tls.sendall(conn.data_to_send())
        replies.append((status, headers, received))
    return replies


def test_requests_over_http2_are_signed_like_http1(sandbox: Sandbox, aws: FakeAws):
    """An h2 client inside the tunnel: a body sent as DATA frames without Content-Length is
    held, hashed, signed, and framed for the HTTP/1 upstream; the fake checks each signature."""
    from tests.e2e.raw import h2_tunnel, proxy_auth

    auth = proxy_auth("agent", sandbox.agent)
    with h2_tunnel(sandbox.proxy, auth, S3) as tls:
        assert tls.selected_alpn_protocol() == "h2"
        put, got, refused = _h2_exchange(
            tls,
            [
                ("PUT", S3, "/mybucket/data/h2.txt", b"over h2"),
                ("GET", S3, "/mybucket/data/h2.txt", b""),
                ("GET", S3, "/otherbucket/x", b""),
            ],
        )
    with h2_tunnel(sandbox.proxy, auth, BEDROCK) as tls:
        ((converse_status, _, _),) = _h2_exchange(
            tls, [("POST", BEDROCK, f"/model/{MODEL}/converse", b"{}")]
        )
    assert (put[0], got[0], converse_status) == (200, 200, 200)
    assert got[2] == b"over h2"
    assert (refused[0], refused[1]["x-credproxy-reason"]) == (403, "path-not-allowed")
    checked = _verified(aws.checked)
    assert [(c.received.method, c.scope) for c in checked] == [
        ("PUT", ("eu-west-1", "s3")),
        ("GET", ("eu-west-1", "s3")),
        ("POST", ("us-east-1", "bedrock")),
    ]
    # No Content-Length: of unknown length, so S3 gets UNSIGNED-PAYLOAD, streamed (README);
    # Bedrock's body was held and its hash signed (the fake checked the signature over it).
    assert checked[0].received.header("x-amz-content-sha256") == ["UNSIGNED-PAYLOAD"]
    assert checked[2].received.body == b"{}"


# -- grants narrow, before anything is signed ---------------------------------------------


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        pytest.param(
            lambda s3: s3.get_object(Bucket="mybucket", Key="private/x"),
            "path-not-allowed",
            id="an object outside the granted prefix is refused",
        ),
        pytest.param(
            lambda s3: s3.list_objects_v2(Bucket="mybucket", Prefix="data/"),
            "path-not-allowed",
            id="listing the bucket is not within the granted prefix",
        ),
        pytest.param(
            lambda s3: s3.delete_object(Bucket="mybucket", Key="data/x"),
            "method-not-allowed",
            id="a method not granted is refused",
        ),
    ],
)
def test_grants_narrow_before_signing(sandbox: Sandbox, aws: FakeAws, call: Any, reason: str):
    with pytest.raises(ClientError) as raised:
        call(sandbox.s3(principal="narrow"))
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert aws.checked == []
    line = sandbox.proxy.requests("narrow")[-1]
    assert (line["decision"], line["reason"]) == ("deny", reason)


# -- bodies ---------------------------------------------------------------------------------


def test_a_body_over_the_limit_to_another_service_is_refused_413(sandbox: Sandbox, aws: FakeAws):
    body = b'{"messages": "' + b"x" * LIMIT + b'"}'
    with sandbox.httpx() as client:
        declared = client.post(f"https://{BEDROCK}/model/m/converse", content=body)
        streamed = client.post(
            f"https://{BEDROCK}/model/m/converse", content=iter([body[:1000], body[1000:]])
        )
    for answer in (declared, streamed):
        assert answer.status_code == 413
        assert answer.headers["x-credproxy-reason"] == "body-too-large"
        assert "only S3 takes an unsigned payload" in answer.json()["detail"]
    assert aws.checked == []


def test_chunk_signed_bodies_are_refused_with_a_reason_that_says_so(sandbox: Sandbox, aws: FakeAws):
    chunk = b"5;chunk-signature=" + b"0" * 64 + b"\r\nhello\r\n0;chunk-signature=" + b"0" * 64
    with sandbox.httpx() as client:
        answer = client.put(
            f"https://{S3}/mybucket/data/chunked",
            content=chunk + b"\r\n\r\n",
            headers={
                "content-encoding": "aws-chunked",
                "x-amz-content-sha256": "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
                "x-amz-decoded-content-length": "5",
            },
        )
    assert answer.status_code == 400
    assert answer.headers["x-credproxy-reason"] == "signing-unsupported"
    assert "STREAMING-AWS4-HMAC-SHA256-PAYLOAD" in answer.json()["detail"]
    assert aws.checked == []


# -- the secret stays out -------------------------------------------------------------------


def test_echoed_keys_are_redacted_in_bodies_and_event_streams(sandbox: Sandbox, aws: FakeAws):
    aws.state.echo = f"{REAL.secret_access_key} {REAL.session_token} {REAL.access_key_id}".encode()
    aws.state.release.set()
    with sandbox.httpx() as client:
        body = client.get(f"https://{S3}/mybucket/echo").content
        with client.stream(
            "POST", f"https://{BEDROCK}/model/echo/converse-stream", content=b"{}"
        ) as streamed:
            events = b"".join(streamed.iter_bytes())
    for seen in (body, events):
        assert b"[REDACTED]" in seen
        for secret in (REAL.secret_access_key, REAL.session_token, REAL.access_key_id):
            assert secret.encode() not in seen
    _verified(aws.checked)


def test_no_key_in_the_audit_stream_or_cli_output(sandbox: Sandbox, aws: FakeAws):
    sandbox.s3().put_object(Bucket="mybucket", Key="data/audit", Body=b"a")
    time.sleep(0.1)
    text = sandbox.proxy.output() + "".join(sandbox.cli_output)
    for secret in (REAL.secret_access_key, REAL.session_token, REAL.access_key_id):
        assert secret not in text
    assert "…" + REAL.access_key_id[-4:] in sandbox.cli_output[1]
    lines = [line for line in sandbox.proxy.requests("agent") if line.get("credential") == "aws"]
    assert lines and all(line["credential_fp"] for line in lines)


# -- AssumeRole ---------------------------------------------------------------------------


def _sqs(client: httpx.Client) -> httpx.Response:
    headers = {"content-type": "application/x-amz-json-1.0", "x-amz-target": "AmazonSQS.ListQueues"}
    return client.post(f"https://{SQS}/", content=b"{}", headers=headers)


def _key_ids(checked: list[Checked]) -> set[str]:
    return {c.received.header("authorization")[0].split("Credential=")[1][:20] for c in checked}


def test_a_role_signs_with_temporary_keys_renewed_before_they_expire(
    sandbox: Sandbox, aws: FakeAws
):
    aws.state.lifetime = 9.0
    statuses = []
    with sandbox.httpx() as client:
        deadline = time.monotonic() + 13
        while time.monotonic() < deadline:
            statuses.append(_sqs(client).status_code)
            time.sleep(0.05)
    assert set(statuses) == {200}
    signed = _verified([c for c in aws.checked if c.host == SQS])
    keys = _key_ids(signed)
    assert len(keys) >= 2 and all(k.startswith("ASIA") for k in keys)
    assert aws.state.expired_uses == 0
    assert set(aws.state.assumed) == {ROLE_ARN}
    # Renewed in the background with a third of their life left, not on demand at expiry.
    issued = aws.state.issued
    assert len(issued) >= 2
    assert all(
        later < expires - 2.5 for (_, expires), (later, _) in zip(issued, issued[1:], strict=False)
    )
    assert {c.scope for c in aws.checked if c.host == STS} == {("us-east-1", "sts")}
    events = [line.get("event") for line in sandbox.proxy.audit()]
    assert "credentials.renewed" in events
    text = sandbox.proxy.output()
    for temporary, _ in aws.state.temporary.values():
        assert temporary.secret_access_key not in text and temporary.session_token not in text


def test_a_failed_renewal_denies_502_and_never_signs_with_expired_keys(
    sandbox: Sandbox, aws: FakeAws
):
    aws.state.lifetime = 3.0
    with sandbox.httpx() as client:
        assert _sqs(client).status_code == 200
        aws.state.sts_fails = True
        deadline = time.monotonic() + 15
        answer = _sqs(client)
        while answer.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            answer = _sqs(client)
        assert answer.status_code == 502
        assert answer.headers["x-credproxy-reason"] == "credentials-unavailable"
        # A failure of the allowed request (STS did not answer usably), not a denial.
        refused = [r for r in sandbox.proxy.requests("agent") if r.get("status") == 502][-1]
        assert (refused["decision"], refused["error"]) == ("error", "role-keys-unavailable")
        aws.state.sts_fails = False
        deadline = time.monotonic() + 15
        while _sqs(client).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _sqs(client).status_code == 200
    assert aws.state.expired_uses == 0
    failures = [e for e in sandbox.proxy.audit() if e.get("event") == "credentials.renewal_failed"]
    assert failures and failures[0]["credential"] == "role"


def test_the_aws_cli_through_the_proxy(sandbox: Sandbox, aws: FakeAws, tmp_path: Path):
    """The AWS CLI (v1, from PyPI) as an agent runs it: HTTPS_PROXY, the proxy's CA, dummy
    keys in the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {
        "HTTPS_PROXY": sandbox.proxy.url("agent", sandbox.agent),
        "AWS_CA_BUNDLE": str(sandbox.proxy.ca_file),
        "AWS_ACCESS_KEY_ID": DUMMY.access_key_id,
        "AWS_SECRET_ACCESS_KEY": DUMMY.secret_access_key,
        "AWS_DEFAULT_REGION": "eu-west-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_MAX_ATTEMPTS": "1",
    }
    cli = [str(Path(sys.executable).parent / "aws")]
    source, copy = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_bytes(b"from the aws cli")
    for args in (
        ["s3", "cp", str(source), "s3://mybucket/data/cli.txt"],
        ["s3api", "get-object", "--bucket", "mybucket", "--key", "data/cli.txt", str(copy)],
        ["sts", "get-caller-identity", "--endpoint-url", f"https://{STS}", "--region", "us-east-1"],
    ):
        done = subprocess.run(cli + args, env=env, capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert copy.read_bytes() == b"from the aws cli"
    checked = _verified(aws.checked)
    assert {c.host for c in checked} == {BUCKET_HOST, STS}
