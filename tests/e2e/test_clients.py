"""Real package clients through the real proxy: npm (a scoped package), uv (a simple index it
probes with HEAD) and git (smart HTTP), each against a local HTTPS service behind --resolve
that demands the credential credproxy stamps.

A client that is not installed skips its test; with CI set, it fails instead (.ci/run installs
git and npm, and uv comes with the test extra).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from store.crypto import Secret
from tests.e2e.conftest import CREDPROXY, Proxy, start_proxy, stop_proxy
from tests.e2e.registries import (
    GIT_HOST,
    HOSTS,
    INDEX_PATH,
    NPM_HOST,
    PACKUMENT_PATH,
    PYPI_HOST,
    REPO,
    TARBALL_PATH,
    WHEEL_PATH,
    Registries,
    basic,
    make_git_repo,
)
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SECRET = "sk-client-" + os.urandom(8).hex()
# Every client run is bounded; a hung client fails its test instead of the suite.
CLIENT_TIMEOUT = 120


def need(binary: str, how: str, *also: Path) -> str:
    """The client's path; skip without it, or fail under CI, which must install it."""
    found = next((str(p) for p in also if p.is_file()), None) or shutil.which(binary)
    if found is None:
        message = f"{binary} is not installed ({how})"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must install it")
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, upstream_ca: trustme.CA, initialised_home: Path
) -> Iterator[tuple[Proxy, Upstream, str]]:
    """A proxy whose --resolve sends the three registry names to one local Upstream."""
    root = tmp_path_factory.mktemp("registries")
    commit = make_git_repo(root) if shutil.which("git") else ""
    apps = Registries(
        npm_auth=f"Bearer {SECRET}",
        pypi_auth=basic(f"__token__:{SECRET}"),
        git_auth=basic(f"git:{SECRET}"),
        git_root=root,
    )
    with Upstream(upstream_ca, HOSTS, app=apps) as upstream:
        resolve = [f"{name}=127.0.0.1:{upstream.port}" for name in HOSTS]
        home = tmp_path_factory.mktemp("proxy-clients")
        proxy = start_proxy(home, upstream_ca, resolve, template=initialised_home)
        try:
            yield proxy, upstream, commit
        finally:
            stop_proxy(proxy)


def principal(proxy: Proxy, names: Any, host: str, scheme: str, secret: str) -> tuple[str, str]:
    agent, cred = names("agent"), names("cred")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, scheme, [host], Secret(secret.encode()))
    return agent, token


def client_env(proxy: Proxy, agent: str, token: str, home: Path, **extra: str) -> dict[str, str]:
    """What a sandbox has: the proxy variables, the CA, and nothing of the developer's."""
    home.mkdir(exist_ok=True)
    url = proxy.url(agent, token)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HTTPS_PROXY": url,
        "https_proxy": url,
        "NO_PROXY": "",
        "no_proxy": "",
        **extra,
    }


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args, env=env, cwd=cwd, capture_output=True, text=True, timeout=CLIENT_TIMEOUT
    )
    assert SECRET not in result.stdout + result.stderr
    return result


def denials(proxy: Proxy, agent: str) -> list[dict[str, Any]]:
    return [line for line in proxy.requests(agent) if line["decision"] != "allow"]


def asked(proxy: Proxy, agent: str) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in proxy.store.list_access_requests() if r.principal == agent]


# -- npm: a scoped package, whose name npm sends as @scope%2fname ---------------------------


def npm_install(
    proxy: Proxy, agent: str, token: str, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    npm = need("npm", "Debian: apt-get install npm")
    project = tmp_path / "project"
    project.mkdir()
    env = client_env(
        proxy,
        agent,
        token,
        tmp_path / "home",
        NPM_CONFIG_CAFILE=str(proxy.ca_file),
        NPM_CONFIG_REGISTRY=f"https://{NPM_HOST}/",
        NPM_CONFIG_CACHE=str(tmp_path / "npm-cache"),
        NPM_CONFIG_UPDATE_NOTIFIER="false",
        NPM_CONFIG_FUND="false",
        # npm's audit is a POST to /-/npm/v1/security/advisories/bulk: not granted here.
        NPM_CONFIG_AUDIT="false",
        NPM_CONFIG_FETCH_RETRIES="0",
    )
    return run(
        [npm, "install", "--no-package-lock", "--ignore-scripts", "@scope/name"], env, project
    )


def grant_cli(proxy: Proxy, *args: str) -> None:
    subprocess.run(
        [*CREDPROXY, "grant", "add", *args],
        env=proxy.env,
        cwd=proxy.home,
        check=True,
        capture_output=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "paths",
    [
        pytest.param(("--path", "/@scope%2fname", "--path", "/@scope/name/-/"), id="literal %2F"),
        pytest.param(("--path", "/*", "--encoded-slash"), id="a star opted in to %2F"),
    ],
)
def test_npm_installs_a_scoped_package(
    served: tuple[Proxy, Upstream, str], names: Any, tmp_path: Path, paths: tuple[str, ...]
) -> None:
    proxy, upstream, _ = served
    agent, token = principal(proxy, names, NPM_HOST, "bearer", SECRET)
    grant_cli(proxy, agent, "--credential", names("cred"), "--method", "GET", *paths)
    proxy.wait_reload()
    upstream.log.clear()
    result = npm_install(proxy, agent, token, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    installed = tmp_path / "project" / "node_modules" / "@scope" / "name" / "index.js"
    assert installed.read_text() == "module.exports = 42;\n"
    targets = [(r.method, r.target) for r in upstream.log.requests]
    # The escape arrives encoded, byte for byte as matched (upper-cased), never as a slash.
    assert ("GET", PACKUMENT_PATH) in targets and ("GET", TARBALL_PATH) in targets
    assert all(r.header("authorization") == [f"Bearer {SECRET}"] for r in upstream.log.requests)
    assert denials(proxy, agent) == []


def test_npm_is_refused_a_scoped_package_by_a_star_that_did_not_opt_in(
    served: tuple[Proxy, Upstream, str], names: Any, tmp_path: Path
) -> None:
    proxy, upstream, _ = served
    agent, token = principal(proxy, names, NPM_HOST, "bearer", SECRET)
    proxy.store.add_grant(agent, ["GET"], credential=names("cred"), paths=["/*"])
    proxy.wait_reload()
    upstream.log.clear()
    result = npm_install(proxy, agent, token, tmp_path)
    assert result.returncode != 0
    assert "E403" in result.stdout + result.stderr
    assert upstream.log.requests == []
    refused = {(line["method"], line["path"], line["reason"]) for line in denials(proxy, agent)}
    assert refused == {("GET", PACKUMENT_PATH, "path-not-allowed")}


# -- uv: a private simple index; the wheel is probed with HEAD before it is fetched ----------


def test_uv_installs_from_a_private_index_with_a_get_only_grant(
    served: tuple[Proxy, Upstream, str], names: Any, tmp_path: Path
) -> None:
    uv = need("uv", "pip install uv (the test extra)", Path(sys.executable).parent / "uv")
    proxy, upstream, _ = served
    agent, token = principal(proxy, names, PYPI_HOST, "basic", f"__token__:{SECRET}")
    proxy.store.add_grant(agent, ["GET"], credential=names("cred"), paths=["/simple/", "/files/"])
    proxy.wait_reload()
    upstream.log.clear()
    env = client_env(
        proxy,
        agent,
        token,
        tmp_path / "home",
        SSL_CERT_FILE=str(proxy.ca_file),
        UV_NO_CONFIG="1",
        UV_PYTHON_DOWNLOADS="never",
        UV_CACHE_DIR=str(tmp_path / "uv-cache"),
    )
    target = tmp_path / "site"
    result = run(
        [
            uv, "pip", "install", "--no-cache", "--python", sys.executable,
            "--target", str(target), "--index-url", f"https://{PYPI_HOST}/simple/", "tinypkg",
        ],
        env,
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (target / "tinypkg" / "__init__.py").read_text() == "VALUE = 42\n"
    methods = [(r.method, r.target) for r in upstream.log.requests]
    assert ("GET", INDEX_PATH) in methods
    assert ("HEAD", WHEEL_PATH) in methods and ("GET", WHEEL_PATH) in methods
    # The HEAD probe was allowed by the GET grant: no deny line, no access request.
    assert denials(proxy, agent) == []
    assert asked(proxy, agent) == []


# -- git: smart HTTP, the credential stamped on every request -------------------------------


def test_git_ls_remote_and_clone_over_https(
    served: tuple[Proxy, Upstream, str], names: Any, tmp_path: Path
) -> None:
    git = need("git", "Debian: apt-get install git")
    proxy, upstream, commit = served
    agent, token = principal(proxy, names, GIT_HOST, "basic", f"git:{SECRET}")
    proxy.store.add_grant(agent, ["GET", "POST"], credential=names("cred"), paths=[REPO + "/"])
    proxy.wait_reload()
    upstream.log.clear()
    env = client_env(
        proxy,
        agent,
        token,
        tmp_path / "home",
        GIT_SSL_CAINFO=str(proxy.ca_file),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_TERMINAL_PROMPT="0",
        GIT_ASKPASS="/bin/false",
    )
    url = f"https://{GIT_HOST}{REPO}"
    listed = run([git, "ls-remote", url], env, tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert f"{commit}\tHEAD" in listed.stdout.splitlines()
    cloned = run([git, "clone", "-q", url, str(tmp_path / "clone")], env, tmp_path)
    assert cloned.returncode == 0, cloned.stderr
    assert (tmp_path / "clone" / "README").read_text() == "hello from git.test\n"
    assert {r.method for r in upstream.log.requests} == {"GET", "POST"}
    assert all(r.header("authorization") == [basic(f"git:{SECRET}")] for r in upstream.log.requests)
    assert all(line["decision"] == "allow" for line in proxy.requests(agent))
    assert len(proxy.requests(agent)) == len(upstream.log.requests)
