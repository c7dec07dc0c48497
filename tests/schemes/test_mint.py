"""The token manager without a network: margins, single flight, backoff, the 401 cooldown,
rotation; and what the minters accept from a token endpoint. The calls to real endpoints are
tested end to end (tests/e2e/test_minted.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import pytest

from addon.schemes import https
from addon.schemes.https import Answer, MintFailed, Post
from addon.schemes.mint import Tokens, TokenSession
from addon.schemes.minters import OAuth2Client, bearer, failed
from addon.schemes.renewal import Unavailable
from addon.schemes.tokens import Token
from addon.schemes.tokens import token as make_token
from store.crypto import Secret
from store.records import CredentialRecord
from store.rules.grammar import parse_host
from store.rules.mintspec import token_version

LONG = "a-long-token"


class FakeMinter:
    host, port = "auth.example", 443

    def __init__(self, lifetime: float = 60.0) -> None:
        self.lifetime = lifetime
        self.calls = 0
        self.fail: MintFailed | None = None

    def secrets(self) -> tuple[bytes, ...]:
        return (b"long-lived",)

    def refused(self, token: Token) -> None:
        pass

    def mint(self, post: Post) -> Token:
        self.calls += 1
        time.sleep(0.05)  # in a thread: concurrent callers arrive meanwhile
        if self.fail is not None:
            raise self.fail
        return make_token(f"t{self.calls}", self.lifetime)


async def reachable(host: str, port: int) -> tuple[str, int]:
    return ("127.0.0.1", 1)


def session(minter: FakeMinter) -> TokenSession:
    tokens = Tokens()
    tokens.dial = reachable
    return TokenSession("cred", minter, tokens)


@pytest.mark.parametrize(
    ("lifetime", "usable", "refresh"),
    [
        pytest.param(3.0, 2.7, 2.25, id="a 3 s token: refreshed at 75 %, unusable at 90 %"),
        pytest.param(3600.0, 3540.0, 2700.0, id="an hour's token: a margin of at most 60 s"),
        pytest.param(None, 3540.0, 2700.0, id="no expires_in: an hour is assumed"),
    ],
)
def test_the_margin_scales_with_the_lifetime(
    lifetime: float | None, usable: float, refresh: float
) -> None:
    before = time.monotonic()
    found = make_token("abc", lifetime)
    assert found.usable_until - before == pytest.approx(usable, abs=0.5)
    assert found.refresh_at - before == pytest.approx(refresh, abs=0.5)


async def test_a_token_within_its_margin_is_never_stamped() -> None:
    s = session(FakeMinter())
    s.current = make_token("old", 3.0)._replace(usable_until=time.monotonic() - 0.01)
    assert s.now() is None
    found = await s.ensure()
    assert found.value == b"t1"
    s.close()


async def test_concurrent_first_uses_share_one_mint() -> None:
    minter = FakeMinter()
    s = session(minter)
    found = await asyncio.gather(*(s.ensure() for _ in range(100)))
    assert minter.calls == 1 and len({t.fingerprint for t in found}) == 1
    s.close()


async def test_a_failure_backs_off_and_names_the_status_and_code() -> None:
    minter = FakeMinter()
    minter.fail = MintFailed("the token endpoint answered 400 (invalid_grant)", 400, "x")
    s = session(minter)
    with pytest.raises(Unavailable, match=r"answered 400 \(invalid_grant\)"):
        await s.ensure()
    with pytest.raises(Unavailable):
        await s.ensure()  # within the backoff: the endpoint is not asked again
    assert minter.calls == 1
    minter.fail = None
    s._retry_at = 0.0  # the backoff has passed
    assert (await s.ensure()).value == b"t2"
    s.close()


async def test_an_upstream_401_drops_the_token_once_per_cooldown() -> None:
    minter = FakeMinter()
    s = session(minter)
    first = await s.ensure()
    s.drop(first)
    second = await s.ensure()
    assert second != first
    s.drop(second)  # within the cooldown: kept
    assert await s.ensure() is second and minter.calls == 2
    s.drop(first)  # an older token than the current one drops nothing
    assert s.current is second
    s.close()


def _client_record(
    fingerprint: str, secret: str = "cs", url: str = "https://auth.example/token"
) -> CredentialRecord:
    value = json.dumps({"client_id": "id", "client_secret": secret})
    return CredentialRecord(
        "cc", "oauth2-client", None, None, (parse_host("api.example"),),
        Secret(value.encode()), fingerprint, {"token_url": url},
    )  # fmt: skip


def _live(fingerprint: str, secret: str = "cs", **more: str) -> dict[str, str]:
    """What a reload hands Tokens.retain for the credential `cc` as given."""
    return {"cc": token_version(_client_record(fingerprint, secret, **more))}


def test_rotation_and_removal_drop_the_session_and_its_token() -> None:
    tokens = Tokens()
    first = tokens.get(_client_record("fp-1"))
    first.current = make_token("cached", 60)
    assert tokens.get(_client_record("fp-1")) is first
    rotated = tokens.get(_client_record("fp-2", "cs2"))
    assert rotated is not first and first.current is None
    rotated.current = make_token("cached2", 60)
    tokens.retain(_live("fp-2", "cs2"))
    assert rotated.current is not None
    tokens.retain(_live("fp-3", "cs3"))  # rotated again, reloaded, and no request since
    assert rotated.current is None
    again = tokens.get(_client_record("fp-3", "cs3"))
    again.current = make_token("cached3", 60)
    tokens.retain({})  # removed
    assert again.current is None


def test_a_settings_change_drops_the_session_at_the_reload() -> None:
    """apply moved the token URL (or the scope), the secret untouched: the session minted
    with the old settings is dropped at the reload, not at the next request (meanwhile it
    refreshed in the background, sending the client secret to the old URL)."""
    tokens = Tokens()
    tokens.retain(_live("fp-1"))
    first = tokens.get(_client_record("fp-1"))
    first.current = make_token("cached-old-url", 60)
    tokens.retain(_live("fp-1", url="https://new-auth.example/token"))
    assert first.current is None and first.closed


async def test_a_closed_session_never_mints_again() -> None:
    """A request that picked a session up before its credential was rotated or removed, and
    asks for a token after: refused, and the removed secret is not used (it used to mint,
    and then refresh in the background for up to IDLE, from a session no one could drop)."""
    minter = FakeMinter()
    s = session(minter)
    await s.ensure()
    s.close()  # rotated or removed: the reload closed it
    with pytest.raises(Unavailable, match="credential changed"):
        await s.ensure()
    assert minter.calls == 1 and s.current is None and s.now() is None


async def test_a_stale_credential_record_never_replaces_the_live_session() -> None:
    """A request still holding a rotated (or removed) credential's old record, after the
    reload: it gets no token, and the live credential's session stays as it is."""
    tokens = Tokens()
    tokens.dial = reachable
    tokens.retain(_live("fp-2", "cs2"))
    live = tokens.get(_client_record("fp-2", "cs2"))
    live.current = make_token("cached2", 60)
    stale = tokens.get(_client_record("fp-1"))  # the record from before the rotation
    assert stale is not live and live.current is not None
    assert tokens.get(_client_record("fp-2", "cs2")) is live
    with pytest.raises(Unavailable, match="credential changed"):
        await stale.ensure()
    tokens.retain({})  # removed
    gone = tokens.get(_client_record("fp-2", "cs2"))
    with pytest.raises(Unavailable, match="credential changed"):
        await gone.ensure()
    assert tokens.get(_client_record("fp-2", "cs2")) is not live and live.current is None


def test_minters_never_show_their_secret() -> None:
    minter = OAuth2Client(_client_record("fp-1", "very-secret-value"))
    assert "very-secret-value" not in repr(minter) + repr(make_token("tok-value", 60))
    assert minter.secrets() == (b"very-secret-value",)


def _answer(status: int, body: Any) -> Answer:
    return Answer(status, {}, body if isinstance(body, bytes) else json.dumps(body).encode())


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        pytest.param(
            _answer(400, {"error": "invalid_grant", "error_description": "SECRET-ECHO"}),
            "the token endpoint answered 400 (invalid_grant)",
            id="status and error code, never the description",
        ),
        pytest.param(
            _answer(401, {"error": "SECRET ECHO\r\nX: y"}),
            "the token endpoint answered 401",
            id="an error code that is not a token is left out",
        ),
        pytest.param(
            _answer(400, {"error": "cs-SECRET-ECHO"}),
            "the token endpoint answered 400",
            id="a code that is not a registered OAuth error is left out",
        ),
        pytest.param(
            _answer(500, b"<html>SECRET-ECHO</html>"),
            "the token endpoint answered 500",
            id="a body that is not JSON is not quoted",
        ),
    ],
)
def test_a_refusal_names_the_status_and_code_only(answer: Answer, detail: str) -> None:
    assert failed(answer).detail == detail


@pytest.mark.parametrize(
    "data",
    [
        pytest.param({"token_type": "bearer"}, id="no access_token"),
        pytest.param({"access_token": "a\r\nX-Evil: 1"}, id="a token that would split headers"),
        pytest.param({"access_token": "a b"}, id="a token with a space"),
        pytest.param({"access_token": LONG, "token_type": "mac"}, id="not a bearer token"),
        pytest.param({"access_token": LONG, "expires_in": -5}, id="a negative lifetime"),
        pytest.param({"access_token": LONG, "expires_in": True}, id="a lifetime that is a bool"),
    ],
)
def test_answers_that_give_no_usable_token_are_refused(data: dict[str, Any]) -> None:
    with pytest.raises(MintFailed):
        bearer(data)


def test_a_string_lifetime_is_read() -> None:
    assert bearer({"access_token": LONG, "expires_in": "120"}).lifetime == 120


@pytest.mark.parametrize("value", ["a", "abc", "abcdefg"])
def test_a_token_too_short_to_redact_is_refused(value: str) -> None:
    """Redaction finds a secret of four bytes or more: a token shorter than that, echoed by
    the API, reached the agent as it was. Tokens of fewer than 8 characters are refused."""
    from addon.redaction.redact import Redactor

    assert Redactor([b"abc"]).whole(b"echo: abc") == b"echo: abc"  # why
    with pytest.raises(MintFailed, match="no usable access_token"):
        bearer({"access_token": value, "token_type": "Bearer"})


async def test_a_silent_endpoint_times_out_and_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An endpoint that accepts the connection and says nothing: the mint gives up after
    TIMEOUT, and the request is refused with a detail that says so."""
    import socket

    monkeypatch.setattr(https, "TIMEOUT", 0.3)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]

        async def dial(host: str, _: int) -> tuple[str, int]:
            return ("127.0.0.1", port)

        tokens = Tokens()
        tokens.dial = dial
        s = tokens.get(_client_record("fp-1"))
        with pytest.raises(Unavailable, match="did not answer in time"):
            await s.ensure()
        s.close()


def test_mints_and_failures_are_counted_by_credential() -> None:
    from addon.observe.metrics import Metrics

    metrics = Metrics(snapshot_age=lambda: 0.0, store_up=lambda: True)
    metrics.token_mints.labels("cc", "minted").inc()
    metrics.token_mints.labels("cc", "failed").inc()
    text = metrics.render().decode()
    assert 'credproxy_token_mints_total{credential="cc",outcome="minted"} 1.0' in text
    assert 'credproxy_token_mints_total{credential="cc",outcome="failed"} 1.0' in text


async def test_a_session_closed_during_its_first_mint_refuses_the_waiting_requests() -> None:
    minter = FakeMinter()
    s = session(minter)
    waiting = asyncio.ensure_future(s.ensure())
    await asyncio.sleep(0.01)  # the mint is under way
    s.close()  # rotated or removed
    with pytest.raises(Unavailable, match="changed while its token was minted"):
        await waiting


@pytest.mark.parametrize(
    "lifetime",
    ["NaN", "Infinity", "-Infinity", "1e999", "-1", '"' + "9" * 5000 + '"', '"\u00b2"'],
)
def test_a_lifetime_that_is_not_a_finite_number_is_refused(lifetime: str) -> None:
    """Python's json reads NaN and Infinity: a NaN lifetime made a token that never expired
    and a refresh timer that fired at once, forever (the endpoint hammered)."""
    data = json.loads('{"access_token": "a-long-token", "expires_in": ' + lifetime + "}")
    with pytest.raises(MintFailed, match="no usable expires_in"):
        bearer(data)


@pytest.mark.parametrize("lifetime", ["9" * 400, "1e300", '"999999999999"'])
def test_a_lifetime_past_a_day_is_read_as_a_day(lifetime: str) -> None:
    data = json.loads('{"access_token": "a-long-token", "expires_in": ' + lifetime + "}")
    assert bearer(data).lifetime == 86400.0


async def test_a_nan_lifetime_does_not_make_a_mint_loop() -> None:
    class NanMinter(FakeMinter):
        def mint(self, post: Post) -> Token:
            self.calls += 1
            return bearer(json.loads('{"access_token": "a-long-token", "expires_in": NaN}'))

    minter = NanMinter()
    s = session(minter)
    with pytest.raises(Unavailable, match="no usable expires_in"):
        await s.ensure()
    await asyncio.sleep(0.3)  # a backoff of 0.5 s: no second call yet
    s.close()
    assert minter.calls == 1


class _Dripper:
    """A TLS token endpoint on 127.0.0.1 that sends a valid answer one byte at a time, each
    byte well within the per-read timeout, the whole far beyond TIMEOUT."""

    def __init__(self, pause: float) -> None:
        import trustme

        from tests.e2e.servers import TlsServer, server_context

        self.ca = trustme.CA()
        body = json.dumps({"access_token": "dripped", "expires_in": 60}).encode()
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        self.sent = 0
        outer = self

        class Server(TlsServer):
            def serve(self, tls: Any) -> None:
                tls.recv(65536)
                for i in range(len(answer)):
                    tls.sendall(answer[i : i + 1])
                    outer.sent += 1
                    time.sleep(pause)

        self.server = Server(server_context(self.ca, ["auth.example"]), timeout=30)
        self.total = len(answer)


async def test_an_endpoint_that_drips_its_answer_is_cut_off_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """TIMEOUT bounds the whole call, not each read: an endpoint that keeps every read just
    within it cannot hold the mint (and every request waiting on it) for longer."""
    monkeypatch.setattr(https, "TIMEOUT", 0.5)
    drip = _Dripper(pause=0.04)  # about 4 s for the whole answer
    cafile = tmp_path / "ca.pem"
    drip.ca.cert_pem.write_to_path(str(cafile))

    async def dial(host: str, _: int) -> tuple[str, int]:
        return ("127.0.0.1", drip.server.port)

    tokens = Tokens()
    tokens.dial = dial
    tokens.cafile = str(cafile)
    s = tokens.get(_client_record("fp-1"))
    try:
        with pytest.raises(Unavailable, match="did not answer in time"):
            await s.ensure()
        assert drip.sent < drip.total
    finally:
        s.close()
        drip.server.close()


async def test_an_endpoint_that_drips_its_tls_handshake_is_cut_off_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deadline covers the handshake too: a TLS record header announcing 16 KiB, then a
    byte at a time."""
    from tests.e2e.servers import Server

    monkeypatch.setattr(https, "TIMEOUT", 0.5)

    class Dripper(Server):
        def handle(self, sock: Any) -> None:
            with contextlib.suppress(OSError):
                sock.sendall(b"\x16\x03\x03\x40\x00")
                for _ in range(16384):
                    sock.sendall(b"\x00")
                    time.sleep(0.04)

    server = Dripper()

    async def dial(host: str, _: int) -> tuple[str, int]:
        return ("127.0.0.1", server.port)

    tokens = Tokens()
    tokens.dial = dial
    s = tokens.get(_client_record("fp-1"))
    try:
        with pytest.raises(Unavailable, match="did not answer in time"):
            await asyncio.wait_for(s.ensure(), 20)
    finally:
        s.close()
        server.close()


def test_an_answer_compressed_unasked_is_never_inflated(tmp_path: Any) -> None:
    """credproxy asks for identity; an endpoint that compresses anyway is refused, its body
    never inflated (urllib3 before 2.6, which botocore allows, inflated a whole read at once:
    64 KiB of gzip is 64 MiB, of brotli far more)."""
    import gzip

    import trustme

    from tests.e2e.servers import TlsServer, server_context

    ca = trustme.CA()
    cafile = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(cafile))
    body = gzip.compress(json.dumps({"access_token": "inflated", "expires_in": 60}).encode())
    asked: list[bytes] = []

    class Server(TlsServer):
        def serve(self, tls: Any) -> None:
            asked.append(tls.recv(65536))
            head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
            tls.sendall(head % len(body) + body)

    server = Server(server_context(ca, ["auth.example"]))
    try:
        with pytest.raises(MintFailed, match="compressed"):
            https.https_call(
                ("127.0.0.1", server.port), "auth.example", 443, str(cafile), "POST", "/t",
                b"", {},
            )  # fmt: skip
    finally:
        server.close()
    assert b"\r\naccept-encoding: identity\r\n" in asked[0].lower()


def test_an_ipv6_token_endpoint_gets_a_well_formed_host_header(tmp_path: Any) -> None:
    """https://[2001:db8::1]:8443/t: the Host header brackets the address (RFC 9110 .7.2);
    it used to read `2001:db8::1:8443`, which a server cannot parse."""
    import trustme

    from tests.e2e.servers import TlsServer, server_context

    ca = trustme.CA()
    cafile = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(cafile))
    asked: list[bytes] = []
    body = json.dumps({"access_token": "a-long-token", "expires_in": 60}).encode()

    class Server(TlsServer):
        def serve(self, tls: Any) -> None:
            asked.append(tls.recv(65536))
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    server = Server(server_context(ca, ["2001:db8::1"]))
    try:
        answer = https.https_call(
            ("127.0.0.1", server.port), "2001:db8::1", 8443, str(cafile), "POST", "/t", b"", {}
        )
    finally:
        server.close()
    assert answer.status == 200
    assert b"\r\nhost: [2001:db8::1]:8443\r\n" in asked[0].lower()
