"""oauth2-refresh across two replicas on one PostgreSQL store: the row lock makes one replica
refresh while the other waits and uses its result, so a provider that invalidates a refresh
token on use never sees one twice.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import trustme

from store.crypto import Secret
from tests.e2e.conftest import CREDPROXY, Proxy, start_proxy, stop_proxy
from tests.e2e.fakeoauth import API, AUTH, TOKEN_URL, Provider
from tests.e2e.relay import pg_database
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def provider() -> Provider:
    return Provider()


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    provider: Provider,
) -> Iterator[list[Proxy]]:
    with (
        pg_database("credproxy_mint_", required_in_ci=True) as pg_url,
        Upstream(upstream_ca, [AUTH, API], app=provider) as server,
    ):
        shared = tmp_path_factory.mktemp("mint-shared")
        shutil.copy2(initialised_home / "credproxy.key", shared / "credproxy.key")
        env = {
            **os.environ,
            "CREDPROXY_DB": pg_url,
            "CREDPROXY_KEY_FILE": str(shared / "credproxy.key"),
        }
        subprocess.run([*CREDPROXY, "init"], env=env, cwd=shared, check=True, capture_output=True)
        resolve = [f"{name}=127.0.0.1:{server.port}" for name in (AUTH, API)]
        running = []
        try:
            for label in ("a", "b"):
                home = tmp_path_factory.mktemp(f"mint-replica-{label}")
                running.append(
                    start_proxy(
                        home,
                        upstream_ca,
                        resolve,
                        extra=["--key-file", str(shared / "credproxy.key")],
                        template=initialised_home,
                        db=pg_url,
                    )
                )
            yield running
        finally:
            for proxy in running:
                if proxy.process.poll() is None:
                    stop_proxy(proxy)


def _credential(replicas: list[Proxy], provider: Provider, name: str) -> str:
    client_secret = "rs-" + secrets.token_urlsafe(24)
    refresh = "refresh-" + secrets.token_urlsafe(24)
    provider.clients[name] = client_secret
    provider.refresh[refresh] = name
    store = replicas[0].store
    secret = {"client_id": name, "client_secret": client_secret, "refresh_token": refresh}
    store.add_credential(
        name,
        "oauth2-refresh",
        [API],
        Secret(json.dumps(secret).encode()),
        options={"token_url": TOKEN_URL},
    )
    token = store.add_principal(name)
    store.add_grant(name, ["GET"], credential=name, paths=["/v1/"])
    for proxy in replicas:
        proxy.wait_reload(timeout=10)
    return token


def test_32_concurrent_first_requests_on_two_replicas_refresh_once(
    replicas: list[Proxy], provider: Provider
):
    provider.delay = 0.5  # every request arrives while the refresh runs
    token = _credential(replicas, provider, "shared")
    barrier = threading.Barrier(32)

    def one(i: int) -> int:
        with replicas[i % 2].client("shared", token, timeout=30) as client:
            barrier.wait(timeout=30)
            return client.get(f"https://{API}/v1/x").status_code

    try:
        with ThreadPoolExecutor(32) as pool:
            statuses = list(pool.map(one, range(32)))
    finally:
        provider.delay = 0.0
    assert statuses == [200] * 32
    assert provider.count("shared") == 1
    assert provider.stale_refresh == 0 and not provider.refused


def test_a_replica_killed_mid_refresh_leaves_the_store_usable(
    replicas: list[Proxy], provider: Provider
):
    """Killed while it holds the row lock and waits on the endpoint: PostgreSQL ends its
    transaction, nothing half-written stays, and the other replica refreshes. (The provider
    here does not rotate: one that rotated in the killed call would refuse the sealed token.)"""
    provider.rotate = False
    token = _credential(replicas, provider, "killed")
    a, b = replicas
    provider.delay, provider.arrived = 3.0, 0
    errors: list[BaseException] = []

    def on_a() -> None:
        try:
            with a.client("killed", token, timeout=10) as client:
                client.get(f"https://{API}/v1/x")
        except Exception as e:  # the proxy dies under it
            errors.append(e)

    thread = threading.Thread(target=on_a)
    thread.start()
    deadline = time.monotonic() + 10
    while provider.arrived == 0:  # until A's refresh call is in flight
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(a.process.pid, signal.SIGKILL)
    a.process.wait(5)
    thread.join(15)
    provider.delay = 0.0
    with b.client("killed", token, timeout=30) as client:
        assert client.get(f"https://{API}/v1/x").status_code == 200
    sealed = json.loads(b.store.snapshot().credentials["killed"].secret.reveal())
    assert provider.refresh.get(sealed["refresh_token"]) == "killed"
