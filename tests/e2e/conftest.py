"""Real processes and sockets: a credproxy subprocess, TLS upstreams, real clients."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
import wsproto.events as ev
from wsproto import WSConnection
from wsproto.extensions import PerMessageDeflate

from store.crypto import MasterKey, write_key_file
from store.repository import Store
from tests.e2e.echoes import H2_SCRIPTS, SCRIPTS, _principal, _ws_upgrade
from tests.e2e.memory import MIB
from tests.e2e.misbehaving import H2Upstream, RawUpstream, head
from tests.e2e.raw import Reply, proxy_auth, read_reply
from tests.e2e.servers import Tarpit, Upgrade, WsUpstream, big_answer
from tests.e2e.upstream import Upstream

NAMES = ["api.test", "other.test", "x.wild.test", "evil.test", "localhost"]
CREDPROXY = [sys.executable, "-m", "addon.cli.cli"]


@pytest.fixture(scope="session")
def upstream_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def shared_upstream(upstream_ca: trustme.CA) -> Iterator[Upstream]:
    with Upstream(upstream_ca, NAMES) as server:
        yield server


@pytest.fixture
def upstream(shared_upstream: Upstream) -> Upstream:
    """The module's upstream, its log cleared for this test."""
    time.sleep(0.05)  # let the previous test's connections close
    shared_upstream.log.clear()
    return shared_upstream


@pytest.fixture(scope="session")
def initialised_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `credproxy init` (key, CA, migrated database) that each proxy copies."""
    home = tmp_path_factory.mktemp("template")
    subprocess.run([*CREDPROXY, "init"], env=_env(home), cwd=home, check=True, capture_output=True)
    return home


@dataclass
class Proxy:
    """A running `credproxy run` and the store behind it."""

    process: subprocess.Popen[bytes]
    port: int
    store: Store
    home: Path
    stdout: Path
    env: dict[str, str]

    @property
    def ca_file(self) -> Path:
        return self.home / "certs" / "credproxy-ca.pem"

    def url(self, principal: str, token: str) -> str:
        return f"http://{principal}:{token}@127.0.0.1:{self.port}"

    def client(self, principal: str, token: str, **kwargs: Any) -> httpx.Client:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        return httpx.Client(proxy=self.url(principal, token), verify=context, **kwargs)

    def output(self) -> str:
        """Everything the proxy wrote so far. It writes audit lines at its event loop's next
        iteration, just after the response has gone out: wait until the output settles."""
        text = self.stdout.read_text()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            time.sleep(0.03)
            again = self.stdout.read_text()
            if again == text:
                break
            text = again
        return text

    def audit(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.output().splitlines() if line.strip()]

    def requests(self, principal: str | None = None) -> list[dict[str, Any]]:
        return [
            line
            for line in self.audit()
            if line.get("event") == "request" and principal in (None, line.get("principal"))
        ]

    def wait_reload(self, timeout: float = 3.0) -> None:
        """Wait until the proxy has loaded the store's current change counter."""
        target = self.store.change_counter()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in reversed(self.audit()):
                if line.get("event") in ("policy.reloaded", "proxy.started"):
                    if line.get("counter", -1) >= target:
                        return
                    break
            time.sleep(0.05)
        raise AssertionError("the proxy did not reload within the timeout")


def _env(home: Path, db: str | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "CREDPROXY_DB": db or f"sqlite:///{home}/credproxy.db",
        "CREDPROXY_KEY_FILE": str(home / "credproxy.key"),
        "CREDPROXY_CERTS": str(home / "certs"),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("CREDPROXY_MASTER_KEY", None)
    return env


def start_proxy(
    home: Path,
    upstream_ca: trustme.CA,
    resolve: list[str],
    extra: list[str] | None = None,
    template: Path | None = None,
    db: str | None = None,
    store_db: str | None = None,
) -> Proxy:
    """Start `credproxy run` in `home`; `db` is what the proxy uses, `store_db` the test's."""
    if template is not None:
        shutil.copytree(template, home, dirs_exist_ok=True)
    ca_pem = home / "upstream-ca.pem"
    upstream_ca.cert_pem.write_to_path(str(ca_pem))
    env = _env(home, db)
    if not (home / "credproxy.key").exists():
        subprocess.run([*CREDPROXY, "init"], env=env, cwd=home, check=True, capture_output=True)
    args = [*CREDPROXY, "run", "--listen", "127.0.0.1:0", "--upstream-ca", str(ca_pem)]
    for spec in resolve:
        args += ["--resolve", spec]
    stdout = home / "proxy.out"
    out = stdout.open("wb")
    process = subprocess.Popen(
        args + (extra or []), env=env, cwd=home, stdout=out, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 15
    port = None
    while time.monotonic() < deadline and port is None:
        if process.poll() is not None:
            raise AssertionError(f"credproxy exited: {stdout.read_text()}")
        for line in stdout.read_text().splitlines():
            if '"proxy.started"' in line:
                port = int(json.loads(line)["listen"][0].rsplit(":", 1)[1])
        time.sleep(0.05)
    if port is None:
        process.kill()
        raise AssertionError(f"credproxy did not start: {stdout.read_text()}")
    key = _load_key(home)
    return Proxy(process, port, Store(store_db or env["CREDPROXY_DB"], key), home, stdout, env)


def _load_key(home: Path) -> MasterKey:
    from store.crypto import load_master_key

    return load_master_key(home / "credproxy.key", {})


def stop_proxy(proxy: Proxy) -> None:
    proxy.process.terminate()
    try:
        proxy.process.wait(10)
    except subprocess.TimeoutExpired:
        proxy.process.kill()
    proxy.store.close()


@pytest.fixture(scope="module")
def proxy(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    """One proxy per module; tests keep apart by using their own principal names."""
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    home = tmp_path_factory.mktemp("proxy")
    running = start_proxy(home, upstream_ca, resolve, template=initialised_home)
    yield running
    stop_proxy(running)


_counter = itertools.count()


@pytest.fixture
def names() -> Callable[[str], str]:
    """Unique store names for this test, so tests can share one proxy."""
    n = next(_counter)
    return lambda base: f"{base}-{n}"


TWO_HOSTS = ["api.test", "other.test"]


@pytest.fixture(scope="module")
def loopback_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proxy, Upstream]]:
    """A real proxy with loopback opened by --allow-private, and an upstream for two names."""
    ca = trustme.CA()
    with Upstream(ca, TWO_HOSTS) as upstream:
        home = tmp_path_factory.mktemp("gaps")
        resolve = [f"{name}=127.0.0.1:{upstream.port}" for name in TWO_HOSTS]
        proxy = start_proxy(home, ca, resolve, extra=["--allow-private", "127.0.0.0/8"])
        try:
            yield proxy, upstream
        finally:
            stop_proxy(proxy)


# -- a proxy with second-long deadlines, behind upstreams that flood, drip and bomb --------


SHORT = ["--head-timeout", "1", "--idle-timeout", "2", "--connect-timeout", "1"]
SHORT += ["--upstream-timeout", "2"]


def _flood_or_sink(count: int) -> Upgrade:
    """By the last path segment: `flood`: one message that never ends, 1 MiB fragments,
    `count` of them; `sink`: reads and drops everything the client sends."""

    def upgrade(sock: ssl.SSLSocket, ws: WSConnection, request: ev.Request) -> None:
        offered = ",".join(request.extensions or [])  # type: ignore[arg-type]
        exts = [PerMessageDeflate()] if "permessage-deflate" in offered else []
        sock.sendall(ws.send(ev.AcceptConnection(extensions=exts)))
        if request.target.endswith("/flood"):
            chunk = b"u" * MIB
            for _ in range(count):
                sock.sendall(ws.send(ev.BytesMessage(chunk, message_finished=False)))

    return upgrade


@pytest.fixture(scope="module")
def ws_upstream(upstream_ca: trustme.CA) -> Iterator[WsUpstream]:
    with WsUpstream(upstream_ca, "ws.test", _flood_or_sink(48), timeout=20) as server:
        yield server


@pytest.fixture(scope="module")
def big_pit(upstream_ca: trustme.CA) -> Iterator[Tarpit]:
    """big.test: answers each request with a 64 MiB body, as fast as it is read."""
    with Tarpit(upstream_ca, answer=big_answer()) as pit:
        yield pit


def _drip(secret: bytes) -> Iterator[bytes]:
    """A 40-byte body of known length, one byte every 0.25 s (10 s in all)."""
    yield b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n"
    for _ in range(40):
        time.sleep(0.25)
        yield b"d"


def _h2_drip(conn: Any, stream_id: int, secret: bytes) -> Iterator[None]:
    """_drip over HTTP/2: one DATA frame of one byte every 0.25 s."""
    conn.send_headers(stream_id, [(":status", "200"), ("content-length", "40")])
    for n in range(40):
        yield
        time.sleep(0.25)
        conn.send_data(stream_id, b"d", end_stream=n == 39)
    yield


@pytest.fixture(scope="module")
def drip(upstream_ca: trustme.CA) -> Iterator[RawUpstream]:
    """drip.test: see _drip."""
    with RawUpstream(upstream_ca, ["drip.test"], {"/v1/x": _drip}, linger=1) as server:
        yield server


@pytest.fixture(scope="module")
def h2_drip(upstream_ca: trustme.CA) -> Iterator[H2Upstream]:
    """drip2.test: see _h2_drip."""
    with H2Upstream(upstream_ca, ["drip2.test"], {"/v1/x": _h2_drip}) as server:
        yield server


@pytest.fixture(scope="module")
def bomb_body() -> bytes:
    return gzip.compress(b"\0" * (96 * MIB), 9)


@pytest.fixture(scope="module")
def bomb(upstream_ca: trustme.CA, bomb_body: bytes) -> Iterator[RawUpstream]:
    """bomb.test: every response is the bomb with `Content-Encoding: gzip`, despite the
    proxy's Accept-Encoding: identity (an object stored with that encoding)."""
    answer = head(
        b"HTTP/1.1 200 OK",
        b"Content-Type: application/octet-stream",
        b"Content-Encoding: gzip",
        b"Content-Length: %d" % len(bomb_body),
    )
    scripts = {"/v1/object": lambda s: answer + bomb_body}
    with RawUpstream(upstream_ca, ["bomb.test"], scripts, linger=1) as server:
        yield server


@pytest.fixture(scope="module")
def proxy_b(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    ws_upstream: WsUpstream,
    big_pit: Tarpit,
    bomb: RawUpstream,
    drip: RawUpstream,
    h2_drip: H2Upstream,
) -> Iterator[Proxy]:
    """One proxy with second-long deadlines for the attacks that need nothing else."""
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    resolve += [f"ws.test=127.0.0.1:{ws_upstream.port}", f"big.test=127.0.0.1:{big_pit.port}"]
    resolve += [f"bomb.test=127.0.0.1:{bomb.port}", f"drip.test=127.0.0.1:{drip.port}"]
    resolve += [f"drip2.test=127.0.0.1:{h2_drip.port}"]
    home = tmp_path_factory.mktemp("review-b")
    running = start_proxy(home, upstream_ca, resolve, extra=SHORT, template=initialised_home)
    yield running
    stop_proxy(running)


@pytest.fixture
def bystander(proxy_b: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    """Another principal, with a GET grant on api.test: it must keep being served."""
    name = names("bystander")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=["api.test"])
    proxy_b.wait_reload()
    return name, token


def _internal_head(who: tuple[str, str], method: str, path: str, length: int, *extra: str) -> bytes:
    """A request head to credproxy.internal with a JSON body of `length` bytes."""
    return (
        f"{method} http://credproxy.internal{path} HTTP/1.1\r\n"
        "Host: credproxy.internal\r\n"
        f"Proxy-Authorization: {proxy_auth(*who)}\r\n"
        "Content-Type: application/json\r\n"
        + "".join(f"{line}\r\n" for line in extra)
        + f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _internal(proxy: Proxy, who: tuple[str, str], method: str, path: str, body: bytes) -> Reply:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=15) as sock:
        sock.sendall(_internal_head(who, method, path, len(body)) + body)
        return read_reply(sock)


def _wait_for(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


# -- a proxy behind upstreams that echo the stamped secret (tests/e2e/echoes.py) ----------


@pytest.fixture(scope="module")
def echo_servers(upstream_ca: trustme.CA) -> Iterator[dict[str, Any]]:
    with (
        Upstream(upstream_ca, ["api.test"]) as api,
        RawUpstream(upstream_ca, ["raw.test"], SCRIPTS) as raw,
        WsUpstream(upstream_ca, "ws.test", _ws_upgrade) as ws,
        H2Upstream(upstream_ca, ["h2.test"], H2_SCRIPTS) as h2,
    ):
        yield {"api": api, "raw": raw, "ws": ws, "h2": h2}


@pytest.fixture(scope="module")
def rproxy(
    tmp_path_factory: pytest.TempPathFactory,
    echo_servers: dict[str, Any],
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    resolve = [
        f"api.test=127.0.0.1:{echo_servers['api'].port}",
        f"raw.test=127.0.0.1:{echo_servers['raw'].port}",
        f"ws.test=127.0.0.1:{echo_servers['ws'].port}",
        f"h2.test=127.0.0.1:{echo_servers['h2'].port}",
    ]
    home = tmp_path_factory.mktemp("review-a")
    running = start_proxy(home, upstream_ca, resolve, template=initialised_home)
    yield running
    stop_proxy(running)


@pytest.fixture
def api(echo_servers: dict[str, Any]) -> Upstream:
    time.sleep(0.05)
    echo_servers["api"].log.clear()
    return echo_servers["api"]


@pytest.fixture
def raw_agent(rproxy: Proxy, names) -> tuple[str, str]:
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(
        principal, ["GET", "HEAD"], credential=cred, hosts=["raw.test"], paths=["/v1/"]
    )
    rproxy.wait_reload()
    return principal, token


__all__ = ["MasterKey", "write_key_file"]
