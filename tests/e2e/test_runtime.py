"""The running proxy's life: signals, draining on shutdown, and a store file replaced under it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from store.crypto import load_master_key
from store.repository import Store
from tests.e2e.conftest import CREDPROXY, NAMES, Proxy, _env, _internal, _wait_for, start_proxy
from tests.e2e.raw import connect, get, proxy_auth, read_reply
from tests.e2e.upstream import Upstream

SECRET = "ghp_runtime_secret_0123456789"


@dataclass
class Running:
    """A `credproxy run` whose stdout (the audit stream) and stderr are kept apart."""

    process: subprocess.Popen[bytes]
    port: int
    home: Path
    store: Store
    token: str
    args: list[str]

    def start(self) -> None:
        """Start (or start again) `credproxy run`; its output goes on in the same files."""
        env = _env(self.home)
        with self.stdout.open("ab") as out, self.stderr.open("ab") as err:
            self.process = subprocess.Popen(
                self.args, env=env, cwd=self.home, stdout=out, stderr=err
            )
        before = self.events().count("proxy.started")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.stderr.read_text()
            started = [line for line in self.audit() if line["event"] == "proxy.started"]
            if len(started) > before:
                self.port = int(started[-1]["listen"][0].rsplit(":", 1)[1])
                return
            time.sleep(0.05)
        raise AssertionError("credproxy did not start")

    @property
    def stdout(self) -> Path:
        return self.home / "proxy.out"

    @property
    def stderr(self) -> Path:
        return self.home / "proxy.err"

    def audit(self) -> list[dict[str, Any]]:
        if not self.stdout.exists():
            return []
        return [json.loads(line) for line in self.stdout.read_text().splitlines() if line.strip()]

    def events(self) -> list[str]:
        return [line["event"] for line in self.audit()]

    def client(self, **kwargs: Any) -> httpx.Client:
        context = ssl.create_default_context(cafile=str(self.home / "certs" / "credproxy-ca.pem"))
        proxy = f"http://agent:{self.token}@127.0.0.1:{self.port}"
        return httpx.Client(proxy=proxy, verify=context, **kwargs)

    def wait_for(self, event: str, after: int = 0, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if event in self.events()[after:]:
                return
            time.sleep(0.05)
        raise AssertionError(f"no {event} within {timeout} s: {self.events()}")


@pytest.fixture
def running(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Running]:
    """A proxy of its own; indirect parametrisation adds flags to `credproxy run`."""
    home = tmp_path / "home"
    shutil.copytree(initialised_home, home)
    ca_pem = home / "upstream-ca.pem"
    upstream_ca.cert_pem.write_to_path(str(ca_pem))
    store = Store(_env(home)["CREDPROXY_DB"], load_master_key(home / "credproxy.key", {}))
    token = store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.test"], _secret())
    store.add_grant("agent", ["GET"], credential="gh")
    args = [*CREDPROXY, "run", "--listen", "127.0.0.1:0", "--upstream-ca", str(ca_pem)]
    for name in NAMES:
        if name != "localhost":
            args += ["--resolve", f"{name}=127.0.0.1:{shared_upstream.port}"]
    args += getattr(request, "param", [])
    proxy = Running(None, 0, home, store, token, args)  # type: ignore[arg-type]
    proxy.start()
    yield proxy
    if proxy.process.poll() is None:
        proxy.process.kill()
        proxy.process.wait(5)
    store.close()


def _secret() -> Any:
    from store.crypto import Secret

    return Secret(SECRET.encode())


def _refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def _stopped_cleanly(proxy: Running) -> None:
    assert proxy.process.wait(15) == 0
    assert proxy.stderr.read_text() == ""
    assert proxy.events()[-1] == "proxy.stopped"


def test_sigterm_lets_an_in_flight_stream_finish_and_then_stops(
    running: Running, shared_upstream: Upstream
) -> None:
    with running.client() as client, client.stream("GET", "https://api.test/sse") as reply:
        chunks = reply.iter_raw()
        first = next(chunks)
        running.process.send_signal(signal.SIGTERM)
        running.wait_for("proxy.stopping")
        # It stops accepting at once, while the stream goes on.
        deadline = time.monotonic() + 2
        while not _refuses_connections(running.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _refuses_connections(running.port)
        body = first + b"".join(chunks)
    assert reply.status_code == 200
    assert [f"data: event-{i}".encode() in body for i in range(3)] == [True] * 3
    _stopped_cleanly(running)
    audit = running.audit()
    (line,) = [a for a in audit if a.get("event") == "request" and a.get("path") == "/sse"]
    assert (line["decision"], line["status"]) == ("allow", 200)
    assert audit.index(line) < len(audit) - 1
    assert audit[-1]["cut"] == 0
    assert SECRET not in running.stdout.read_text()


@pytest.mark.parametrize("running", [["--drain-timeout", "0.2"]], indirect=True)
def test_a_stream_past_the_drain_deadline_is_cut_and_still_audited(running: Running) -> None:
    with running.client() as client, client.stream("GET", "https://api.test/sse") as reply:
        chunks = reply.iter_raw()
        next(chunks)
        running.process.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.RemoteProtocolError):
            b"".join(chunks)
    _stopped_cleanly(running)
    audit = running.audit()
    (line,) = [a for a in audit if a.get("event") == "request" and a.get("path") == "/sse"]
    assert audit.index(line) < len(audit) - 1
    assert audit[-1]["cut"] == 1


def test_sigterm_on_an_idle_proxy_stops_at_once(running: Running) -> None:
    with running.client() as client:
        assert client.get("https://api.test/v1").status_code == 200
        # The client keeps its connection open: an idle keep-alive is closed, not waited for.
        running.process.send_signal(signal.SIGTERM)
        _stopped_cleanly(running)


def test_sighup_reloads_the_policy_and_keeps_serving(running: Running) -> None:
    before = len(running.events())
    running.process.send_signal(signal.SIGHUP)
    running.wait_for("proxy.reload_requested", before)
    running.wait_for("policy.reloaded", before)
    assert running.process.poll() is None
    with running.client() as client:
        assert client.get("https://api.test/v1").status_code == 200
    running.process.send_signal(signal.SIGINT)
    _stopped_cleanly(running)


def _restore(db: Path, change: Any) -> None:
    """Replace the store file with a copy of it that `change` altered (a restore)."""
    copy = db.with_name("restored.db")
    source, target = sqlite3.connect(db), sqlite3.connect(copy)
    source.backup(target)
    source.close()
    target.close()
    restored = Store(f"sqlite:///{copy}", load_master_key(db.parent / "credproxy.key", {}))
    change(restored)
    restored.close()  # the last connection checkpoints the copy's WAL into the file
    # As with any SQLite restore, the old file's WAL must not be read against the new file.
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    os.replace(copy, db)


def test_a_store_file_replaced_under_the_proxy_is_reloaded(running: Running) -> None:
    db = running.home / "credproxy.db"
    with running.client() as client:
        assert client.get("https://api.test/v1").status_code == 200
        (grant,) = running.store.list_grants()
        _restore(db, lambda store: store.revoke_grant(grant.id))
        deadline = time.monotonic() + 5
        status = 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            status = client.get("https://api.test/v1").status_code
    assert status == 403
    assert "store.replaced" in running.events()
    running.process.send_signal(signal.SIGTERM)
    _stopped_cleanly(running)


def test_a_store_file_deleted_under_the_proxy_is_an_outage(running: Running) -> None:
    db = running.home / "credproxy.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    running.wait_for("store.unavailable")
    assert not db.exists()
    running.process.send_signal(signal.SIGTERM)
    _stopped_cleanly(running)


def test_spent_grants_keep_their_reasons_across_a_restart(running: Running) -> None:
    store = running.store
    (standing,) = store.list_grants()
    store.revoke_grant(standing.id)
    store.add_grant("agent", ["GET"], credential="gh", paths=["/v1/"])
    store.add_grant("agent", ["GET"], credential="gh", paths=["/once/"], once=True)
    target = store.change_counter()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        loaded = [a["counter"] for a in running.audit() if a["event"] == "policy.reloaded"]
        if loaded and loaded[-1] >= target:
            break
        time.sleep(0.05)

    def reasons() -> list[str | None]:
        with running.client() as client:
            return [
                client.get(f"https://api.test{path}").headers.get("x-credproxy-reason")
                for path in ("/once/a", "/once/a", "/other")
            ]

    assert reasons() == [None, "grant-consumed", "path-not-allowed"]
    running.process.send_signal(signal.SIGTERM)
    _stopped_cleanly(running)
    running.start()
    assert reasons() == ["grant-consumed", "grant-consumed", "path-not-allowed"]


# A `credproxy run` whose start-up probe of the address is skipped once: the listener then
# fails inside mitmproxy, as when the port is taken between the probe and the listen.
_PROBE_SKIPPED = """
import sys
from addon.cli import cli
from addon.runtime import serve
probe = serve.check_listen
skipped = []
def once(host, port):
    if not skipped:
        skipped.append(port)
        return
    probe(host, port)
serve.check_listen = once
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("probe", ["probed", "taken after the probe"])
def test_a_second_proxy_on_a_busy_port_says_which_address_is_in_use(
    running: Running, probe: str
) -> None:
    command = CREDPROXY if probe == "probed" else [CREDPROXY[0], "-c", _PROBE_SKIPPED]
    second = subprocess.run(
        [*command, "run", "--listen", f"127.0.0.1:{running.port}"],
        env=_env(running.home),
        cwd=running.home,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2, second.stderr
    assert second.stderr == (
        f"credproxy: error: cannot listen on --listen 127.0.0.1:{running.port}: "
        f"127.0.0.1:{running.port} is already in use\n"
    )
    if probe == "probed":
        assert second.stdout == ""  # mitmproxy never started, nor its advice about --mode
    # The first proxy serves on.
    with running.client() as client:
        assert client.get("https://api.test/").status_code == 200


# -- signals during traffic ----------------------------------------------------------------


@pytest.fixture
def own_proxy(
    tmp_path: Path, shared_upstream: Upstream, upstream_ca: trustme.CA, initialised_home: Path
) -> Iterator[Proxy]:
    """A proxy of this test's own, to be signalled."""
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    running = start_proxy(
        tmp_path, upstream_ca, resolve, extra=["--drain-timeout", "2"], template=initialised_home
    )
    yield running
    if running.process.poll() is None:
        running.process.kill()
        running.process.wait(5)
    running.store.close()


def _hold_in_flight(proxy: Proxy, who: tuple[str, str]) -> ssl.SSLSocket:
    """A POST whose body stops half-way: in flight until something cuts it."""
    sock, reply = connect(proxy.port, "api.test:443", proxy_auth(*who))
    assert reply.status == 200
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    tls = context.wrap_socket(sock, server_hostname="api.test")
    tls.sendall(b"POST /v1/up HTTP/1.1\r\nHost: api.test\r\nContent-Length: 100\r\n\r\nxx")
    return tls


@pytest.mark.parametrize(
    "signals",
    [
        pytest.param(["SIGTERM", "SIGHUP", "SIGHUP", "SIGHUP"], id="SIGHUP during the drain"),
        pytest.param(["SIGINT", "SIGINT"], id="a second SIGINT"),
        pytest.param(["SIGHUP", "SIGTERM"], id="SIGTERM right after SIGHUP"),
    ],
)
def test_signals_during_traffic_end_with_proxy_stopped_and_exit_0(own_proxy: Proxy, signals):
    import signal as signal_module

    name = "sig-" + os.urandom(3).hex()
    token = own_proxy.store.add_principal(name)
    own_proxy.store.add_grant(name, ["GET", "POST"], hosts=["api.test"])
    own_proxy.wait_reload()
    held = [_hold_in_flight(own_proxy, (name, token)) for _ in range(3)]
    assert get(own_proxy, (name, token)).status == 200
    try:
        for sig in signals:
            own_proxy.process.send_signal(getattr(signal_module, sig))
            time.sleep(0.3)
        rc = own_proxy.process.wait(15)
    finally:
        for tls in held:
            tls.close()
    lines = own_proxy.output().splitlines()
    events = [json.loads(line).get("event") for line in lines]  # every line is JSON
    assert rc == 0
    assert events[-1] == "proxy.stopped"
    assert "proxy.stopping" in events


# -- a stdout that cannot take lines at shutdown -------------------------------------------


@pytest.mark.parametrize("reader", ["stalled", "gone"])
def test_sigterm_with_stdout_that_cannot_take_lines_still_exits_promptly(
    tmp_path: Path, upstream_ca: trustme.CA, initialised_home: Path, reader: str
):
    """stdout a pipe that nobody reads (or whose reader has gone), the proxy refusing with
    audit-unavailable; SIGTERM still ends it within the drain timeout plus the 5 s drain."""
    import shutil
    import subprocess

    shutil.copytree(initialised_home, tmp_path, dirs_exist_ok=True)
    env = _env(tmp_path)
    args = [*CREDPROXY, "run", "--listen", "127.0.0.1:0", "--drain-timeout", "1"]
    process = subprocess.Popen(
        args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        started = json.loads(process.stdout.readline())
        port = int(started["listen"][0].rsplit(":", 1)[1])
        if reader == "gone":
            process.stdout.close()
        refused = None
        for _ in range(3000):  # unauthenticated CONNECTs: one deny line each
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
                reply = read_reply(sock)
            if reply.reason == "audit-unavailable":
                refused = reply
                break
        assert refused is not None and refused.status == 503
        began = time.monotonic()
        process.terminate()
        rc = process.wait(15)
        took = time.monotonic() - began
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
    assert rc == 0
    assert took < 1 + 5 + 2 + 1
    assert process.stderr is not None and process.stderr.read() == b""


# -- the SQLite file removed ---------------------------------------------------------------


# After the store file is deleted, an explicit ask is refused, never written to the unlinked
# file and answered 202.
def test_an_access_request_after_the_store_file_is_deleted_is_not_written_to_it(
    own_proxy: Proxy,
):
    name = "gone-" + os.urandom(3).hex()
    token = own_proxy.store.add_principal(name)
    own_proxy.wait_reload()
    database = own_proxy.home / "credproxy.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    assert _wait_for(lambda: "store.unavailable" in own_proxy.output(), 5)
    ask = json.dumps({"host": "api.test", "method": "GET", "path": "/v1/lost"}).encode()
    reply = _internal(own_proxy, (name, token), "POST", "/access-requests", ask)
    # README: "credproxy never serves on from an unlinked file"; the ask is lost with it.
    assert (reply.status, reply.reason) == (503, "store-unavailable")


def test_a_once_grant_after_the_store_file_is_deleted_is_refused(own_proxy: Proxy):
    name = "gone1-" + os.urandom(3).hex()
    token = own_proxy.store.add_principal(name)
    own_proxy.store.add_grant(name, ["GET"], hosts=["api.test"], once=True)
    own_proxy.wait_reload()
    database = own_proxy.home / "credproxy.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    assert _wait_for(lambda: "store.unavailable" in own_proxy.output(), 5)
    reply = get(own_proxy, (name, token))
    assert (reply.status, reply.reason) == (503, "store-unavailable")
