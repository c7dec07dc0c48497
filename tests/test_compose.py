"""The container image and the compose topology: the sandbox's only way out is credproxy."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from addon.launcher.launchenv import CA_VARS

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"

TOKEN = "tok-test"
MASTER_KEY = base64.b64encode(bytes(range(32))).decode()
PROXIES = ["credproxy", "credproxy-a", "credproxy-b"]
AGENT_CA = "/ca/credproxy-ca.pem"
TRUST_VARIABLES = list(CA_VARS)  # one list: exec's, `credproxy env`'s and compose's
PROXY_VARIABLES = ["HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"]


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool


def mounts(service: dict[str, Any]) -> list[Mount]:
    """A service's volumes, from either the short or the long compose syntax."""
    result = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            result.append(Mount(source, target, bool(mode) and "ro" in mode[0].split(",")))
        else:
            result.append(Mount(volume["source"], volume["target"], bool(volume.get("read_only"))))
    return result


def networks(service: dict[str, Any]) -> set[str]:
    return set(service.get("networks", {}))


def docker_compose(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    executable = shutil.which("docker-compose")
    if executable is None:
        message = "docker-compose is not installed (Debian: apt-get install docker-compose)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must install it")
        pytest.skip(message)
    # A developer's .env or exported variables must not change what is validated.
    env_file = tmp_path / "empty.env"
    env_file.touch()
    return subprocess.run(
        [executable, "-f", str(ROOT / "docker-compose.yml"), "--env-file", str(env_file), *args],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The resolved configuration of every service, the replicas profile included."""
    done = docker_compose(
        tmp_path_factory.mktemp("compose"),
        "--profile",
        "replicas",
        "config",
        AGENT_TOKEN=TOKEN,
        CREDPROXY_MASTER_KEY=MASTER_KEY,
    )
    assert done.returncode == 0, done.stderr
    return YAML(typ="safe").load(done.stdout)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


@pytest.fixture(scope="module")
def agent(services: dict[str, Any]) -> dict[str, Any]:
    return services["agent"]


def private_volumes(services: dict[str, Any]) -> set[str]:
    """Volumes the proxies mount anywhere but /ca: store, key, CA private key, database."""
    found = {m.source for name in PROXIES for m in mounts(services[name]) if m.target != "/ca"}
    return found | {m.source for m in mounts(services["postgres"])}


def test_the_sandbox_and_store_networks_have_no_route_out(compose: dict[str, Any]) -> None:
    assert compose["networks"]["sandbox"].get("internal") is True
    assert compose["networks"]["store"].get("internal") is True
    assert not compose["networks"]["egress"].get("internal")


def test_the_agent_is_only_on_the_sandbox_network(agent: dict[str, Any]) -> None:
    assert networks(agent) == {"sandbox"}


def test_only_the_proxies_reach_both_the_sandbox_and_egress(services: dict[str, Any]) -> None:
    bridging = {name for name, s in services.items() if {"sandbox", "egress"} <= networks(s)}
    assert bridging == set(PROXIES)
    assert networks(services["postgres"]) == {"store"}


def test_the_agent_mounts_only_the_public_ca_read_only(services: dict[str, Any]) -> None:
    assert mounts(services["agent"]) == [Mount("credproxy-ca", "/ca", read_only=True)]


def test_no_volume_with_the_key_or_store_is_visible_to_the_agent(
    services: dict[str, Any],
) -> None:
    private = private_volumes(services)
    assert {"credproxy-state", "credproxy-certs", "credproxy-pg"} <= private
    assert private.isdisjoint(m.source for m in mounts(services["agent"]))


def test_the_proxies_export_only_the_public_certificate(services: dict[str, Any]) -> None:
    for name in PROXIES:
        script = services[name]["command"][-1]
        assert "cp certs/credproxy-ca.pem /ca/" in script, name
        assert "mitmproxy-ca" not in script, name
        assert Mount("credproxy-ca", "/ca", read_only=False) in mounts(services[name]), name


def test_the_agent_goes_out_through_credproxy_with_its_token(agent: dict[str, Any]) -> None:
    env = agent["environment"]
    for variable in PROXY_VARIABLES:
        assert env[variable] == f"http://agent:{TOKEN}@credproxy:8080", variable
    assert env["NO_PROXY"] == ""
    assert env["no_proxy"] == ""


def test_the_agent_trusts_the_credproxy_ca(agent: dict[str, Any]) -> None:
    env = agent["environment"]
    assert {variable: env.get(variable) for variable in TRUST_VARIABLES} == dict.fromkeys(
        TRUST_VARIABLES, AGENT_CA
    )


def test_the_agent_starts_once_the_proxy_is_ready(agent: dict[str, Any]) -> None:
    assert agent["depends_on"] == {"credproxy": {"condition": "service_healthy"}}


def test_the_proxies_run_with_the_admin_listener_the_health_check_probes(
    services: dict[str, Any],
) -> None:
    probe = healthcheck_target(DOCKERFILE.read_text())
    for name in PROXIES:
        script = services[name]["command"][-1]
        assert script.startswith("credproxy init &&"), name
        assert "exec credproxy run --listen 0.0.0.0:8080" in script, name
        assert f"--admin {probe}" in script, name
        assert "healthcheck" not in services[name], f"{name} must use the image's health check"


def test_the_replicas_share_postgres_the_key_and_the_ca(services: dict[str, Any]) -> None:
    certs = {m for m in mounts(services["credproxy"]) if m.target.endswith("/certs")}
    for name in ["credproxy-a", "credproxy-b"]:
        replica = services[name]
        assert replica["profiles"] == ["replicas"]
        assert replica["environment"]["CREDPROXY_DB"].startswith("postgresql+psycopg://")
        assert replica["environment"]["CREDPROXY_MASTER_KEY"] == MASTER_KEY
        assert certs <= set(mounts(replica)), name
        assert "credproxy-state" not in {m.source for m in mounts(replica)}, name
        assert "credproxy-pool" in replica["networks"]["sandbox"]["aliases"], name
    assert services["postgres"]["profiles"] == ["replicas"]


def test_the_replicas_initialise_one_after_the_other(services: dict[str, Any]) -> None:
    healthy = {"condition": "service_healthy"}
    assert services["credproxy-a"]["depends_on"] == {"credproxy": healthy, "postgres": healthy}
    assert services["credproxy-b"]["depends_on"] == {"credproxy-a": healthy}


def test_a_replica_refuses_to_start_without_the_master_key(services: dict[str, Any]) -> None:
    for name in ["credproxy-a", "credproxy-b"]:
        entrypoint = services[name]["entrypoint"]
        assert entrypoint[:2] == ["sh", "-c"], name
        assert "${CREDPROXY_MASTER_KEY:?" in entrypoint[2].replace("$$", "$"), name


def test_the_default_services_validate_without_any_variable(tmp_path: Path) -> None:
    done = docker_compose(tmp_path, "config", "--services")
    assert done.returncode == 0, done.stderr
    assert {"credproxy", "agent"} <= set(done.stdout.split())


# -- Dockerfile ------------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    result = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def healthcheck_target(text: str) -> str:
    """The host:port the HEALTHCHECK asks for /readyz."""
    [check] = [args for keyword, args in instructions(text) if keyword == "HEALTHCHECK"]
    match = re.search(r"HTTPConnection\('([\d.]+)', (\d+)", check)
    assert match, check
    assert "/readyz" in check
    return f"{match[1]}:{match[2]}"


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def test_the_base_image_is_a_pinned_python_slim(dockerfile: list[tuple[str, str]]) -> None:
    bases = [args for keyword, args in dockerfile if keyword == "FROM"]
    assert bases
    for base in bases:
        assert re.fullmatch(r"python:3\.\d+\.\d+-slim(-\w+)?", base), base


def test_the_image_runs_the_python_minor_version_the_suite_runs_on(
    dockerfile: list[tuple[str, str]],
) -> None:
    base = next(args for keyword, args in dockerfile if keyword == "FROM")
    match = re.match(r"python:(\d+)\.(\d+)\.", base)
    assert match, base
    image = (int(match[1]), int(match[2]))
    if image != sys.version_info[:2] and not os.environ.get("CI"):
        pytest.skip(f"this interpreter is {sys.version_info[:2]}, the image {image}: CI checks")
    assert image == sys.version_info[:2]


def test_the_image_runs_as_a_user_other_than_root(dockerfile: list[tuple[str, str]]) -> None:
    users = [args for keyword, args in dockerfile if keyword == "USER"]
    assert users and users[-1] not in {"root", "0", "0:0"}


def test_the_image_installs_no_test_dependencies(dockerfile: list[tuple[str, str]]) -> None:
    installs = [args for keyword, args in dockerfile if keyword == "RUN" and "pip install" in args]
    assert installs
    assert not any("[" in args for args in installs)


def test_the_image_listens_on_8080_and_checks_its_health(
    dockerfile: list[tuple[str, str]],
) -> None:
    assert ("EXPOSE", "8080") in dockerfile
    [cmd] = [args for keyword, args in dockerfile if keyword == "CMD"]
    assert "credproxy init &&" in cmd
    assert "exec credproxy run --listen 0.0.0.0:8080" in cmd
    assert f"--admin {healthcheck_target(DOCKERFILE.read_text())}" in cmd


def test_the_build_context_is_an_allow_list() -> None:
    rules = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*"
    assert not any(rule.startswith("!") and ("cert" in rule or "key" in rule) for rule in rules)


def test_the_docs_and_the_compose_comments_spell_the_command_one_way() -> None:
    """The tests run `docker-compose`; a reader must not meet the other spelling as a command."""
    other = re.compile(r"docker compose (?:-|up|exec|run|stop|restart|logs|down|config|ps|build)")
    pages = sorted((ROOT / "docs").glob("*.md"))
    for path in (ROOT / "README.md", *pages, ROOT / "docker-compose.yml"):
        found = other.search(path.read_text())
        assert found is None, f"{path.name}: {found and found.group()}"


def test_the_proxy_starts_after_the_policy_is_applied_from_a_compose_secret(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    apply = services["credproxy-apply"]
    script = apply["command"][-1]
    assert "credproxy init" in script
    assert "credproxy apply /etc/credproxy/policy.toml --yes" in script
    assert apply["network_mode"] == "none"  # it needs the store, not the network
    policy = [m for m in mounts(apply) if m.target == "/etc/credproxy/policy.toml"]
    assert [(Path(m.source).name, m.read_only) for m in policy] == [("policy.compose.toml", True)]
    assert [s if isinstance(s, str) else s["source"] for s in apply["secrets"]] == ["github_token"]
    assert Path(compose["secrets"]["github_token"]["file"]).name == "github_token"
    assert services["credproxy"]["depends_on"] == {
        "credproxy-apply": {"condition": "service_completed_successfully"}
    }
    assert "github_token" not in str(services["agent"])


def test_the_example_policy_reads_its_secret_from_the_compose_secret() -> None:
    from store.policyfile.parse import SecretSource, load

    policy = load(ROOT / "docs" / "policy.compose.toml")
    assert policy.problems == ()
    (credential,) = policy.credentials
    assert credential.source == SecretSource(file=Path("/run/secrets/github_token"))
