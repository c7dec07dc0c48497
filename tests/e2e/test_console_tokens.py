"""The console with `--console` alone: operators sign in with tokens `credproxy console token
add` issued, looked up in the store; an expired or revoked one opens nothing, and a session it
opened ends at its next request."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import trustme
from sqlalchemy import update
from sqlalchemy.orm import Session

from store.db.models import ConsoleToken, utcnow
from tests.e2e.conftest import CREDPROXY, NAMES, Proxy, _env, start_proxy, stop_proxy
from tests.e2e.test_console import browser, signed_in
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CREDPROXY, *args], env=_env(home), cwd=home, capture_output=True, text=True
    )


def issue(home: Path, operator: str) -> str:
    done = cli(home, "console", "token", "add", operator, "--json")
    assert done.returncode == 0, done.stderr
    token: str = json.loads(done.stdout)["token"]
    return token


@pytest.fixture(scope="module")
def tokens_proxy(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[tuple[Proxy, dict[str, str]]]:
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in NAMES if name != "localhost"]
    home = tmp_path_factory.mktemp("console-tokens")
    shutil.copytree(initialised_home, home, dirs_exist_ok=True)
    issued = {name: issue(home, name) for name in ("alice", "bob", "carol")}
    extra = ["--console", "127.0.0.1:0", "--allow-private", "127.0.0.0/8"]
    running = start_proxy(home, upstream_ca, resolve, extra)
    yield running, issued
    stop_proxy(running)


def _events(proxy: Proxy, event: str) -> list[dict[str, object]]:
    return [line for line in proxy.audit() if line.get("event") == event]


def test_a_token_the_cli_issued_signs_in(tokens_proxy: tuple[Proxy, dict[str, str]]) -> None:
    proxy, issued = tokens_proxy
    with signed_in(proxy, issued["alice"]) as (client, _):
        assert "signed in as <b>alice</b>" in client.get("/").text
    signed = _events(proxy, "console.signed_in")
    assert signed[-1]["operator"] == "alice" and signed[-1]["via"] == "store"
    assert not any(token in proxy.output() for token in issued.values())


def test_an_agents_principal_token_opens_nothing(
    tokens_proxy: tuple[Proxy, dict[str, str]], names
) -> None:
    proxy, _ = tokens_proxy
    token = proxy.store.add_principal(names("agent"))
    with browser(proxy) as client:
        assert client.post("/login", data={"token": token}).status_code == 401
        assert client.get("/panel").status_code == 401


def test_a_revoked_token_signs_its_sessions_out_and_opens_nothing(
    tokens_proxy: tuple[Proxy, dict[str, str]],
) -> None:
    proxy, issued = tokens_proxy
    with signed_in(proxy, issued["bob"]) as (client, _):
        assert client.get("/panel").status_code == 200
        done = cli(proxy.home, "console", "token", "revoke", "bob")
        assert (done.returncode, done.stdout) == (0, "revoked 1 console token(s) of bob\n")
        assert client.get("/panel").status_code == 401
        assert "name=token" in client.get("/").text  # the sign-in page again
    with browser(proxy) as client:
        assert client.post("/login", data={"token": issued["bob"]}).status_code == 401
    ended = _events(proxy, "console.signed_out")
    assert ended[-1] == ended[-1] | {"operator": "bob", "why": "token-ended"}


def test_an_expired_token_signs_its_sessions_out_and_opens_nothing(
    tokens_proxy: tuple[Proxy, dict[str, str]],
) -> None:
    proxy, issued = tokens_proxy
    with signed_in(proxy, issued["carol"]) as (client, _):
        assert client.get("/panel").status_code == 200
        with Session(proxy.store.engine) as session, session.begin():
            session.execute(
                update(ConsoleToken)
                .where(ConsoleToken.operator == "carol")
                .values(expires_at=utcnow() - timedelta(seconds=1))
            )
        assert client.get("/panel").status_code == 401
    with browser(proxy) as client:
        assert client.post("/login", data={"token": issued["carol"]}).status_code == 401


def test_the_console_alone_with_no_live_token_does_not_start(
    tmp_path: Path, initialised_home: Path
) -> None:
    shutil.copytree(initialised_home, tmp_path, dirs_exist_ok=True)
    done = cli(tmp_path, "run", "--listen", "127.0.0.1:0", "--console", "127.0.0.1:0")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "credproxy: error: --console: no live console token; run credproxy console token add "
        "NAME (or give --console-token-file)"
    ], done.stderr
