"""What a new user trips over first (issue 36): each answer's exact line and status."""

from __future__ import annotations

import json
import os
import subprocess

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
