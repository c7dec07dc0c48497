"""Two proxy replicas on one store, SQLite and PostgreSQL: the redaction set follows the
store. A secret another replica changed (a rotated refresh token, the access token sealed
beside it, a rotated credential) is redacted by every replica once it has reloaded, and the
values it replaced stay redacted (README: Running several replicas).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from store.crypto import Secret
from tests.e2e.conftest import CREDPROXY, Proxy, start_proxy, stop_proxy
from tests.e2e.fakeoauth import API, AUTH, TOKEN_URL, Provider
from tests.e2e.relay import pg_database
from tests.e2e.upstream import Answer, Received, Upstream

pytestmark = pytest.mark.e2e

# A careless API behind the credential's second host: it answers whatever values the test
# says it kept of what it was sent (`Echo.values`), JSON-escaped and plain.
ECHO = "echo.mint.test"


class Echo:
    def __init__(self, provider: Provider) -> None:
        self.provider = provider
        self.values: Callable[[], list[str]] = list

    def __call__(self, received: Received) -> Answer | None:
        host = (received.header("host") or [""])[0].split(":")[0]
        if host != ECHO:
            return self.provider(received)
        kept = self.values()
        body = json.dumps({"kept": kept}) + "\n" + " ".join(kept)
        return 200, [("content-type", "application/json")], body.encode()


@pytest.fixture(scope="module")
def provider() -> Provider:
    return Provider()


@pytest.fixture(scope="module")
def echo(provider: Provider) -> Echo:
    return Echo(provider)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def pair(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    echo: Echo,
) -> Iterator[list[Proxy]]:
    """Replicas P1 and P2 on one store (one SQLite file, or one PostgreSQL database)."""
    shared = tmp_path_factory.mktemp(f"redact-{request.param}")
    shutil.copy2(initialised_home / "credproxy.key", shared / "credproxy.key")
    with (
        _database(request.param, shared) as url,
        Upstream(upstream_ca, [AUTH, API, ECHO], app=echo) as server,
    ):
        env = {
            **os.environ,
            "CREDPROXY_DB": url,
            "CREDPROXY_KEY_FILE": str(shared / "credproxy.key"),
        }
        subprocess.run([*CREDPROXY, "init"], env=env, cwd=shared, check=True, capture_output=True)
        resolve = [f"{name}=127.0.0.1:{server.port}" for name in (AUTH, API, ECHO)]
        running: list[Proxy] = []
        try:
            for label in ("p1", "p2"):
                home = tmp_path_factory.mktemp(f"redact-{request.param}-{label}")
                running.append(
                    start_proxy(
                        home,
                        upstream_ca,
                        resolve,
                        extra=["--key-file", str(shared / "credproxy.key")],
                        template=initialised_home,
                        db=url,
                    )
                )
            yield running
        finally:
            for proxy in running:
                stop_proxy(proxy)


def _database(kind: str, shared: Path):  # type: ignore[no-untyped-def]
    if kind == "postgresql":
        return pg_database("credproxy_redact_", required_in_ci=True)
    from contextlib import nullcontext

    return nullcontext(f"sqlite:///{shared}/credproxy.db")


def _agent(pair: list[Proxy], credential: str) -> tuple[str, str]:
    store = pair[0].store
    agent = credential + "-agent"
    token = store.add_principal(agent)
    store.add_grant(agent, ["GET"], credential=credential, paths=["/"])
    for proxy in pair:
        proxy.wait_reload(timeout=10)
    return agent, token


def _get(proxy: Proxy, agent: str, token: str, url: str) -> httpx.Response:
    with proxy.client(agent, token, timeout=30) as client:
        return client.get(url)


def _sealed(proxy: Proxy, name: str) -> dict[str, str]:
    found: dict[str, str] = json.loads(proxy.store.snapshot().credentials[name].secret.reveal())
    return found


def _clear(text: str, values: list[str]) -> list[int]:
    """Which of `values` (by index: never printed) `text` holds in the clear."""
    return [i for i, value in enumerate(values) if value in text]


def test_a_refresh_token_rotated_by_the_other_replica_is_redacted_by_both(
    pair: list[Proxy], provider: Provider, echo: Echo
):
    """P2 refreshes (RT0 -> RT1); P1 takes the access token P2 sealed, the API refuses it,
    and P1 refreshes (RT1 -> RT2). After both reload, an API echoing every refresh and
    access token the credential ever had, and its client secret, shows none of them
    through either replica: the current ones (RT2, P1's access token, which P2 never
    stamped) and the replaced ones (RT0, RT1, P2's access token, still live)."""
    p1, p2 = pair
    name = "rotating-" + secrets.token_hex(3)
    client_secret = "rs-" + secrets.token_urlsafe(24)
    rt0 = "refresh-" + secrets.token_urlsafe(24)
    provider.clients[name] = client_secret
    provider.refresh[rt0] = name
    secret = {"client_id": name, "client_secret": client_secret, "refresh_token": rt0}
    p1.store.add_credential(
        name,
        "oauth2-refresh",
        [API, ECHO],
        Secret(json.dumps(secret).encode()),
        options={"token_url": TOKEN_URL},
    )
    agent, token = _agent(pair, name)

    assert _get(p2, agent, token, f"https://{API}/v1/x").status_code == 200
    rt1 = _sealed(p2, name)["refresh_token"]
    # P1 has no token yet: it takes P2's from the store, which the API refuses; P1 refreshes.
    assert _get(p1, agent, token, f"https://{API}/v1/reject").status_code == 401
    assert _get(p1, agent, token, f"https://{API}/v1/x").status_code == 200
    rt2 = _sealed(p1, name)["refresh_token"]
    assert provider.count(name) == 2 and len({rt0, rt1, rt2}) == 3
    for proxy in pair:
        proxy.wait_reload(timeout=10)

    issued = [value for value, found in provider.issued.items() if found.who == name]
    kept = [client_secret, rt0, rt1, rt2, *issued]
    echo.values = lambda: kept
    for proxy in (p2, p1):
        answer = _get(proxy, agent, token, f"https://{ECHO}/kept")
        assert answer.status_code == 200
        assert _clear(answer.text, kept) == [], f"in the clear through {proxy.home.name}"
        assert answer.text.count("[REDACTED]") == 2 * len(kept)


def test_a_rotated_credential_keeps_its_old_value_redacted_on_both_replicas(
    pair: list[Proxy], echo: Echo
):
    """`credential rotate` on one replica's store: the old value, which the upstream may
    still accept, stays redacted on both replicas, as does the new one."""
    p1, p2 = pair
    name = "static-" + secrets.token_hex(3)
    old, new = "old-" + secrets.token_urlsafe(24), "new-" + secrets.token_urlsafe(24)
    p1.store.add_credential(name, "bearer", [ECHO], Secret(old.encode()))
    agent, token = _agent(pair, name)
    kept = [old, new]
    echo.values = lambda: kept
    for proxy in pair:  # each replica has stamped, and so redacts, the old value
        assert _get(proxy, agent, token, f"https://{ECHO}/kept").status_code == 200
    p2.store.rotate_credential(name, Secret(new.encode()))
    for proxy in pair:
        proxy.wait_reload(timeout=10)
    for proxy in pair:
        answer = _get(proxy, agent, token, f"https://{ECHO}/kept")
        assert answer.status_code == 200
        assert _clear(answer.text, kept) == [], f"in the clear through {proxy.home.name}"
