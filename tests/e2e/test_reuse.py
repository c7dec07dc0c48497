"""One-shot clients share a verified upstream connection: per principal, name and address.

A real proxy, real TLS upstreams that count their connections and the SNI of each, and a
new client connection (httpx, raw sockets) per request, as an agent running `curl` per
tool call makes them.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import ssl
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from store.crypto import Secret
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.memory import MIB, rss
from tests.e2e.misbehaving import RawUpstream, ok
from tests.e2e.raw import connect, fetch, proxy_auth, read_reply
from tests.e2e.upstream import Received, Upstream, _Handler

pytestmark = pytest.mark.e2e

SECRET = "sk-reuse-" + os.urandom(8).hex()
NAMES = ["api.test", "other.test"]
CN_ONLY = "cn-only.test"
LINGER = "linger.test"


def _body(n: int) -> bytes:
    """A body of its own for each n: 1 MiB that no other n's shares a 32-byte run with."""
    return hashlib.shake_256(b"body-%d" % n).digest(1024 * 1024)


def _app(received: Received) -> tuple[int, list[tuple[str, str]], bytes] | None:
    if received.target.startswith("/v1/body/"):
        return 200, [], _body(int(received.target.rsplit("/", 1)[1]))
    if received.target.startswith("/v1/close"):
        return 200, [("Connection", "close")], b"closing"
    if received.target.startswith("/v1/refused"):
        return 401, [], b"no"
    if received.target.startswith("/v1/moved"):
        return 307, [("Location", "/v1/elsewhere")], b""
    if received.target.startswith("/v1/missing"):
        return 404, [], b"no such thing"
    if received.target.startswith("/v1/slow"):
        time.sleep(0.6)
        return 200, [], b"the slow answer"
    return None


class _Hasty(_Handler):
    timeout = 0.3  # closes a keep-alive connection idle this long


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _cn_only_context(ca: trustme.CA, tmp: Path) -> ssl.SSLContext:
    """A certificate from the trusted CA that names its host in the subject CN only, no SAN:
    mitmproxy never matches a CN, and neither may credproxy's own dial."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CN_ONLY)]))
        .issuer_name(ca._certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=10))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca._private_key, hashes.SHA256())
    )
    (tmp / "cn.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "cn.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp / "cn.pem", tmp / "cn.key")
    context.set_alpn_protocols(["http/1.1"])
    return context


@pytest.fixture(scope="module")
def servers(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, ...]]:
    with (
        Upstream(ca, NAMES, app=_app) as main,
        Upstream(ca, ["hasty.test"]) as hasty,
        Upstream(ca, [CN_ONLY]) as cn_only,
        # Answers `Connection: close`, then neither closes nor answers a close_notify for 5 s.
        RawUpstream(
            ca, [LINGER], {"/v1/x": lambda _: ok(b"bye", b"Connection: close")}, linger=5
        ) as lingering,
    ):
        hasty.server.RequestHandlerClass = _Hasty
        cn_only.server.context = _cn_only_context(ca, tmp_path_factory.mktemp("cn"))
        yield main, hasty, cn_only, lingering


def _start(home: Path, ca: trustme.CA, servers: tuple[Any, ...], *extra: str) -> Proxy:
    main, hasty, cn_only, lingering = servers
    home.mkdir(exist_ok=True)
    resolve = [f"{n}=127.0.0.1:{main.port}" for n in NAMES]
    resolve.append(f"hasty.test=127.0.0.1:{hasty.port}")
    resolve.append(f"{CN_ONLY}=127.0.0.1:{cn_only.port}")
    resolve.append(f"{LINGER}=127.0.0.1:{lingering.port}")
    return start_proxy(home, ca, resolve, extra=list(extra))


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, servers) -> Iterator[Proxy]:
    running = _start(tmp_path_factory.mktemp("reuse"), ca, servers)
    yield running
    stop_proxy(running)


@pytest.fixture
def upstream(servers: tuple[Any, ...]) -> Upstream:
    time.sleep(0.05)
    servers[0].log.clear()
    return servers[0]


_n = iter(range(10**6))


def _principal(proxy: Proxy, hosts: list[str] = NAMES) -> tuple[str, str]:
    n = next(_n)
    agent, cred = f"agent-{n}", f"cred-{n}"
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", hosts, Secret(SECRET.encode()))
    proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/"])
    proxy.wait_reload()
    return agent, token


def _one_shot(proxy: Proxy, who: tuple[str, str], url: str) -> httpx.Response:
    """One request on a new client connection, closed after it (curl per tool call)."""
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    with httpx.Client(proxy=proxy.url(*who), verify=context, timeout=10) as client:
        reply = client.get(url)
        reply.read()
        return reply


def _posts_twice(proxy: Proxy, path: str, status: int) -> tuple[str, str]:
    """A principal allowed to POST, and two one-shot POSTs with a body to `path`."""
    who = _principal(proxy)
    proxy.store.add_grant(who[0], ["POST"], credential=f"cred-{who[0].split('-')[1]}", paths=["/"])
    proxy.wait_reload()
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    for _ in range(2):
        with httpx.Client(proxy=proxy.url(*who), verify=context, timeout=10) as client:
            assert client.post(f"https://api.test{path}", content=b"x" * 100).status_code == status
        _settle()
    return who


def _settle() -> None:
    time.sleep(0.1)  # the proxy parks a connection once it has seen its client go


def test_one_shot_clients_of_a_principal_share_one_upstream_connection(
    proxy: Proxy, upstream: Upstream
) -> None:
    who = _principal(proxy)
    for i in range(5):
        reply = _one_shot(proxy, who, f"https://api.test/v1/{i}")
        assert reply.status_code == 200
        _settle()
    assert upstream.log.connections == 1
    assert upstream.log.snis == ["api.test"]
    # Each request was stamped on its own: the connection carries no credential.
    stamped = [r.header("authorization") == [f"Bearer {SECRET}"] for r in upstream.log.requests]
    assert stamped == [True] * 5
    assert SECRET not in proxy.output()


def test_never_across_principals(proxy: Proxy, upstream: Upstream) -> None:
    first, second = _principal(proxy), _principal(proxy)
    for who in (first, second, first, second, first):
        assert _one_shot(proxy, who, "https://api.test/v1/x").status_code == 200
        _settle()
    assert upstream.log.connections == 2


def test_never_across_names_at_one_address(proxy: Proxy, upstream: Upstream) -> None:
    """api.test and other.test are one address here: each name keeps its own connection,
    its certificate checked for that name."""
    who = _principal(proxy)
    for host in ("api.test", "other.test", "api.test", "other.test"):
        assert _one_shot(proxy, who, f"https://{host}/v1/x").status_code == 200
        _settle()
    assert upstream.log.connections == 2
    assert upstream.log.snis == ["api.test", "other.test"]
    assert [r.header("host") for r in upstream.log.requests] == [
        ["api.test"],
        ["other.test"],
        ["api.test"],
        ["other.test"],
    ]


def test_a_connection_the_upstream_closes_is_not_kept(proxy: Proxy, upstream: Upstream) -> None:
    who = _principal(proxy)
    for _ in range(3):
        assert _one_shot(proxy, who, "https://api.test/v1/close").status_code == 200
        _settle()
    assert upstream.log.connections == 3


def test_a_connection_cut_mid_response_is_not_kept(proxy: Proxy, upstream: Upstream) -> None:
    """The agent went before the stream ended: the rest of it must not reach the next one."""
    who = _principal(proxy)
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    with httpx.Client(proxy=proxy.url(*who), verify=context, timeout=10) as client:
        with client.stream("GET", "https://api.test/sse") as reply:
            first = next(reply.iter_raw())
            assert b"event-0" in first
    _settle()
    reply = _one_shot(proxy, who, "https://api.test/v1/after")
    assert reply.status_code == 200
    assert reply.json() == {"ok": True, "path": "/v1/after"}
    assert upstream.log.connections == 2


def test_a_connection_left_before_its_answer_is_not_kept(proxy: Proxy, upstream: Upstream) -> None:
    """The agent gave up before the answer came: that answer must not be the next one's."""
    who = _principal(proxy)
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    with httpx.Client(proxy=proxy.url(*who), verify=context, timeout=0.2) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.get("https://api.test/v1/slow")
    _settle()
    reply = _one_shot(proxy, who, "https://api.test/v1/fast")
    assert reply.json() == {"ok": True, "path": "/v1/fast"}
    time.sleep(0.6)
    assert upstream.log.connections == 2


def test_a_body_refused_by_the_upstream_is_not_kept(proxy: Proxy, upstream: Upstream) -> None:
    """An error answer to a request with a body: the upstream may have left the body unread
    and would read it as the next request, another client's. Bodiless errors are kept."""
    who = _posts_twice(proxy, "/v1/refused", 401)
    assert upstream.log.connections == 2
    upstream.log.clear()
    for _ in range(2):
        assert _one_shot(proxy, who, "https://api.test/v1/missing").status_code == 404
        _settle()
    assert upstream.log.connections <= 1  # the second reuses the first (or one parked before)


def test_a_name_in_the_subject_cn_only_is_refused(proxy: Proxy, servers: tuple[Any, ...]) -> None:
    who = _principal(proxy, [CN_ONLY])
    reply = _one_shot(proxy, who, f"https://{CN_ONLY}/v1/x")
    assert reply.status_code == 502
    assert reply.json()["reason"] == "upstream-tls-error"
    assert servers[2].log.requests == []


def test_odd_alpn_offers_get_an_answer(proxy: Proxy, upstream: Upstream) -> None:
    """ALPN names are opaque bytes: offers credproxy does not pass on are dropped, and the
    request is answered (a name that is not ASCII once left it hanging)."""
    who = _principal(proxy)
    sock, reply = connect(proxy.port, "api.test:443", proxy_auth(*who))
    assert reply.status == 200
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    offers = [b"http/1.1", b"\xff\xfe", b"x-other"]
    context._set_alpn_protocols(bytearray(b"".join(bytes([len(o)]) + o for o in offers)))  # type: ignore[attr-defined]
    with context.wrap_socket(sock, server_hostname="api.test") as tls:
        tls.settimeout(10)
        tls.sendall(b"GET /v1/alpn HTTP/1.1\r\nHost: api.test\r\n\r\n")
        assert read_reply(tls).status == 200


def test_a_connection_closed_while_parked_is_not_used(
    proxy: Proxy, servers: tuple[Any, ...]
) -> None:
    """The upstream closed the parked connection (its keep-alive timeout): the next client
    gets a new one and its answer, not an error."""
    hasty = servers[1]
    hasty.log.clear()
    who = _principal(proxy, ["hasty.test"])
    assert _one_shot(proxy, who, "https://hasty.test/v1/a").status_code == 200
    time.sleep(0.8)  # the upstream has closed it
    assert _one_shot(proxy, who, "https://hasty.test/v1/b").status_code == 200
    assert hasty.log.connections == 2
    decisions = [line.get("decision") for line in proxy.requests(who[0])]
    assert decisions == ["allow", "allow"]


def test_http2_clients_keep_mitmproxys_connections(proxy: Proxy, upstream: Upstream) -> None:
    who = _principal(proxy)
    for _ in range(2):
        answer = fetch(proxy, who, "api.test", "/v1/x", http2=True)
        assert answer.status == 200
        _settle()
    assert upstream.log.connections == 2


def test_idle_limit(tmp_path: Path, ca: trustme.CA, servers, upstream: Upstream) -> None:
    """Parked for --upstream-idle seconds, then closed; 0 parks nothing."""
    quick = _start(tmp_path / "quick", ca, servers, "--upstream-idle", "0.3")
    try:
        who = _principal(quick)
        assert _one_shot(quick, who, "https://api.test/v1/a").status_code == 200
        _settle()
        assert _one_shot(quick, who, "https://api.test/v1/b").status_code == 200  # reused
        time.sleep(0.8)
        assert _one_shot(quick, who, "https://api.test/v1/c").status_code == 200
        assert upstream.log.connections == 2
    finally:
        stop_proxy(quick)
    upstream.log.clear()
    never = _start(tmp_path / "never", ca, servers, "--upstream-idle", "0")
    try:
        who = _principal(never)
        for _ in range(3):
            assert _one_shot(never, who, "https://api.test/v1/x").status_code == 200
            _settle()
        assert upstream.log.connections == 3
    finally:
        stop_proxy(never)


def test_memory_stays_flat_over_many_one_shot_clients(proxy: Proxy, upstream: Upstream) -> None:
    """Each client connection's state goes with it, though its upstream connection stays: a
    connection's layer once kept it (and its client, its flows) alive, 85 KiB per request."""
    agents = [_principal(proxy) for _ in range(3)]
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    context.set_alpn_protocols(["http/1.1"])

    def one(n: int) -> int:
        sock, reply = connect(proxy.port, "api.test:443", proxy_auth(*agents[n % 3]))
        assert reply.status == 200
        with context.wrap_socket(sock, server_hostname="api.test") as tls:
            tls.settimeout(10)
            tls.sendall(b"GET /v1/m HTTP/1.1\r\nHost: api.test\r\n\r\n")
            return read_reply(tls).status

    with ThreadPoolExecutor(10) as pool:
        assert set(pool.map(one, range(300))) == {200}  # warm up
        before = rss(proxy.process.pid)
        assert set(pool.map(one, range(1200))) == {200}
        grown = rss(proxy.process.pid) - before
    assert upstream.log.connections <= 30  # reused: 3 principals, 10 at a time
    assert grown < 16 * MIB, f"grew {grown / MIB:.1f} MiB over 1,200 one-shot clients"


def test_a_redirect_after_a_body_is_not_kept(proxy: Proxy, upstream: Upstream) -> None:
    """Redirects are answered without reading the body as often as errors are."""
    _posts_twice(proxy, "/v1/moved", 307)
    assert upstream.log.connections == 2


def test_closed_connections_are_let_go_at_once(proxy: Proxy) -> None:
    """Closed with the answer (`Connection: close`), to an upstream that does not answer the
    close: the socket goes at once, not after asyncio's 30 s wait for a close_notify."""
    who = _principal(proxy, [LINGER])
    fds = Path(f"/proc/{proxy.process.pid}/fd")
    before = len(list(fds.iterdir()))
    for _ in range(20):
        assert _one_shot(proxy, who, f"https://{LINGER}/v1/x").status_code == 200
    time.sleep(0.5)
    assert len(list(fds.iterdir())) - before < 5


def test_a_held_connection_costs_less_than_a_quarter_mebibyte(proxy: Proxy) -> None:
    """120 tunnels held open after one request each, each with its upstream connection: the
    proxy grows by less than 320 KiB a connection (about 146 measured, mitmproxy 154;
    asyncio's TLS transport once allocated a 256 KiB read buffer for each upstream, 405)."""
    agents = [_principal(proxy) for _ in range(3)]
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    context.set_alpn_protocols(["http/1.1"])

    def one(n: int) -> ssl.SSLSocket:
        sock, reply = connect(proxy.port, "api.test:443", proxy_auth(*agents[n % 3]))
        assert reply.status == 200
        tls = context.wrap_socket(sock, server_hostname="api.test")
        tls.settimeout(10)
        tls.sendall(b"GET /v1/held HTTP/1.1\r\nHost: api.test\r\n\r\n")
        assert read_reply(tls).status == 200
        return tls

    held: list[ssl.SSLSocket] = []
    try:
        with ThreadPoolExecutor(10) as pool:
            held += pool.map(one, range(10))  # warm: what one connection costs once
            time.sleep(0.3)
            before = rss(proxy.process.pid)
            held += pool.map(one, range(120))
        time.sleep(0.3)
        grown = rss(proxy.process.pid) - before
    finally:
        for tls in held:
            tls.close()
    assert grown / 120 < 320 * 1024, f"{grown / 120 / 1024:.0f} KiB a held connection"


def test_downloads_at_once_each_get_their_own_bytes(proxy: Proxy) -> None:
    """Every upstream connection credproxy dials reads through one buffer per thread
    (addon/mitm/reuse.py): 12 downloads of 1 MiB at once, each of its own bytes, arrive whole
    and unmixed."""
    agents = [_principal(proxy) for _ in range(3)]

    def one(n: int) -> bool:
        with proxy.client(*agents[n % 3]) as client:
            got = client.get(f"https://api.test/v1/body/{n}")
        return got.status_code == 200 and got.content == _body(n)

    with ThreadPoolExecutor(12) as pool:
        assert all(pool.map(one, range(24)))
