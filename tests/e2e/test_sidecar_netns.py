"""The compose sidecar topology with network namespaces: the sandbox's only way out is the proxy."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import trustme

from store.crypto import Secret
from tests.e2e import netns
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SECRET = "sk-sidecar-" + os.urandom(8).hex()


def make_sandbox() -> netns.Sandbox:
    """A new sandbox, or a skip saying why there can be none (a failure under CI)."""
    try:
        return netns.create()
    except netns.Unavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must be able to create network namespaces: {e}")
        pytest.skip(f"network namespaces unavailable: {e}")


@pytest.fixture(scope="module")
def sandbox() -> Iterator[netns.Sandbox]:
    box = make_sandbox()
    try:
        yield box
    finally:
        box.destroy()


@pytest.fixture(scope="module")
def sidecar(
    tmp_path_factory: pytest.TempPathFactory,
    sandbox: netns.Sandbox,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    """credproxy on the host end of the veth; the upstream stays on the host's loopback."""
    resolve = [f"{name}=127.0.0.1:{shared_upstream.port}" for name in ("api.test", "other.test")]
    home = tmp_path_factory.mktemp("sidecar")
    # argparse keeps the last --listen, so this one replaces start_proxy's 127.0.0.1:0.
    extra = ["--listen", f"{sandbox.host_ip}:0"]
    running = start_proxy(home, upstream_ca, resolve, extra=extra, template=initialised_home)
    try:
        yield running
    finally:
        stop_proxy(running)


@pytest.fixture
def agent(sidecar: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    """A principal granted GET /v1/ on api.test with a bearer credential; (name, token)."""
    name, cred = names("sbx-agent"), names("sbx-cred")
    token = sidecar.store.add_principal(name)
    sidecar.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET.encode()))
    sidecar.store.add_grant(name, ["GET"], credential=cred, paths=["/v1/"])
    sidecar.wait_reload()
    return name, token


def curl(
    box: netns.Sandbox, *args: str, proxy: str | None = None
) -> subprocess.CompletedProcess[str]:
    """curl inside the sandbox; the environment holds PATH and, if given, HTTPS_PROXY only."""
    env = {"PATH": os.environ["PATH"]}
    if proxy is not None:
        env["HTTPS_PROXY"] = proxy
    return box.exec(["curl", "--silent", "--show-error", "--max-time", "10", *args], env=env)


def proxy_url(box: netns.Sandbox, proxy: Proxy, agent: tuple[str, str]) -> str:
    name, token = agent
    return f"http://{quote(name, safe='')}:{quote(token, safe='')}@{box.host_ip}:{proxy.port}"


def test_the_sandbox_has_only_its_veth_and_no_route_out(sandbox: netns.Sandbox) -> None:
    addresses = netns.ip("-n", sandbox.name, "-o", "addr", "show").splitlines()
    assert sorted(line.split()[1:4] for line in addresses) == [
        ["eth0", "inet", f"{sandbox.sandbox_ip}/{sandbox.prefixlen}"],
        ["lo", "inet", "127.0.0.1/8"],
        ["lo", "inet6", "::1/128"],
    ]
    routes = netns.ip("-n", sandbox.name, "route", "show").splitlines()
    assert [route.split()[1:3] for route in routes] == [["dev", "eth0"]]
    assert netns.ip("-n", sandbox.name, "-6", "route", "show", "default") == ""


def test_the_proxy_stamps_the_credential_for_the_sandbox(
    sandbox: netns.Sandbox, sidecar: Proxy, upstream: Upstream, agent: tuple[str, str]
) -> None:
    reply = curl(
        sandbox,
        "--cacert",
        str(sidecar.ca_file),
        "--header",
        "Authorization: Bearer placeholder",
        "--write-out",
        "\n%{http_code}",
        "https://api.test/v1/items?page=2",
        proxy=proxy_url(sandbox, sidecar, agent),
    )
    assert reply.returncode == 0, reply.stderr
    assert reply.stdout.rsplit("\n", 1)[1] == "200"
    assert SECRET not in reply.stdout
    [received] = upstream.log.requests
    assert received.header("authorization") == [f"Bearer {SECRET}"]
    assert received.header("proxy-authorization") == []
    assert received.target == "/v1/items?page=2"
    assert received.sni == "api.test"
    [line] = [r for r in sidecar.requests(agent[0]) if r["method"] == "GET"]
    assert line["decision"] == "allow"
    assert line["client"].rsplit(":", 1)[0] == sandbox.sandbox_ip


@pytest.mark.parametrize(
    "target",
    [
        pytest.param("loopback", id="the sandbox's 127.0.0.1 is its own, not the host's"),
        pytest.param("host", id="the upstream does not listen on the host's veth address"),
        pytest.param("outside", id="no route out of the sandbox at all"),
    ],
)
def test_the_sandbox_cannot_reach_the_upstream_directly(
    sandbox: netns.Sandbox, upstream: Upstream, target: str
) -> None:
    address = {
        "loopback": "127.0.0.1",
        "host": sandbox.host_ip,
        "outside": "203.0.113.1",  # TEST-NET-3: never routed anywhere real
    }[target]
    reply = curl(
        sandbox,
        "--noproxy",
        "*",
        "--insecure",
        "--connect-timeout",
        "3",
        f"https://{address}:{upstream.port}/v1/items",
    )
    # 7: curl could not connect at all (refused or unreachable), not a TLS or HTTP error.
    assert reply.returncode == 7, (reply.returncode, reply.stderr)
    assert upstream.log.connections == 0


def test_an_ungranted_host_is_refused_at_connect(
    sandbox: netns.Sandbox, sidecar: Proxy, upstream: Upstream, agent: tuple[str, str]
) -> None:
    reply = curl(
        sandbox,
        "--cacert",
        str(sidecar.ca_file),
        "--output",
        "/dev/null",
        "--write-out",
        "%{http_connect}",
        "https://other.test/v1/items",
        proxy=proxy_url(sandbox, sidecar, agent),
    )
    # 56: curl's "CONNECT tunnel failed"; other.test resolves, only the grant is missing.
    assert reply.returncode == 56, (reply.returncode, reply.stderr)
    assert reply.stdout == "403"
    assert upstream.log.connections == 0
    [line] = sidecar.requests(agent[0])
    assert (line["decision"], line["reason"], line["host"]) == ("deny", "no-grant", "other.test")


def test_teardown_leaves_no_namespace_or_veth() -> None:
    box = make_sandbox()
    box.destroy()
    assert not (netns.NETNS_DIR / box.name).exists()
    assert not Path("/sys/class/net", box.host_veth).exists()
    assert box.name not in netns.ip("netns", "list")


def test_namespaces_of_dead_runs_are_removed(sandbox: netns.Sandbox) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"{netns.PREFIX}{gone.pid}-0"
    netns.ip("netns", "add", stale)
    try:
        assert stale in netns.remove_stale()
    finally:
        if (netns.NETNS_DIR / stale).exists():
            netns.ip("netns", "del", stale)
    assert (netns.NETNS_DIR / sandbox.name).exists(), "a live run's namespace was removed"
