"""Behind a corporate proxy (`run --upstream-proxy`): a real squid on 127.0.0.1 with basic auth.

squid sees CONNECTs by name and bytes it cannot read; its refusals reach the agent as
credproxy's own reasons; a bypassed host never goes through it; a forbidden address is never
asked for; one-shot clients still share one upstream connection (one CONNECT).
Without squid the module skips, and fails under CI (.ci/run installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trustme

from store.crypto import Secret
from store.repository import Store
from tests.e2e.conftest import CREDPROXY, Proxy, _env, _load_key, start_proxy, stop_proxy
from tests.e2e.raw import connect, h2_get, proxy_auth
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SECRET = "sk-corp-" + os.urandom(8).hex()
PROXY_USER = "corp"
PROXY_PASSWORD = "pw-" + os.urandom(8).hex()
HELPER = Path("/usr/lib/squid/basic_ncsa_auth")


def _squid() -> str:
    found = shutil.which("squid") or shutil.which("squid", path="/usr/sbin:/sbin")
    why = None
    if found is None:
        why = "squid is not installed (apt-get install squid)"
    elif not HELPER.exists():
        why = f"squid's {HELPER} is missing"
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must install it (.ci/run)")
        pytest.skip(why)
    assert found is not None
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Squid:
    port: int
    folder: Path
    process: subprocess.Popen[bytes]
    denied_port: int  # CONNECTs to this port: 403
    strict_port: int  # CONNECTs to this port want another user: 407

    @property
    def access_log(self) -> Path:
        return self.folder / "access.log"

    def lines(self) -> list[list[str]]:
        """The access log's entries, each split into squid's native fields (time, elapsed,
        client, code/status, bytes, method, URL, user, hierarchy, type)."""
        text = self.access_log.read_text() if self.access_log.exists() else ""
        return [line.split() for line in text.splitlines() if line.strip()]

    def since(self, before: int, expected: int) -> list[list[str]]:
        """The entries after the first `before`, once `expected` are there or a tunnel parked
        by the proxy has surely closed (squid writes a CONNECT's line when it ends)."""
        deadline = time.monotonic() + IDLE + 2
        while True:
            found = self.lines()[before:]
            if (expected and len(found) >= expected) or time.monotonic() > deadline:
                time.sleep(0.2)  # and nothing more comes
                return self.lines()[before:]
            time.sleep(0.1)

    def everything(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.folder.glob("*.log"))


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _hashed(password: str) -> str:
    done = subprocess.run(
        ["openssl", "passwd", "-1", "-stdin"],  # the password on stdin, never on argv
        input=password.encode(),
        capture_output=True,
        check=True,
    )
    return done.stdout.decode().strip()


@pytest.fixture(scope="module")
def squid() -> Iterator[Squid]:
    binary = _squid()
    # squid runs as nobody when the tests run as root: pytest's folders are closed to it.
    folder = Path(tempfile.mkdtemp(prefix="squid-", dir="/var/tmp"))  # noqa: S108
    folder.chmod(0o777)
    port, denied, strict = _free_port(), _free_port(), _free_port()
    (folder / "passwd").write_text(f"{PROXY_USER}:{_hashed(PROXY_PASSWORD)}\n")
    (folder / "hosts").write_text("127.0.0.1 localhost\n")
    (folder / "squid.conf").write_text(
        f"""
http_port 127.0.0.1:{port}
pid_filename {folder}/squid.pid
cache_log {folder}/cache.log
access_log stdio:{folder}/access.log
cache deny all
cache_mem 8 MB
coredump_dir {folder}
hosts_file {folder}/hosts
auth_param basic program {HELPER} {folder}/passwd
auth_param basic children 1 startup=1 idle=1
auth_param basic realm corp
acl authed proxy_auth REQUIRED
acl someone_else proxy_auth nobody-we-know
acl CONNECT method CONNECT
acl denied_port port {denied}
acl strict_port port {strict}
http_access deny denied_port
http_access deny strict_port !someone_else
http_access allow CONNECT authed
http_access deny all
shutdown_lifetime 0 seconds
logfile_rotate 0
"""
    )
    for path in folder.iterdir():
        path.chmod(0o666)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    argv = [*(as_nobody if os.geteuid() == 0 else []), binary, "-N", "-f"]
    argv.append(str(folder / "squid.conf"))
    out = (folder / "squid.out").open("wb")
    process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while not _listening(port):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"squid did not start: {(folder / 'squid.out').read_text()}")
        time.sleep(0.1)
    yield Squid(port, folder, process, denied, strict)
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def upstream(ca: trustme.CA) -> Iterator[Upstream]:
    with Upstream(ca, ["localhost"]) as running:
        yield running


LOOPBACK = ["--allow-private", "127.0.0.1/32", "--allow-private", "::1/128"]
IDLE = 1.0  # --upstream-idle: a parked connection, and so squid's tunnel, ends this soon


def _start(home: Path, ca: trustme.CA, squid: Squid, *extra: str) -> Proxy:
    home.mkdir(exist_ok=True)
    flags = ["--upstream-proxy", f"http://127.0.0.1:{squid.port}", *LOOPBACK, *extra]
    flags += ["--upstream-idle", str(IDLE)]
    return start_proxy(home, ca, [], extra=flags)


@pytest.fixture(scope="module")
def proxy(
    tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, squid: Squid
) -> Iterator[Proxy]:
    home = tmp_path_factory.mktemp("corp")
    running = _credential_first(home, ca, squid)
    yield running
    stop_proxy(running)


def _credential_first(home: Path, ca: trustme.CA, squid: Squid) -> Proxy:
    """The proxy's credential is stored before the proxy starts (it checks it at start)."""
    env = _env(home)
    subprocess.run([*CREDPROXY, "init"], env=env, cwd=home, check=True, capture_output=True)
    store = Store(env["CREDPROXY_DB"], _load_key(home))
    try:
        store.add_credential(
            "corp-proxy",
            "basic",
            [f"127.0.0.1:{squid.port}"],
            Secret(f"{PROXY_USER}:{PROXY_PASSWORD}".encode()),
        )
    finally:
        store.close()
    return _start(home, ca, squid, "--upstream-proxy-credential", "corp-proxy")


_n = iter(range(10**6))


def _agent(proxy: Proxy, hosts: list[str]) -> tuple[str, str]:
    n = next(_n)
    agent, cred = f"agent-{n}", f"api-{n}"
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", hosts, Secret(SECRET.encode()))
    proxy.store.add_grant(agent, ["GET"], credential=cred, hosts=hosts, paths=["/"])
    proxy.wait_reload()
    return agent, token


def _get(proxy: Proxy, who: tuple[str, str], url: str) -> httpx.Response:
    """One request on a new client connection (curl per tool call)."""
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    with httpx.Client(proxy=proxy.url(*who), verify=context, timeout=15) as client:
        reply = client.get(url)
        reply.read()
        return reply


def _settle() -> None:
    time.sleep(0.15)  # the proxy parks a connection once it has seen its client go


def test_stamped_requests_pass_and_squid_sees_only_connects_by_name(
    proxy: Proxy, squid: Squid, upstream: Upstream
) -> None:
    host = f"localhost:{upstream.port}"
    who = _agent(proxy, [host])
    before = len(squid.lines())
    upstream.log.clear()
    reply = _get(proxy, who, f"https://{host}/v1/private/path?q=1")
    assert reply.status_code == 200
    assert reply.json()["path"] == "/v1/private/path?q=1"
    # The origin got the secret, over TLS verified for its name.
    assert upstream.log.requests[-1].header("authorization") == [f"Bearer {SECRET}"]
    assert upstream.log.snis == ["localhost"]
    lines = squid.since(before, 1)
    assert [(f[3], f[5], f[6], f[7]) for f in lines] == [
        ("TCP_TUNNEL/200", "CONNECT", host, PROXY_USER)
    ]
    # Nothing squid wrote down holds the secret, the path or the query.
    written = squid.everything()
    assert SECRET not in written
    assert "/v1/private" not in written and "q=1" not in written
    # The corporate proxy's password is in no audit line.
    assert PROXY_PASSWORD not in proxy.output()
    assert SECRET not in proxy.output()


def test_one_shot_clients_share_one_connect(proxy: Proxy, squid: Squid, upstream: Upstream) -> None:
    host = f"localhost:{upstream.port}"
    who = _agent(proxy, [host])
    before = len(squid.lines())
    upstream.log.clear()
    for i in range(3):
        assert _get(proxy, who, f"https://{host}/v1/{i}").status_code == 200
        _settle()
    assert upstream.log.connections == 1
    assert len(upstream.log.requests) == 3
    lines = squid.since(before, 0)  # all the time a parked tunnel takes to end
    assert [(f[5], f[6]) for f in lines] == [("CONNECT", host)]


def test_http2_clients_go_through_the_corporate_proxy_too(
    proxy: Proxy, squid: Squid, upstream: Upstream
) -> None:
    """mitmproxy's own upstream connections (an HTTP/2 client's) are tunnelled as well."""
    host = f"localhost:{upstream.port}"
    who = _agent(proxy, [host])
    before = len(squid.lines())
    upstream.log.clear()
    sock, answer = connect(proxy.port, host, proxy_auth(*who))
    assert answer.status == 200
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    context.set_alpn_protocols(["h2"])
    with context.wrap_socket(sock, server_hostname="localhost") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        reply = h2_get(tls, host, "/v1/h2")
    assert reply.status == 200
    assert upstream.log.requests[-1].header("authorization") == [f"Bearer {SECRET}"]
    lines = squid.since(before, 1)
    assert [(f[3], f[5], f[6]) for f in lines] == [("TCP_TUNNEL/200", "CONNECT", host)]


@pytest.mark.parametrize(
    ("port", "reason", "error"),
    [
        pytest.param("denied", "upstream-proxy-refused", "proxy-denied", id="a 403 of squid's"),
        pytest.param("strict", "upstream-proxy-auth", "proxy-auth-required", id="a 407 of squid's"),
        pytest.param(
            "closed",
            "upstream-proxy-refused",
            "proxy-upstream-failed",
            id="squid cannot reach the host (503)",
        ),
    ],
)
def test_refusals_of_the_corporate_proxy_are_credproxys_own(
    proxy: Proxy, squid: Squid, port: str, reason: str, error: str
) -> None:
    number = {"denied": squid.denied_port, "strict": squid.strict_port}.get(port) or _free_port()
    host = f"localhost:{number}"
    who = _agent(proxy, [host])
    reply = _get(proxy, who, f"https://{host}/v1/x")
    assert reply.status_code == 502
    assert reply.headers["x-credproxy-reason"] == reason
    body = reply.json()
    assert body["reason"] == reason and body["error"] == "upstream-failed"
    assert "squid" not in reply.text.lower() and "<html" not in reply.text.lower()
    line = proxy.requests(who[0])[-1]
    assert line["reason"] == reason
    assert line["decision"] == "error"
    assert line.get("error") == error


def test_the_corporate_proxys_credential_is_never_sent_elsewhere(
    proxy: Proxy, upstream: Upstream
) -> None:
    host = f"localhost:{upstream.port}"
    who = _agent(proxy, [host])
    upstream.log.clear()
    assert _get(proxy, who, f"https://{host}/v1/x").status_code == 200
    sent = json.dumps([r.headers for r in upstream.log.requests])
    assert "Proxy-Authorization".lower() not in sent.lower()
    assert PROXY_PASSWORD not in sent


def test_a_forbidden_address_is_refused_without_asking_the_corporate_proxy(
    proxy: Proxy, squid: Squid, upstream: Upstream
) -> None:
    host = f"127.0.0.2:{upstream.port}"  # loopback, but not opened by --allow-private
    who = _agent(proxy, [host])
    before = len(squid.lines())
    reply = _get(proxy, who, f"https://{host}/v1/x")
    assert reply.status_code == 403
    assert reply.headers["x-credproxy-reason"] == "destination-forbidden"
    assert [f for f in squid.since(before, 0) if "127.0.0.2" in f[6]] == []


def test_a_bypassed_host_does_not_go_through_the_corporate_proxy(
    tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, squid: Squid, upstream: Upstream
) -> None:
    direct = _start(
        tmp_path_factory.mktemp("bypass"), ca, squid, "--upstream-proxy-bypass", "localhost"
    )
    try:
        host = f"localhost:{upstream.port}"
        who = _agent(direct, [host])
        time.sleep(IDLE + 0.5)  # the other proxy's parked tunnels have ended
        before = len(squid.lines())
        upstream.log.clear()
        assert _get(direct, who, f"https://{host}/v1/direct").status_code == 200
        assert upstream.log.requests[-1].header("authorization") == [f"Bearer {SECRET}"]
        assert squid.since(before, 0) == []
    finally:
        stop_proxy(direct)


def test_without_the_proxys_credential_squid_answers_407_and_the_agent_reads_a_reason(
    tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, squid: Squid, upstream: Upstream
) -> None:
    anonymous = _start(tmp_path_factory.mktemp("anonymous"), ca, squid)
    try:
        host = f"localhost:{upstream.port}"
        who = _agent(anonymous, [host])
        reply = _get(anonymous, who, f"https://{host}/v1/x")
        assert reply.status_code == 502
        assert reply.headers["x-credproxy-reason"] == "upstream-proxy-auth"
        assert "proxy-authenticate" not in reply.headers
    finally:
        stop_proxy(anonymous)


def test_a_credential_not_bound_to_the_proxy_stops_the_start(
    tmp_path_factory: pytest.TempPathFactory, squid: Squid
) -> None:
    home = tmp_path_factory.mktemp("unbound")
    env = _env(home)
    subprocess.run([*CREDPROXY, "init"], env=env, cwd=home, check=True, capture_output=True)
    store = Store(env["CREDPROXY_DB"], _load_key(home))
    try:  # bound to the proxy and to another host: a grant could stamp it there
        hosts = [f"127.0.0.1:{squid.port}", "api.example.com"]
        store.add_credential(
            "corp-proxy", "basic", hosts, Secret(b"corp:" + PROXY_PASSWORD.encode())
        )
    finally:
        store.close()
    done = subprocess.run(
        [*CREDPROXY, "run", "--listen", "127.0.0.1:0"]
        + ["--upstream-proxy", f"http://127.0.0.1:{squid.port}"]
        + ["--upstream-proxy-credential", "corp-proxy"],
        env=env,
        cwd=home,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--upstream-proxy-credential corp-proxy" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert PROXY_PASSWORD not in done.stderr + done.stdout


# -- credproxy's own calls: token endpoints ------------------------------------------------

MINTED = "minted-" + os.urandom(8).hex()


def _token_endpoint(received) -> tuple[int, list[tuple[str, str]], bytes] | None:
    """An OAuth 2 token endpoint on the same upstream: any client gets MINTED."""
    if received.method != "POST" or received.target != "/oauth/token":
        return None
    body = {"access_token": MINTED, "token_type": "Bearer", "expires_in": 3600}
    return 200, [("content-type", "application/json")], json.dumps(body).encode()


@pytest.fixture(scope="module")
def oauth(ca: trustme.CA) -> Iterator[Upstream]:
    with Upstream(ca, ["localhost"], app=_token_endpoint) as running:
        yield running


def test_a_token_endpoint_is_reached_through_the_corporate_proxy(
    proxy: Proxy, squid: Squid, oauth: Upstream
) -> None:
    """A minted credential's token is fetched through squid too: behind a corporate proxy
    nothing else leads out."""
    host = f"localhost:{oauth.port}"
    n = next(_n)
    agent, cred = f"minter-{n}", f"oauth-{n}"
    token = proxy.store.add_principal(agent)
    client = {"client_id": "corp-client", "client_secret": "cs-" + os.urandom(8).hex()}
    done = subprocess.run(
        [*CREDPROXY, "credential", "add", cred, "--scheme", "oauth2-client", "--host", host,
         "--token-url", f"https://{host}/oauth/token"],
        input=json.dumps(client).encode(), env=proxy.env, cwd=proxy.home,
        capture_output=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    proxy.store.add_grant(agent, ["GET"], credential=cred, hosts=[host], paths=["/"])
    proxy.wait_reload()
    before = len(squid.lines())
    oauth.log.clear()
    reply = _get(proxy, (agent, token), f"https://{host}/v1/minted")
    assert reply.status_code == 200
    token_calls = [r for r in oauth.log.requests if r.target == "/oauth/token"]
    [api_call] = [r for r in oauth.log.requests if r.target == "/v1/minted"]
    assert len(token_calls) == 1 and api_call.header("authorization") == [f"Bearer {MINTED}"]
    # Two tunnels by name through squid: the token endpoint's and the request's.
    lines = squid.since(before, 2)
    assert [(f[5], f[6], f[7]) for f in lines] == [("CONNECT", host, PROXY_USER)] * 2
    assert client["client_secret"] not in squid.everything()
