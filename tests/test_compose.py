"""The container image and the compose topology: the sandbox's only way out is credproxy."""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from ruamel.yaml import YAML

from addon.launcher.launchenv import CA_VARS

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"

TOKEN = "tok-test"
MASTER_KEY = base64.b64encode(bytes(range(32))).decode()
PROXIES = ["credproxy", "credproxy-a", "credproxy-b"]
REPLICAS = ["credproxy-a", "credproxy-b"]
AGENTS = {
    "agent": ("credproxy", "credproxy-ca"),
    "agent-pool": ("credproxy-pool", "credproxy-pool-ca"),
}
SECRET_FILES = {"github_token", "agent_token", "master_key", "postgres_password"}
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


def test_the_agents_are_only_on_the_sandbox_network(services: dict[str, Any]) -> None:
    for name in AGENTS:
        assert networks(services[name]) == {"sandbox"}, name


def test_only_the_proxies_reach_both_the_sandbox_and_egress(services: dict[str, Any]) -> None:
    bridging = {name for name, s in services.items() if {"sandbox", "egress"} <= networks(s)}
    assert bridging == set(PROXIES)
    assert networks(services["postgres"]) == {"store"}


def test_the_agents_mount_only_the_public_ca_read_only(services: dict[str, Any]) -> None:
    for name, (_, ca) in AGENTS.items():
        assert mounts(services[name]) == [Mount(ca, "/ca", read_only=True)], name


def test_no_volume_with_the_key_or_store_is_visible_to_the_agent(
    services: dict[str, Any],
) -> None:
    private = private_volumes(services)
    assert {"credproxy-state", "credproxy-certs", "credproxy-pool-certs", "credproxy-pg"} <= private
    for name in AGENTS:
        assert private.isdisjoint(m.source for m in mounts(services[name])), name


def test_the_proxies_export_only_the_public_certificate(services: dict[str, Any]) -> None:
    for name in PROXIES:
        script = services[name]["command"][-1]
        assert "cp certs/credproxy-ca.pem /ca/" in script, name
        assert "mitmproxy-ca" not in script, name
        ca = "credproxy-pool-ca" if name in REPLICAS else "credproxy-ca"
        assert Mount(ca, "/ca", read_only=False) in mounts(services[name]), name


def run_script(script: str, replacements: dict[str, str], *args: str, **env: str) -> Any:
    """A compose shell script, its $$ unescaped and its paths moved under the test's folder."""
    script = script.replace("$$", "$")
    for old, new in replacements.items():
        script = script.replace(old, new)
    return subprocess.run(
        ["sh", "-c", script, *args],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("name", list(AGENTS))
def test_the_agent_goes_out_through_credproxy_with_the_token_of_its_secret(
    services: dict[str, Any], tmp_path: Path, name: str
) -> None:
    agent = services[name]
    env = agent["environment"]
    assert not set(PROXY_VARIABLES) & set(env), "the token would show in docker inspect"
    assert [s if isinstance(s, str) else s["source"] for s in agent["secrets"]] == ["agent_token"]
    (tmp_path / "agent_token").write_text(TOKEN + "\n")
    shell, flag, script, argv0 = agent["entrypoint"]
    assert (shell, flag) == ("sh", "-c")
    done = run_script(
        script,
        {"/run/secrets/": f"{tmp_path}/"},
        argv0,
        "env",
        AGENT_PROXY_HOST=env["AGENT_PROXY_HOST"],
    )
    assert done.returncode == 0, done.stderr
    seen = dict(line.split("=", 1) for line in done.stdout.splitlines())
    host = AGENTS[name][0]
    for variable in PROXY_VARIABLES:
        assert seen[variable] == f"http://agent:{TOKEN}@{host}:8080", variable
    assert env["NO_PROXY"] == ""
    assert env["no_proxy"] == ""


def test_the_agents_trust_the_credproxy_ca(services: dict[str, Any]) -> None:
    for name in AGENTS:
        env = services[name]["environment"]
        assert {variable: env.get(variable) for variable in TRUST_VARIABLES} == dict.fromkeys(
            TRUST_VARIABLES, AGENT_CA
        ), name


def test_the_agent_starts_once_the_proxy_is_ready(agent: dict[str, Any]) -> None:
    assert agent["depends_on"] == {"credproxy": {"condition": "service_healthy"}}


def test_the_proxies_run_with_the_admin_listener_the_health_check_probes(
    services: dict[str, Any],
) -> None:
    probe = healthcheck_target(DOCKERFILE.read_text())
    for name in PROXIES:
        script = services[name]["command"][-1]
        first = "credproxy init &&" if name == "credproxy" else "set -eu\n"
        assert script.startswith(first), name
        assert "\ncredproxy init\n" in script or name == "credproxy", name
        assert "exec credproxy run --listen 0.0.0.0:8080" in script, name
        assert f"--admin {probe}" in script, name
        assert "healthcheck" not in services[name], f"{name} must use the image's health check"


def test_the_replicas_share_postgres_the_key_and_the_ca(services: dict[str, Any]) -> None:
    certs = {m for m in mounts(services["credproxy-a"]) if m.target.endswith("/certs")}
    assert certs == {Mount("credproxy-pool-certs", "/var/lib/credproxy/certs", read_only=False)}
    for name in REPLICAS:
        replica = services[name]
        assert replica["profiles"] == ["replicas"]
        env = replica["environment"]
        url = urlsplit(env["CREDPROXY_DB"])
        assert url.scheme == "postgresql+psycopg" and url.password is None, name
        assert env["PGPASSFILE"].startswith("/tmp/") and "/tmp" in replica["tmpfs"], name
        assert env["CREDPROXY_KEY_FILE"].startswith("/tmp/"), name
        assert "CREDPROXY_MASTER_KEY" not in env, name
        secrets = {s if isinstance(s, str) else s["source"] for s in replica["secrets"]}
        assert secrets == {"master_key", "postgres_password"}, name
        assert certs <= set(mounts(replica)), name
        assert "credproxy-state" not in {m.source for m in mounts(replica)}, name
        assert "credproxy-pool" in replica["networks"]["sandbox"]["aliases"], name
    assert services["postgres"]["profiles"] == ["replicas"]
    assert services["agent-pool"]["profiles"] == ["replicas"]


def test_postgres_takes_its_password_from_a_compose_secret(services: dict[str, Any]) -> None:
    postgres = services["postgres"]
    env = postgres["environment"]
    assert "POSTGRES_PASSWORD" not in env
    assert env["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    assert [s if isinstance(s, str) else s["source"] for s in postgres["secrets"]] == [
        "postgres_password"
    ]


def test_no_secret_is_in_an_environment_variable(services: dict[str, Any]) -> None:
    for name, service in services.items():
        env = service.get("environment", {})
        for variable, value in env.items():
            assert not re.search(r"TOKEN|PASSWORD$|MASTER_KEY", variable), (name, variable)
            if value and "://" in value:
                assert urlsplit(value).password is None, (name, variable)


def test_every_root_file_system_is_read_only(services: dict[str, Any]) -> None:
    for name, service in services.items():
        assert service.get("read_only") is True, name
        assert "/tmp" in service.get("tmpfs", []), name


def dependencies(services: dict[str, Any], name: str) -> set[str]:
    found = set()
    for other in services[name].get("depends_on", {}):
        found |= {other} | dependencies(services, other)
    return found


def test_the_replicas_profile_starts_no_sqlite_proxy(services: dict[str, Any]) -> None:
    assert dependencies(services, "agent-pool") == {"credproxy-b", "credproxy-a", "postgres"}
    for name in REPLICAS:
        assert "credproxy-certs" not in {m.source for m in mounts(services[name])}, name


def test_the_replicas_initialise_one_after_the_other(services: dict[str, Any]) -> None:
    healthy = {"condition": "service_healthy"}
    assert services["credproxy-a"]["depends_on"] == {"postgres": healthy}
    assert services["credproxy-b"]["depends_on"] == {"credproxy-a": healthy}


def replica_setup(services: dict[str, Any], name: str) -> str:
    """The replica's script up to `credproxy init`: the checks and the copies of its secrets."""
    script = services[name]["command"][-1]
    return script[: script.index("credproxy init")]


@pytest.mark.parametrize("name", REPLICAS)
def test_a_replica_refuses_to_start_without_the_master_key(
    services: dict[str, Any], tmp_path: Path, name: str
) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "postgres_password").write_text("pw")
    moved = {"/run/secrets/": f"{secrets}/", "/tmp/credproxy": f"{tmp_path}/private"}
    env = {
        k: v.replace("/tmp/credproxy", f"{tmp_path}/private")
        for k, v in services[name]["environment"].items()
    }
    for content in (None, ""):
        if content is not None:
            (secrets / "master_key").write_text(content)
        done = run_script(replica_setup(services, name), moved, **env)
        assert done.returncode == 2, done.stderr
        assert "secrets/master_key is missing or empty" in done.stderr
        assert not (tmp_path / "private").exists()


@pytest.mark.parametrize("name", REPLICAS)
def test_a_replica_copies_its_secrets_private_before_credproxy_reads_them(
    services: dict[str, Any], tmp_path: Path, name: str
) -> None:
    """Compose secret files keep the host file's mode; credproxy and libpq want 0600."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "master_key").write_text(MASTER_KEY + "\n")
    (secrets / "postgres_password").write_text("pw-from-the-secret\n")
    for secret in secrets.iterdir():
        secret.chmod(0o644)
    moved = {"/run/secrets/": f"{secrets}/", "/tmp/credproxy": f"{tmp_path}/private"}
    env = {
        k: v.replace("/tmp/credproxy", f"{tmp_path}/private")
        for k, v in services[name]["environment"].items()
    }
    done = run_script(replica_setup(services, name), moved, **env)
    assert done.returncode == 0, done.stderr
    key, pgpass = Path(env["CREDPROXY_KEY_FILE"]), Path(env["PGPASSFILE"])
    assert key.read_text() == MASTER_KEY + "\n"
    assert pgpass.read_text() == "*:*:*:*:pw-from-the-secret\n"
    for path in (key, pgpass):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700


def test_the_files_a_first_up_needs_are_the_secrets_and_are_listed(
    compose: dict[str, Any],
) -> None:
    files = {Path(s["file"]).name for s in compose["secrets"].values()}
    assert files == SECRET_FILES
    header = (ROOT / "docker-compose.yml").read_text().split("version:")[0]
    listed = set(re.findall(r"#   secrets/(\w+) ", header))
    assert listed == SECRET_FILES
    docs = (ROOT / "docs" / "deployment.md").read_text()
    for name in SECRET_FILES:
        assert f"secrets/{name}" in docs, name


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
        # A digest may follow the tag; none is written here, where it could not be checked.
        assert re.fullmatch(r"python:3\.\d+\.\d+-slim(-\w+)?(@sha256:[0-9a-f]{64})?", base), base


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


def test_the_image_installs_only_hashed_pins_and_its_own_source(
    dockerfile: list[tuple[str, str]],
) -> None:
    [install] = [args for keyword, args in dockerfile if keyword == "RUN" and "pip install" in args]
    steps = [shlex.split(step) for step in install.split("&&") if "pip install" in step]
    assert len(steps) == 2
    locked, own = steps
    assert {"--require-hashes", "-r", "/tmp/src/requirements.lock"} <= set(locked)
    assert {"--no-deps", "--no-build-isolation", "--no-index"} <= set(own)
    assert own[-1] == "/tmp/src"
    copies = [args for keyword, args in dockerfile if keyword == "COPY"]
    assert any(args.startswith("requirements.lock ") for args in copies)


LOCK = ROOT / "requirements.lock"


def locked_pins() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of requirements.lock."""
    pins = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", LOCK.read_text()):
        match = re.match(r"([A-Za-z0-9._-]+)==([^ \\\n]+)", block)
        if match:
            name = re.sub(r"[-_.]+", "-", match[1]).lower()
            pins[name] = (match[2], re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return pins


def test_the_lock_pins_every_dependency_of_pyproject_with_hashes() -> None:
    import tomllib

    from packaging.requirements import Requirement

    pins = locked_pins()
    assert pins and all(hashes for _, hashes in pins.values())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The image serves every feature: the extras that secret references (aws, vault) and the
    # OTLP export (otel) import are in it too.
    extras = project["optional-dependencies"]
    for line in [*project["dependencies"], *extras["aws"], *extras["vault"], *extras["otel"]]:
        requirement = Requirement(line)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert name in pins, line
        assert requirement.specifier.contains(pins[name][0]), (line, pins[name][0])
    assert "setuptools" in pins  # to build credproxy itself with --no-index


def test_the_lock_matches_pyproject(tmp_path: Path) -> None:
    """uv compiles it again, keeping the lock's pins where pyproject.toml allows them: any
    difference is a dependency changed in pyproject.toml and not in the lock (the lock's first
    lines give the command that updates it)."""
    uv = shutil.which("uv", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if uv is None:
        message = "uv is not installed (it comes with the test extra)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    command = LOCK.read_text().splitlines()[1].removeprefix("#").strip()
    stdin, _, compile_args = command.partition(" | ")
    assert stdin == "echo 'setuptools>=68'"
    args = shlex.split(compile_args)
    assert args[:4] == ["uv", "pip", "compile", "pyproject.toml"] and args[-2:] == [
        "-o",
        "requirements.lock",
    ]
    again = tmp_path / "requirements.lock"
    shutil.copy(LOCK, again)
    done = subprocess.run(
        [uv, *args[1:-1], str(again), "--quiet", "--custom-compile-command", command],
        input="setuptools>=68\n",
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert again.read_text() == LOCK.read_text(), "requirements.lock is out of date: " + command


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
