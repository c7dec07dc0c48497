"""Real processes and sockets: a credproxy subprocess, TLS upstreams, real clients."""

from __future__ import annotations

import itertools
import json
import os
import shutil
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

from store.crypto import MasterKey, write_key_file
from store.repository import Store
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


__all__ = ["MasterKey", "write_key_file"]
