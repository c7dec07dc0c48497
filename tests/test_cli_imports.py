"""A command of the store's own answers at once: it never imports the proxy's heavy parts, and
on a plain SQLite URL the ones a script calls one by one never import SQLAlchemy either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
