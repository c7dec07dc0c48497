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
from tests.e2e.conftest import CREDPROXY, NAMES, _env
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
