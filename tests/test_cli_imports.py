"""A command of the store's own answers at once: it never imports the proxy's heavy parts, and
on a plain SQLite URL the ones a script calls one by one never import SQLAlchemy either."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from addon.cli.cli import _command, build_parser

PROBE = """
import json, sys
from addon.cli import cli
status = cli.main(sys.argv[1:])
HEAVY = ("mitmproxy", "alembic", "botocore", "sqlalchemy", "psycopg", "publicsuffix2")
heavy = sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in HEAVY})
heavy += ["cryptography.x509"] if "cryptography.x509" in sys.modules else []
print(json.dumps({"status": status, "heavy": heavy}), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("cli")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CREDPROXY_")}
    env |= {
        "CREDPROXY_DB": f"sqlite:///{home}/credproxy.db",
        "CREDPROXY_KEY_FILE": str(home / "credproxy.key"),
        "CREDPROXY_CERTS": str(home / "certs"),
    }
    subprocess.run([sys.executable, "-m", "addon.cli.cli", "init"], env=env, check=True)
    return env


def _probe(env: dict[str, str], *argv: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parent.parent,
    )
    result: dict[str, object] = json.loads(done.stderr.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(("principal", "add", "agent"), id="principal add"),
        pytest.param(
            ("grant", "add", "agent", "--host", "pypi.org", "--method", "GET"), id="grant add"
        ),
        pytest.param(("grant", "list", "--json"), id="grant list --json"),
        pytest.param(("--db", "sqlite:///nowhere.db", "grant", "list"), id="a global option first"),
    ],
)
def test_the_stores_commands_import_nothing_heavy(env: dict[str, str], argv: tuple[str]) -> None:
    result = _probe(env, *argv)
    assert result["heavy"] == []


def test_other_commands_and_urls_still_take_sqlalchemy(env: dict[str, str]) -> None:
    assert _probe(env, "principal", "list", "--json")["heavy"] == ["sqlalchemy"]
    url = env["CREDPROXY_DB"].replace("sqlite:///", "sqlite+pysqlite:///")
    assert _probe(env, "--db", url, "grant", "list")["heavy"] == ["sqlalchemy"]


def test_the_proxys_commands_are_still_there(env: dict[str, str]) -> None:
    assert _probe(env, "run", "--listen", "nonsense")["status"] == 2
    names = {a.dest for a in build_parser(["run"])._actions}
    assert "command" in names
    (commands,) = (
        a for a in build_parser(["grant", "list"])._actions if hasattr(a, "choices") and a.choices
    )
    assert "run" not in commands.choices and "grant" in commands.choices
    (commands,) = (a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    assert {"run", "demo", "exec", "plan", "grant"} <= set(commands.choices)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        pytest.param(["grant", "list"], "grant", id="the first word"),
        pytest.param(["--db", "grant", "run"], "run", id="a global option's value is skipped"),
        pytest.param(["--json", "key", "rotate"], "key", id="a flag without a value is not"),
        pytest.param(["--help"], None, id="no command"),
    ],
)
def test_the_command_of_a_command_line(argv: list[str], command: str | None) -> None:
    assert _command(argv) == command


# `credproxy run` with no optional feature in use: what it must not have imported once it
# listens (each module is imported at the first use of its feature instead).
RUN_PROBE = """
import json, os, signal, sys
from addon.cli import cli

def report(signum, frame):
    tops = {m.split(".")[0] for m in sys.modules}
    with open(os.environ["PROBE_OUT"], "w") as out:
        json.dump({"tops": sorted(tops), "modules": sorted(sys.modules)}, out)

signal.signal(signal.SIGUSR1, report)
sys.exit(cli.main(sys.argv[1:]))
"""
OPTIONAL = (
    "graphql",  # GraphQL body rules
    "botocore",  # sigv4 credentials
    "boto3",
    "urllib3",  # minted tokens, AssumeRole
    "hvac",  # Vault secret sources
    "opentelemetry",  # --otlp
    "alembic",  # init's migrations
    "psycopg",  # PostgreSQL stores
    "publicsuffix2",  # wildcard hosts checked by the CLI
    "flask",  # mitmproxy's onboarding page: mitmproxy/addons/__init__.py, not run
    "werkzeug",
    "jinja2",
    "ldap3",  # mitmproxy's proxyauth
    "passlib",
)
OPTIONAL_MODULES = ("addon.cli.demo", "addon.cli.policycmd", "store.policyfile", "addon.launcher")


def test_the_proxys_start_imports_no_optional_feature(env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "modules.json"
    proxy = subprocess.Popen(
        [sys.executable, "-c", RUN_PROBE, "run", "--listen", "127.0.0.1:0"],
        env=env | {"PROBE_OUT": str(out)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert proxy.stdout is not None
        for line in proxy.stdout:
            if b'"proxy.started"' in line:
                break
        else:
            pytest.fail("credproxy run did not start")
        proxy.send_signal(signal.SIGUSR1)
        for _ in range(200):
            if out.exists() and out.stat().st_size:
                break
            time.sleep(0.05)
        found = json.loads(out.read_text())
    finally:
        proxy.terminate()
        proxy.wait(15)
    assert "mitmproxy" in found["tops"] and "sqlalchemy" in found["tops"]  # it did start
    assert sorted(set(OPTIONAL) & set(found["tops"])) == []
    assert [m for m in found["modules"] if m.startswith(OPTIONAL_MODULES)] == []
    # mitmproxy's addons package stands without its __init__: only the addons credproxy loads.
    assert "mitmproxy.addons.onboarding" not in found["modules"]
