"""`credproxy exec --isolate`: the proxy is the only way out, and CMD holds no token."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import CREDPROXY, Proxy
from tests.e2e.test_exec import SECRET, Agent, credproxy, make_agent, stamped, tokens
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e


def _namespaces() -> str | None:
    """Why --isolate cannot work here, or None."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True, text=True
    )
    return None if done.returncode == 0 else f"no user+network namespaces: {done.stderr.strip()}"


WHY = _namespaces()
needs_namespaces = pytest.mark.skipif(
    WHY is not None and not os.environ.get("CI"), reason=WHY or ""
)


@pytest.fixture
def agent(proxy: Proxy, names) -> Agent:
    return make_agent(proxy, names)


def isolated(proxy: Proxy, agent: Agent, *command: str, **kw) -> subprocess.CompletedProcess[str]:
    return credproxy(
        proxy,
        "exec",
        "--isolate",
        "--principal",
        agent.name,
        "--proxy",
        f"127.0.0.1:{proxy.port}",
        "--",
        *command,
        **kw,
    )


@needs_namespaces
def test_curl_goes_through_the_proxy_and_holds_no_token(
    proxy: Proxy, upstream: Upstream, agent: Agent, tmp_path: Path
):
    env_file = tmp_path / "env"
    done = isolated(
        proxy, agent, "sh", "-c", f"env > {env_file}; curl -sS https://api.test/v1/isolated"
    )
    assert done.returncode == 0, done.stderr
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]
    inside = env_file.read_text()
    assert f"https_proxy=http://127.0.0.1:{proxy.port}\n" in inside
    assert "@" not in "".join(line for line in inside.splitlines() if "proxy" in line.lower())
    assert f"{agent.name}:" not in inside
    (entry,) = proxy.store.list_tokens(agent.name)
    assert entry.state == "revoked"


@needs_namespaces
def test_a_direct_connection_to_the_upstream_fails_and_the_proxy_reaches_it(
    proxy: Proxy, upstream: Upstream, agent: Agent
):
    script = f"""
import socket, urllib.request
try:
    socket.create_connection(("127.0.0.1", {upstream.port}), timeout=5)
    print("direct: reached")
except OSError as e:
    print("direct: failed")
try:
    socket.getaddrinfo("example.com", 443)
    print("dns: resolved")
except OSError:
    print("dns: failed")
print("proxy:", urllib.request.urlopen("https://api.test/v1/py").status)
"""
    done = isolated(proxy, agent, sys.executable, "-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["direct: failed", "dns: failed", "proxy: 200"]
    # The same server takes connections from outside: the namespace is what stopped it.
    socket.create_connection(("127.0.0.1", upstream.port), timeout=5).close()
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]


@needs_namespaces
def test_the_exit_status_passes_through_the_namespace(proxy: Proxy, agent: Agent):
    assert isolated(proxy, agent, "sh", "-c", "exit 9").returncode == 9
    assert isolated(proxy, agent, "sh", "-c", "kill -TERM $$").returncode == 128 + 15
    assert set(tokens(proxy, agent)) == {"revoked"}


@needs_namespaces
def test_java_httpclient_works_with_no_authenticator(
    proxy: Proxy, upstream: Upstream, agent: Agent, tmp_path: Path
):
    if shutil.which("java") is None or shutil.which("keytool") is None:
        pytest.skip("java and keytool are not installed")
    source = tmp_path / "Get.java"
    source.write_text(
        "import java.net.*; import java.net.http.*;\n"
        "public class Get { public static void main(String[] a) throws Exception {\n"
        "  var c = HttpClient.newBuilder().proxy(ProxySelector.getDefault()).build();\n"
        '  var r = c.send(HttpRequest.newBuilder(URI.create("https://api.test/v1/java")).build(),\n'
        "    HttpResponse.BodyHandlers.ofString());\n"
        "  System.out.println(r.statusCode()); } }\n"
    )
    done = isolated(proxy, agent, "java", str(source), timeout=300)
    assert done.stdout.strip().splitlines()[-1:] == ["200"], done.stderr
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]


def test_without_namespaces_isolate_refuses_and_never_runs_the_command(
    proxy: Proxy, agent: Agent, tmp_path: Path
):
    marker = tmp_path / "ran"
    empty = tmp_path / "bin"
    empty.mkdir()
    (empty / "unshare").write_text(
        "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n"
    )
    (empty / "unshare").chmod(0o755)
    path = f"{empty}:{os.environ['PATH']}"
    done = subprocess.run(
        [
            *CREDPROXY,
            "exec",
            "--isolate",
            "--principal",
            agent.name,
            "--proxy",
            f"127.0.0.1:{proxy.port}",
            "--",
            "touch",
            str(marker),
        ],
        env={**proxy.env, "PATH": path},
        cwd=proxy.home,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "cannot create namespaces" in done.stderr
    assert not marker.exists()
    assert tokens(proxy, agent) == []
