"""What a new user trips over first (issue 36): each answer's exact line and status."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.clihelp import COMMAND, Call, Cli


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Cli:
    """A store with a principal, a credential and one grant."""
    cli = Cli(tmp_path_factory.mktemp("first-minutes"))
    cli.ok(Call(("init",)))
    cli.ok(
        Call(("principal", "add", "agent")),
        Call(
            ("credential", "add", "gh", "--scheme", "bearer", "--host", "api.github.com"),
            b"sk-live-123\n",
        ),
    )
    cli.ok(Call(("grant", "add", "agent", "--credential", "gh", "--method", "GET")))
    return cli


def _into_a_closed_pipe(cli: Cli, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run with stdout a pipe whose reader has gone, as `| head -c 600` leaves it."""
    read, write = os.pipe()
    os.close(read)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CREDPROXY_")}
    env["CREDPROXY_DB"] = f"sqlite:///{cli.db_file}"
    try:
        return subprocess.run(
            [*COMMAND, *args],
            stdout=write,
            stderr=subprocess.PIPE,
            cwd=cli.root,
            env=env,
            timeout=60,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("--json", "grant", "list"), id="grant list --json"),
        pytest.param(("request", "list"), id="request list"),
        pytest.param(("export",), id="export"),
    ],
)
def test_a_closed_pipe_ends_the_command_quietly(cli: Cli, args: tuple[str, ...]) -> None:
    result = _into_a_closed_pipe(cli, *args)
    assert (result.returncode, result.stderr) == (141, b"")


SECRET_FROM_STDIN = (
    "credproxy: error: unrecognized arguments (not shown: they may hold a secret); "
    '{command} reads the secret from stdin: printf %s "$SECRET" | credproxy {command} ... '
    "(see --help)"
)


@pytest.mark.parametrize(
    ("args", "command"),
    [
        pytest.param(
            ("credential", "add", "x2", "--scheme", "bearer", "--host", "a.example.com"),
            "credential add",
            id="credential add",
        ),
        pytest.param(("credential", "rotate", "gh"), "credential rotate", id="credential rotate"),
    ],
)
def test_a_secret_on_the_command_line_is_never_echoed(
    cli: Cli, args: tuple[str, ...], command: str
) -> None:
    result = cli.run(Call((*args, "sk-live-123"), b"sk-live-456"))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == SECRET_FROM_STDIN.format(command=command) + "\n"


def test_other_commands_still_name_what_they_did_not_recognise(cli: Cli) -> None:
    result = cli.run(Call(("principal", "add", "eve", "--colour", "red")))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "credproxy: error: unrecognized arguments: --colour red (see --help)\n"
    )


@pytest.mark.parametrize(
    ("args", "error", "code"),
    [
        pytest.param(
            ("--json", "grant", "revoke", "99"),
            "no grant with id 99",
            "not_found",
            id="a domain error, --json before the command",
        ),
        pytest.param(
            ("principal", "add", "agent", "--json"),
            "principal 'agent' already exists",
            "conflict",
            id="a domain error, --json after the command",
        ),
        pytest.param(
            ("--json", "grant", "add"),
            "the following arguments are required: principal, --method "
            "(see credproxy grant add --help)",
            "usage",
            id="a usage error",
        ),
    ],
)
def test_json_errors_are_one_json_object_on_stderr(
    cli: Cli, args: tuple[str, ...], error: str, code: str
) -> None:
    result = cli.run(Call(args))
    assert (result.returncode, result.stdout) == (2, "")
    assert json.loads(result.stderr) == {"error": error, "code": code}
    assert result.stderr.count("\n") == 1


GRANT = ("grant", "add", "agent", "--credential", "gh")
MISSING_DB = "credproxy_missing_issue36"

ONE_LINE = {
    "a port out of range": (
        ("run", "--listen", "0.0.0.0:99999"),
        "invalid --listen '0.0.0.0:99999': port 99999 is out of range (0 to 65535)",
    ),
    "a double star in a path": (
        (*GRANT, "--method", "GET", "--path", "/v1/**"),
        "invalid path pattern '/v1/**': '**' is not supported: a trailing '/' matches "
        "everything below ('/v1/'), '*' one whole segment",
    ),
    "a double star inside a path": (
        (*GRANT, "--method", "GET", "--path", "/v1/**/x"),
        "invalid path pattern '/v1/**/x': '**' is not supported: a trailing '/' matches "
        "everything below, '*' one whole segment",
    ),
    "a misspelt method": (
        (*GRANT, "--method", "GTE"),
        "method 'GTE' is not a registered HTTP method: did you mean 'GET'? "
        "(--extension-method allows others)",
    ),
    "an unknown method like none": (
        (*GRANT, "--method", "FROBNICATE"),
        "method 'FROBNICATE' is not a registered HTTP method (--extension-method allows others)",
    ),
    "an SQLite file in a missing directory": (
        ("init", "--db", "sqlite:///nonexistent/dir/x.db"),
        "cannot create a store at nonexistent/dir/x.db: the directory nonexistent/dir "
        "does not exist",
    ),
    "an SQLite file in a missing directory, for principal list": (
        ("principal", "list", "--db", "sqlite:///nonexistent/dir/x.db"),
        "no store at nonexistent/dir/x.db: the directory nonexistent/dir does not exist",
    ),
    "an SQLite file in a missing directory, for grant add": (
        (*GRANT, "--method", "GET", "--db", "sqlite:///nonexistent/dir/x.db"),
        "no store at nonexistent/dir/x.db: the directory nonexistent/dir does not exist",
    ),
    "an SQLite file in a missing directory, for run (before its key file)": (
        ("run", "--db", "sqlite:///nonexistent/dir/x.db", "--key-file", "nonexistent/k"),
        "no store at nonexistent/dir/x.db: the directory nonexistent/dir does not exist",
    ),
    "an SQLite file in a missing directory, for export": (
        ("export", "--db", "sqlite+pysqlite:///nonexistent/dir/x.db"),
        "no store at nonexistent/dir/x.db: the directory nonexistent/dir does not exist",
    ),
    "a missing PostgreSQL database": (
        ("init", "--db", f"postgresql://postgres@127.0.0.1:5432/{MISSING_DB}"),
        f"database {MISSING_DB!r} does not exist on 127.0.0.1:5432: create it with "
        f"`createdb -h 127.0.0.1 -p 5432 -U postgres {MISSING_DB}`, then run credproxy init",
    ),
}


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in ONE_LINE])
def test_a_misleading_input_gets_the_line_that_says_what_is_wrong(cli: Cli, name: str) -> None:
    args, line = ONE_LINE[name]
    result = cli.run(Call(args))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"credproxy: error: {line}\n"


def test_an_extension_method_needs_its_flag(cli: Cli) -> None:
    (added,) = cli.ok(Call((*GRANT, "--method", "FROBNICATE", "--extension-method", "--json")))
    assert json.loads(added)["id"] > 0


def test_revoking_a_grant_twice_says_it_was_already_revoked(cli: Cli) -> None:
    (added,) = cli.ok(Call((*GRANT, "--method", "PUT", "--json")))
    grant = json.loads(added)["id"]
    first = cli.run(Call(("grant", "revoke", str(grant))))
    second = cli.run(Call(("grant", "revoke", str(grant))))
    assert (first.returncode, first.stdout, first.stderr) == (0, f"revoked grant {grant}\n", "")
    assert (second.returncode, second.stdout, second.stderr) == (
        0,
        f"grant {grant} was already revoked\n",
        "",
    )
    (again,) = cli.ok(Call(("grant", "revoke", str(grant), "--json")))
    assert json.loads(again) == {"id": grant, "state": "revoked", "already_revoked": True}


EXAMPLE = Path(__file__).parents[2] / "docs" / "policy.example.toml"


def test_the_example_policy_plans_on_a_laptop_as_it_is(tmp_path: Path) -> None:
    fresh = Cli(tmp_path)
    fresh.ok(Call(("init",)))
    result = fresh.run(Call(("plan", str(EXAMPLE))))
    assert (result.returncode, result.stderr) == (1, "")
    assert result.stdout.splitlines() == [
        "create principal agent",
        "create grant pypi  principal=agent  hosts=[files.pythonhosted.org, pypi.org]  "
        "methods=[GET]  paths=[/]  purpose=install Python packages",
    ]


def test_the_example_policy_uncommented_plans_with_the_token_in_the_environment(
    tmp_path: Path,
) -> None:
    fresh = Cli(tmp_path)
    fresh.ok(Call(("init",)))
    text = EXAMPLE.read_text()
    (tmp_path / "policy.toml").write_text(re.sub(r"(?m)^# ?(\[\[|[a-z_]+ = |$)", r"\1", text))
    result = fresh.run(Call(("plan", "policy.toml"), env={"GITHUB_TOKEN": "ghp_example"}))
    assert (result.returncode, result.stderr) == (1, "")
    assert "create credential github" in result.stdout
    assert "create grant triage-widgets" in result.stdout


def test_export_suggests_a_secret_env_that_plan_accepts(cli: Cli) -> None:
    (exported,) = cli.ok(Call(("export",)))
    assert '# secret_env = "SECRET_GH"' in exported.splitlines()
    (cli.root / "exported.toml").write_text(exported.replace("# secret_env = ", "secret_env = "))
    result = cli.run(Call(("plan", "exported.toml"), env={"SECRET_GH": "sk-live-789"}))
    assert (result.returncode, result.stderr) == (1, "")
    assert result.stdout.startswith("update credential gh  secret: fp-")


def _run_on_a_terminal(cli: Cli, *args: str) -> list[str]:
    """`credproxy run` with a terminal for stdout: its lines up to proxy.started, then Ctrl-C."""
    ours, theirs = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CREDPROXY_")}
    env["CREDPROXY_DB"] = f"sqlite:///{cli.db_file}"
    env["CREDPROXY_KEY_FILE"] = str(cli.key_file)
    process = subprocess.Popen(
        [*COMMAND, "run", *args], cwd=cli.root, env=env, stdout=theirs, stderr=theirs
    )
    os.close(theirs)
    output = b""
    deadline = time.monotonic() + 60
    try:
        while b"proxy.started" not in output and time.monotonic() < deadline:
            if select.select([ours], [], [], 0.1)[0]:
                output += os.read(ours, 65536)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
        os.close(ours)
    return output.decode().replace("\r\n", "\n").splitlines()


def test_run_on_a_terminal_says_first_where_it_listens_and_what_to_trust(cli: Cli) -> None:
    first, started, *_ = _run_on_a_terminal(cli, "--listen", "127.0.0.1:0")
    (listen,) = json.loads(started)["listen"]
    assert first == (
        f"credproxy listening on {listen}; store sqlite:///{cli.db_file}; clients must trust "
        "certs/credproxy-ca.pem; Ctrl-C stops it. JSON lines follow."
    )


def test_run_with_workers_on_a_terminal_says_the_same_first(cli: Cli) -> None:
    args = ("--listen", "127.0.0.1:0", "--workers", "2", "--admin", "127.0.0.1:0")
    first, started, *_ = _run_on_a_terminal(cli, *args)
    supervisor = json.loads(started)
    assert len(supervisor["workers"]) == 2 and "worker" not in supervisor
    ((listen,), (admin,)) = supervisor["listen"], supervisor["admin"]
    assert first == (
        f"credproxy listening on {listen} (admin {admin}); store sqlite:///{cli.db_file}; "
        "clients must trust certs/credproxy-ca.pem; Ctrl-C stops it. JSON lines follow."
    )


def test_run_on_a_pipe_writes_json_lines_only(cli: Cli) -> None:
    with subprocess.Popen(
        [*COMMAND, "run", "--listen", "127.0.0.1:0"],
        cwd=cli.root,
        env={k: v for k, v in os.environ.items() if not k.startswith("CREDPROXY_")},
        stdout=subprocess.PIPE,
    ) as process:
        assert process.stdout is not None
        first = process.stdout.readline()
        process.send_signal(signal.SIGINT)
        process.wait(30)
    assert json.loads(first)["event"] == "proxy.started"


def test_arguments_are_checked_before_the_secret_is_read(cli: Cli) -> None:
    args = ("credential", "add", "x3", "--scheme", "bearer", "--host", "https://a.example.com")
    result = cli.run(Call(args, b""))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "credproxy: error: invalid host 'https://a.example.com': a host is expected, not a URL: "
        "use a.example.com\n"
    )


POLICY_GRANT = """\
[[principal]]
name = "agent"

[[grant]]
id = "g"
principal = "agent"
hosts = ["a.example.com"]
methods = ["{method}"]
{extra}"""


@pytest.mark.parametrize(
    ("extra", "status", "stderr"),
    [
        pytest.param(
            "",
            2,
            "credproxy: error: policy.toml:8: grant \"g\": method 'GTE' is not a registered HTTP "
            "method: did you mean 'GET'? (extension_methods = true allows others)\n",
            id="refused",
        ),
        pytest.param("extension_methods = true\n", 1, "", id="allowed by extension_methods"),
    ],
)
def test_a_policy_file_refuses_an_unregistered_method_unless_allowed(
    tmp_path: Path, extra: str, status: int, stderr: str
) -> None:
    fresh = Cli(tmp_path)
    fresh.ok(Call(("init",)))
    (tmp_path / "policy.toml").write_text(POLICY_GRANT.format(method="GTE", extra=extra))
    result = fresh.run(Call(("plan", "policy.toml")))
    assert (result.returncode, result.stderr) == (status, stderr)


def test_export_marks_a_grant_with_an_extension_method(tmp_path: Path) -> None:
    fresh = Cli(tmp_path)
    fresh.ok(Call(("init",)))
    fresh.ok(Call(("principal", "add", "agent")))
    fresh.ok(
        Call(
            (
                "grant",
                "add",
                "agent",
                "--host",
                "a.example.com",
                "--method",
                "FROBNICATE",
                "--extension-method",
            )
        )
    )
    (exported,) = fresh.ok(Call(("export", "--out", "exported.toml")))
    assert "extension_methods = true" in (tmp_path / "exported.toml").read_text().splitlines()
    result = fresh.run(Call(("plan", "exported.toml", "--prune")))
    assert (result.returncode, result.stdout, result.stderr) == (0, "no changes\n", "")
