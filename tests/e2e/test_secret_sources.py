"""A credential whose secret is a mounted Kubernetes Secret (a file behind kubelet's `..data`
symlink), or a secret in AWS Secrets Manager (moto's real HTTP server, boto3 in the proxy),
through `credproxy credential add --secret-ref` and a real `credproxy run`: the value stamped,
a rotation stamped (within about a second; within the TTL), a deleted file or an unreachable
backend stale, then refused."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import trustme
from moto.server import ThreadedMotoServer

from tests.e2e.conftest import CREDPROXY, Proxy, start_proxy, stop_proxy
from tests.e2e.upstream import Upstream
from tests.proxy.test_sources import Kubelet

pytestmark = pytest.mark.e2e
MAX_STALE = 1.5


@pytest.fixture(scope="module")
def held_proxy(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    home = tmp_path_factory.mktemp("held")
    running = start_proxy(
        home,
        upstream_ca,
        [f"api.test=127.0.0.1:{shared_upstream.port}"],
        ["--secret-max-stale", str(MAX_STALE), "--admin", "127.0.0.1:0"],
        template=initialised_home,
    )
    yield running
    stop_proxy(running)


def _cli(proxy: Proxy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CREDPROXY, *args],
        env=proxy.env,
        cwd=proxy.home,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=30,
    )


def _source_states(proxy: Proxy) -> dict[str, float]:
    """credproxy_secret_sources{state} from /metrics."""
    [started] = [line for line in proxy.audit() if line.get("event") == "proxy.started"]
    metrics = httpx.get(f"http://{started['admin'][0]}/metrics", timeout=5).text
    found = re.findall(r'^credproxy_secret_sources\{state="(\w+)"\} (\S+)$', metrics, re.M)
    assert {state for state, _ in found} == {"ok", "stale", "failing"}
    return {state: float(value) for state, value in found}


def _listed(proxy: Proxy, name: str) -> list[dict[str, Any]]:
    listed = _cli(proxy, "credential", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return [row for row in json.loads(listed.stdout) if row["name"] == name]


def _stamped(proxy: Proxy, upstream: Upstream, agent: str, token: str) -> tuple[int, str]:
    upstream.log.clear()
    with proxy.client(agent, token) as client:
        reply = client.get("https://api.test/v1/items")
    sent = [r.header("authorization") for r in upstream.log.requests]
    return reply.status_code, (sent[0][0] if sent and sent[0] else reply.text)


def test_a_mounted_secret_is_stamped_rotated_and_refused_once_gone_for_max_stale(
    held_proxy: Proxy, upstream: Upstream, tmp_path: Path
) -> None:
    before = _source_states(held_proxy)
    (tmp_path / "gh").mkdir()
    mounted = Kubelet(tmp_path / "gh")
    added = _cli(
        held_proxy,
        *("credential", "add", "gh", "--scheme", "bearer", "--host", "api.test"),
        *("--secret-ref", f"file:{mounted.path}"),
    )
    assert added.returncode == 0, added.stderr
    token = held_proxy.store.add_principal("agent")
    held_proxy.store.add_grant("agent", ["GET"], credential="gh")
    held_proxy.wait_reload()
    assert _stamped(held_proxy, upstream, "agent", token) == (200, "Bearer gh-secret-one")

    assert _source_states(held_proxy) == before | {"ok": before["ok"] + 1}
    (row,) = _listed(held_proxy, "gh")
    assert (row["secret_ref"], row["source_state"]) == (f"file:{mounted.path}", "ok")
    first_fp = row["fingerprint"]

    mounted.write(b"gh-secret-two\n")
    rotated_at = time.monotonic()
    while _stamped(held_proxy, upstream, "agent", token) != (200, "Bearer gh-secret-two"):
        assert time.monotonic() - rotated_at < 3.0, "the rotation was not stamped in time"
        time.sleep(0.1)
    rotated = [line for line in held_proxy.audit() if line.get("event") == "credential.rotated"]
    assert [(r["credential"], r["old_fp"], r["new_fp"]) for r in rotated] == [
        ("gh", first_fp, _listed(held_proxy, "gh")[0]["fingerprint"])
    ]
    assert rotated[0]["old_fp"] != rotated[0]["new_fp"]

    os.unlink(mounted.root / "..data")  # the Secret deleted: the key's link dangles
    gone_at = time.monotonic()
    statuses = []
    while not statuses or statuses[-1][0] == 200:
        statuses.append(_stamped(held_proxy, upstream, "agent", token))
        assert time.monotonic() - gone_at < MAX_STALE + 3.0, "never refused"
        time.sleep(0.1)
    assert time.monotonic() - gone_at >= MAX_STALE - 0.2  # the last good value served meanwhile
    assert {s for s in statuses[:-1]} <= {(200, "Bearer gh-secret-two")}
    assert statuses[-1][0] == 502 and "credentials-unavailable" in statuses[-1][1]
    # /readyz names the failing reference; the proxy stays ready for the other credentials.
    [started] = [line for line in held_proxy.audit() if line.get("event") == "proxy.started"]
    readyz = httpx.get(f"http://{started['admin'][0]}/readyz", timeout=5)
    assert readyz.status_code == 200
    assert readyz.json()["secret_sources_failing"] == ["gh"]
    assert _source_states(held_proxy) == before | {"failing": before["failing"] + 1}
    output = held_proxy.output()
    assert "gh-secret-one" not in output and "gh-secret-two" not in output


def test_a_reference_that_does_not_parse_is_one_line_and_status_2(held_proxy: Proxy) -> None:
    refused = _cli(
        held_proxy,
        *("credential", "add", "bad", "--scheme", "bearer", "--host", "api.test"),
        *("--secret-ref", "ghp_pastedSECRETvalue"),
    )
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "pastedSECRETvalue" not in refused.stderr + refused.stdout


def test_run_refuses_to_start_with_an_unreadable_reference_only_when_told(
    held_proxy: Proxy, tmp_path: Path
) -> None:
    """The held proxy started, and serves, with a reference it could not read (the other
    tests add theirs later); --require-all-secrets does not start."""
    added = _cli(
        held_proxy,
        *("credential", "add", "missing", "--scheme", "bearer", "--host", "api.test"),
        *("--secret-ref", f"file:{tmp_path}/absent"),
    )
    assert added.returncode == 0, added.stderr
    refused = _cli(held_proxy, "run", "--listen", "127.0.0.1:0", "--require-all-secrets")
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert "secrets that cannot be read:" in line and "missing" in line
    assert "secret_source.unresolved" in refused.stdout + refused.stderr


# -- AWS Secrets Manager: moto's real HTTP server, boto3 in the proxy --------------------------


def test_a_secret_in_aws_secrets_manager_is_stamped_rotated_and_refused_once_unreachable(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = _free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    endpoint = f"http://127.0.0.1:{port}"
    httpx.post(f"{endpoint}/moto-api/reset")
    # The proxy's own AWS identity comes from its environment, as boto3 reads it.
    for name, value in {
        "AWS_ENDPOINT_URL_SECRETS_MANAGER": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    aws = boto3.client("secretsmanager", endpoint_url=endpoint, region_name="us-east-1")
    aws.create_secret(Name="agents/gh", SecretString=json.dumps({"token": "aws-secret-one"}))
    proxy = start_proxy(
        tmp_path_factory.mktemp("aws"),
        upstream_ca,
        [f"api.test=127.0.0.1:{shared_upstream.port}"],
        ["--secret-ttl", "0.5", "--secret-max-stale", str(MAX_STALE)],
        template=initialised_home,
    )
    try:
        added = _cli(
            proxy,
            *("credential", "add", "gh", "--scheme", "bearer", "--host", "api.test"),
            *("--secret-ref", "aws-sm:agents/gh#token"),
        )
        assert added.returncode == 0, added.stderr
        token = proxy.store.add_principal("agent")
        proxy.store.add_grant("agent", ["GET"], credential="gh")
        proxy.wait_reload()
        deadline = time.monotonic() + 8
        while _stamped(proxy, shared_upstream, "agent", token) != (200, "Bearer aws-secret-one"):
            assert time.monotonic() < deadline, "the secret was never stamped"
            time.sleep(0.1)

        aws.put_secret_value(SecretId="agents/gh", SecretString='{"token": "aws-secret-two"}')
        deadline = time.monotonic() + 5
        while _stamped(proxy, shared_upstream, "agent", token) != (200, "Bearer aws-secret-two"):
            assert time.monotonic() < deadline, "the rotation was not stamped within the TTL"
            time.sleep(0.1)

        moto.stop()  # an outage: the last value serves for max-stale, then refused
        deadline = time.monotonic() + MAX_STALE + 6
        while (found := _stamped(proxy, shared_upstream, "agent", token))[0] == 200:
            assert found == (200, "Bearer aws-secret-two")
            assert time.monotonic() < deadline, "never refused"
            time.sleep(0.1)
        assert found[0] == 502 and "credentials-unavailable" in found[1]
        output = proxy.output()
        assert "aws-secret-one" not in output and "aws-secret-two" not in output
        rotated = [line for line in proxy.audit() if line.get("event") == "credential.rotated"]
        assert [line["credential"] for line in rotated] == ["gh"]
    finally:
        stop_proxy(proxy)
        moto.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
