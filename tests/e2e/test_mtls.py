"""Client certificates (scheme mtls): the proxy presents a grant's certificate to the upstream.

A real proxy; real TLS upstreams on 127.0.0.1 that ask for a client certificate and record,
per request, which one (if any) came on its connection; httpx and curl as agents.
"""

from __future__ import annotations

import datetime
import os
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trustme

from store.crypto import Secret
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.servers import TlsServer, server_context
from tests.e2e.upstream import Upstream, _Handler

pytestmark = pytest.mark.e2e

OPEN, STRICT = "api.test", "strict.test"  # a client certificate asked for; required
H2 = "h2.test"  # asked for, over HTTP/2


@dataclass(frozen=True)
class Seen:
    path: str
    cert: str | None  # the client certificate's common name
    connection: int


class _Recording(_Handler):
    def _handle(self) -> None:
        peer = self.connection.getpeercert()  # type: ignore[attr-defined]
        names = [v for rdn in (peer or {}).get("subject", ()) for k, v in rdn if k == "commonName"]
        seen: list[Seen] = self.server.seen  # type: ignore[attr-defined]
        port = self.client_address[1]  # the proxy's end: one per upstream connection
        seen.append(Seen(self.path, names[0] if names else None, port))
        super()._handle()

    do_GET = _handle


class _H2Recording(TlsServer):
    """HTTP/2, a client certificate asked for: each request's path and certificate (by the
    connection it came on); 200 to all."""

    def __init__(self, ca: trustme.CA, clients: trustme.CA) -> None:
        context = server_context(ca, [H2], "h2")
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(cadata=clients.cert_pem.bytes().decode())
        self.seen: list[Seen] = []
        super().__init__(context)

    def serve(self, tls: ssl.SSLSocket) -> None:
        import h2.config
        import h2.connection
        import h2.events

        peer = tls.getpeercert() or {}
        names = [v for rdn in peer.get("subject", ()) for k, v in rdn if k == "commonName"]
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        tls.sendall(conn.data_to_send())
        while data := tls.recv(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    path = dict(event.headers)[b":path"].decode()
                    port = tls.getpeername()[1]
                    self.seen.append(Seen(path, names[0] if names else None, port))
                    conn.send_headers(event.stream_id, [(":status", "200")], end_stream=True)
            tls.sendall(conn.data_to_send())


def _asks(upstream: Upstream, clients: trustme.CA, mode: ssl.VerifyMode) -> None:
    upstream.server.RequestHandlerClass = _Recording
    upstream.server.seen = []  # type: ignore[attr-defined]
    context = upstream.server.context
    context.verify_mode = mode
    context.load_verify_locations(cadata=clients.cert_pem.bytes().decode())


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def clients() -> trustme.CA:
    """The CA the upstreams trust for client certificates."""
    return trustme.CA()


def _pem(ca: trustme.CA, name: str, **kwargs: Any) -> Secret:
    issued = ca.issue_cert(f"{name}.clients.test", common_name=name, **kwargs)
    return Secret(issued.private_key_and_cert_chain_pem.bytes())


@dataclass
class World:
    proxy: Proxy
    open: Upstream
    strict: Upstream
    alice: tuple[str, str]
    bob: tuple[str, str]
    key_pems: list[bytes]
    clients: trustme.CA
    h2: _H2Recording

    def seen(self, upstream: Upstream) -> list[Seen]:
        return list(upstream.server.seen)  # type: ignore[attr-defined]

    def clear(self) -> None:
        time.sleep(0.1)
        for upstream in (self.open, self.strict):
            upstream.server.seen.clear()  # type: ignore[attr-defined]
            upstream.log.clear()
        self.h2.seen.clear()


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, clients: trustme.CA
) -> Iterator[World]:
    with (
        Upstream(ca, [OPEN]) as open_,
        Upstream(ca, [STRICT]) as strict,
        _H2Recording(ca, clients) as h2,
    ):
        _asks(open_, clients, ssl.CERT_OPTIONAL)
        _asks(strict, clients, ssl.CERT_REQUIRED)
        home = tmp_path_factory.mktemp("mtls")
        resolve = [f"{OPEN}=127.0.0.1:{open_.port}", f"{STRICT}=127.0.0.1:{strict.port}"]
        resolve.append(f"{H2}=127.0.0.1:{h2.port}")
        proxy = start_proxy(home, ca, resolve)
        try:
            store = proxy.store
            hosts = [OPEN, STRICT, H2]
            secrets = {
                "cert-a": _pem(clients, "alice-a"),
                "cert-b": _pem(clients, "alice-b"),
                "rogue": _pem(trustme.CA(), "rogue"),  # from a CA the upstreams do not trust
                # issued by an intermediate CA: the upstream trusts only the root
                "chained": _pem(clients.create_child_ca(), "alice-chained"),
            }
            for name, secret in secrets.items():
                store.add_credential(name, "mtls", hosts, secret)
            store.add_credential("token", "bearer", hosts, Secret(b"sk-mtls-bearer"))
            alice, bob = store.add_principal("alice"), store.add_principal("bob")
            store.add_grant("alice", ["GET"], credential="cert-a", hosts=hosts, paths=["/a/"])
            store.add_grant("alice", ["GET"], credential="cert-b", hosts=hosts, paths=["/b/"])
            store.add_grant("alice", ["GET"], credential="token", hosts=hosts, paths=["/none/"])
            store.add_grant("alice", ["GET"], credential="rogue", hosts=hosts, paths=["/rogue/"])
            store.add_grant("alice", ["GET"], credential="chained", hosts=hosts, paths=["/c/"])
            store.add_grant("bob", ["GET"], credential="token", hosts=hosts, paths=["/"])
            proxy.wait_reload()
            keys = [_key_pem(s) for s in secrets.values()]
            yield World(proxy, open_, strict, ("alice", alice), ("bob", bob), keys, clients, h2)
        finally:
            stop_proxy(proxy)


def _key_pem(secret: Secret) -> bytes:
    text = secret.reveal()
    start = text.index(b"-----BEGIN")
    return text[start : text.index(b"-----END", start)]


def _client(world: World, who: tuple[str, str]) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(world.proxy.ca_file))
    return httpx.Client(proxy=world.proxy.url(*who), verify=context, timeout=10)


def _curl_many(
    world: World, who: tuple[str, str], urls: list[str], parallel: bool = False
) -> list[str]:
    """One curl, one client connection, HTTP/2 in the tunnel (httpx offers http/1.1 first
    there, and mitmproxy takes the client's first); each URL's "version status"."""
    outputs = [arg for _ in urls for arg in ("-o", "/dev/null")]
    done = subprocess.run(
        ["curl", "-sS", "--http2", "--max-time", "20", "--proxy", world.proxy.url(*who)]
        + ["--cacert", str(world.proxy.ca_file), "-w", "%{http_version} %{http_code}\\n"]
        + (["-Z", "--parallel-max", "6"] if parallel else [])
        + outputs
        + urls,
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == 0, done
    return done.stdout.decode().splitlines()


def _curl(world: World, who: tuple[str, str], url: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["curl", "-sS", "--max-time", "10", "--proxy", world.proxy.url(*who)]
        + ["--cacert", str(world.proxy.ca_file), "-w", "\\n%{http_code}", url],
        capture_output=True,
        timeout=20,
    )


@pytest.mark.parametrize("http2", [False, True], ids=["HTTP/1.1 client", "HTTP/2 client"])
def test_one_client_connection_never_shares_a_connection_across_certificates(
    world: World, http2: bool
) -> None:
    world.clear()
    order = ["/a/1", "/none/1", "/b/1", "/a/2", "/none/2", "/b/2", "/a/3"]
    if http2:
        answers = _curl_many(world, world.alice, [f"https://{OPEN}{p}" for p in order])
        assert answers == ["2 200"] * len(order)
    else:
        with _client(world, world.alice) as client:
            for path in order:
                assert client.get(f"https://{OPEN}{path}").status_code == 200
    seen = world.seen(world.open)
    assert [s.path for s in seen] == order
    wanted = {"a": "alice-a", "b": "alice-b", "none": None}
    assert [s.cert for s in seen] == [wanted[p.split("/")[1]] for p in order]
    by_connection: dict[int, set[str | None]] = {}
    for s in seen:
        by_connection.setdefault(s.connection, set()).add(s.cert)
    assert all(len(certs) == 1 for certs in by_connection.values()), seen
    if not http2:  # one connection per certificate (none is one too), kept alive for it
        assert world.open.log.connections == 3
    # (HTTP/2 to the agent, HTTP/1.1 upstream: mitmproxy dials a connection per request.)


def test_an_http2_upstream_multiplexes_no_stream_across_certificates(world: World) -> None:
    """HTTP/2 end to end, streams in parallel: mitmproxy would put every stream to one
    address on one upstream connection."""
    world.clear()
    paths = [f"/{kind}/{i}" for i in range(4) for kind in ("a", "none", "b")]
    urls = [f"https://{H2}{p}" for p in paths]
    assert _curl_many(world, world.alice, urls, parallel=True) == ["2 200"] * len(paths)
    wanted = {"a": "alice-a", "b": "alice-b", "none": None}
    seen = world.h2.seen
    assert {s.path: s.cert for s in seen} == {p: wanted[p.split("/")[1]] for p in paths}
    assert len(seen) == len(paths)
    by_connection: dict[int, set[str | None]] = {}
    for s in seen:
        by_connection.setdefault(s.connection, set()).add(s.cert)
    assert all(len(certs) == 1 for certs in by_connection.values())
    assert len(by_connection) >= 3


def test_another_principal_on_the_same_host_goes_without_it(world: World) -> None:
    world.clear()
    with _client(world, world.alice) as a, _client(world, world.bob) as b:
        for _ in range(3):
            assert a.get(f"https://{OPEN}/a/x").status_code == 200
            assert b.get(f"https://{OPEN}/a/x").status_code == 200
    assert [s.cert for s in world.seen(world.open)] == ["alice-a", None] * 3


def test_one_shot_clients_never_get_a_certificates_connection(world: World) -> None:
    """A client connection per request (HTTP/1 only, as credproxy parks upstream connections
    for: addon/mitm/reuse.py): a parked connection never carries a certificate."""
    world.clear()
    for who, path in [(world.alice, "/a/1"), (world.bob, "/a/2"), (world.alice, "/none/3")] * 2:
        with _client(world, who) as client:
            assert client.get(f"https://{OPEN}{path}").status_code == 200
        time.sleep(0.1)  # the proxy parks a connection once it has seen its client go
    seen = world.seen(world.open)
    assert [s.cert for s in seen] == ["alice-a", None, None] * 2
    # Each certificate request dialled its own connection, which served nothing else.
    certified = {s.connection for s in seen if s.cert is not None}
    assert len(certified) == 2
    assert all(s.cert is not None for s in seen if s.connection in certified)


def test_curl_per_request_presents_it_each_time(world: World) -> None:
    world.clear()
    for who, path in [(world.alice, "/a/1"), (world.bob, "/a/2")] * 2:
        done = _curl(world, who, f"https://{OPEN}{path}")
        assert done.stdout.endswith(b"\n200"), done
    assert [s.cert for s in world.seen(world.open)] == ["alice-a", None] * 2


def test_a_required_certificate_passes(world: World) -> None:
    world.clear()
    done = _curl(world, world.alice, f"https://{STRICT}/a/ok")
    assert done.stdout.endswith(b"\n200"), done
    assert [s.cert for s in world.seen(world.strict)] == ["alice-a"]


def test_the_chain_goes_with_the_certificate(world: World) -> None:
    """Issued by an intermediate the upstream does not hold: it verifies only if the proxy
    sends the intermediate too."""
    world.clear()
    with _client(world, world.alice) as client:
        assert client.get(f"https://{STRICT}/c/x").status_code == 200
    assert [s.cert for s in world.seen(world.strict)] == ["alice-chained"]


def test_a_refused_certificate_has_its_own_reason(world: World) -> None:
    world.clear()
    with _client(world, world.alice) as client:
        replies = [client.get(f"https://{STRICT}/rogue/{i}") for i in range(3)]
    assert [r.status_code for r in replies] == [502] * 3
    assert {r.json()["reason"] for r in replies} == {"upstream-tls-client-cert-refused"}
    assert world.seen(world.strict) == []
    lines = [r for r in world.proxy.requests("alice") if r.get("path", "").startswith("/rogue/")]
    assert {(r["reason"], r["error"]) for r in lines} == {
        ("upstream-tls-client-cert-refused", "client-cert-refused")
    }


def test_without_a_certificate_a_strict_upstream_serves_nothing(world: World) -> None:
    """bob's grant has no certificate: his request never goes out with alice's. (TLS 1.3: the
    upstream's alert is often lost to its reset, so this reads as the upstream closing.)"""
    world.clear()
    with _client(world, world.alice) as a, _client(world, world.bob) as b:
        assert a.get(f"https://{STRICT}/a/first").status_code == 200
        reply = b.get(f"https://{STRICT}/a/second")
    assert reply.status_code == 502
    assert reply.json()["reason"] in ("upstream-tls-client-cert-refused", "upstream-protocol-error")
    assert [(s.path, s.cert) for s in world.seen(world.strict)] == [("/a/first", "alice-a")]


def test_an_expired_certificate_is_refused_before_anything_is_sent(world: World) -> None:
    world.clear()
    now = datetime.datetime.now(datetime.UTC)
    secret = _pem(
        world.clients,
        "short",
        not_before=now - datetime.timedelta(minutes=1),
        not_after=now + datetime.timedelta(seconds=2),
    )
    world.proxy.store.add_credential("short", "mtls", [OPEN], secret)
    world.proxy.store.add_grant("alice", ["GET"], credential="short", hosts=[OPEN], paths=["/s/"])
    world.proxy.wait_reload()
    time.sleep(max(0.0, (now + datetime.timedelta(seconds=2.2) - _now()).total_seconds()))
    with _client(world, world.alice) as client:
        reply = client.get(f"https://{OPEN}/s/x")
    assert reply.status_code == 502
    assert reply.json()["reason"] == "client-cert-expired"
    assert world.seen(world.open) == []
    assert world.open.log.connections == 0
    world.key_pems.append(_key_pem(secret))


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def test_no_key_in_any_output(world: World) -> None:
    """Last: the proxy's whole output (audit, logs) after every test above."""
    output = world.proxy.output().encode()
    assert world.key_pems
    for pem in world.key_pems:
        body = pem.splitlines()[1]  # a base64 line of the key
        assert body not in output
        assert pem not in output
    assert os.path.getsize(world.proxy.stdout) > 0
