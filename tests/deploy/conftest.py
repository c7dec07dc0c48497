"""The Kubernetes manifests, rendered once per run with `kubectl kustomize` from a copy of
deploy/kubernetes/ holding the files an operator makes at install time."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from addon.launcher import launchenv
from store.ca import PRIVATE_BUNDLE, PUBLIC_CERT, ensure_ca

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"
OVERLAYS = ("shared-proxy", "monitoring", "agents")
PROXY_NAMESPACE = "credproxy"
AGENTS_NAMESPACE = "agents"
SERVICE_HOST = "credproxy.credproxy.svc.cluster.local"
MASTER_KEY = base64.b64encode(bytes(range(32))).decode() + "\n"
PG_PASSWORD = "pg-password-for-the-test"
SESSION_TOKEN = "session-token-for-the-test"


def need_tool(name: str, install: str) -> str:
    """The tool's path; skip without it, but fail under CI, which must have installed it."""
    found = shutil.which(name)
    if found is None:
        message = f"{name} is not installed ({install})"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must have it")
        pytest.skip(message)
    return found


def session_filter() -> re.Pattern[str]:
    """The grep -E pattern docs/deployment.md gives to keep a session's proxy variables."""
    match = re.search(r"grep -E '([^']+)'", DEPLOYMENT_DOC.read_text())
    assert match, "docs/deployment.md has no grep -E filter for credproxy env"
    return re.compile(match[1])


def session_env() -> str:
    """What the documented `credproxy env --format dotenv | grep -E ...` leaves."""
    session = launchenv.Session(
        proxy_url=f"http://agent:{SESSION_TOKEN}@{SERVICE_HOST}:8080",
        proxy_host=SERVICE_HOST,
        proxy_port=8080,
        ca_file=Path("/run/credproxy/certs/credproxy-ca.pem"),
        truststore=None,
    )
    env = launchenv.variables(session)
    env["JAVA_TOOL_OPTIONS"] = launchenv.java_options(session, None)
    lines = launchenv.render(env, "dotenv").splitlines(keepends=True)
    pattern = session_filter()
    return "".join(line for line in lines if pattern.search(line))


def install_files(tree: Path, certs: Path) -> None:
    """The files docs/deployment.md has the operator make (git ignores them)."""
    proxy = tree / "shared-proxy" / "secrets"
    proxy.mkdir()
    (proxy / "credproxy.key").write_text(MASTER_KEY)
    (proxy / "pgpass").write_text(f"*:5432:credproxy:credproxy:{PG_PASSWORD}\n")
    for name in (PRIVATE_BUNDLE, PUBLIC_CERT):
        shutil.copy(certs / name, proxy / name)
    agents = tree / "agents" / "secrets"
    agents.mkdir()
    shutil.copy(certs / PUBLIC_CERT, agents / PUBLIC_CERT)
    (agents / "session.env").write_text(session_env())


def kustomize(directory: Path) -> list[dict[str, Any]]:
    kubectl = need_tool("kubectl", "kustomize is built into kubectl")
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="session")
def ca_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    certs = tmp_path_factory.mktemp("ca")
    ensure_ca(certs)
    return certs


@pytest.fixture(scope="session")
def rendered(
    tmp_path_factory: pytest.TempPathFactory, ca_dir: Path
) -> Iterator[dict[str, list[dict[str, Any]]]]:
    """Every overlay's objects, by overlay."""
    tree = tmp_path_factory.mktemp("deploy") / "kubernetes"
    shutil.copytree(KUSTOMIZE, tree)
    install_files(tree, ca_dir)
    yield {overlay: kustomize(tree / overlay) for overlay in OVERLAYS}


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of this kind whose name is `name`, or `name` plus kustomize's hash."""
    found = [
        o
        for o in objects
        if o["kind"] == kind and re.fullmatch(rf"{name}(-[a-z0-9]{{10}})?", o["metadata"]["name"])
    ]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def pod_templates(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod template) of every workload."""
    return [
        (f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"])
        for o in objects
        if o["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet")
    ]


def secret_data(secret: dict[str, Any]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}
