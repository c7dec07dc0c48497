"""`credproxy console token`: issue, list and revoke the console operators' tokens."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.clihelp import Call, Cli


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Cli:
    cli = Cli(tmp_path_factory.mktemp("console"))
    cli.ok(Call(("init",)))
    return cli


def test_a_token_is_printed_once_listed_without_it_and_revoked(cli: Cli) -> None:
    added, plain = cli.ok(
        Call(("console", "token", "add", "alice", "--json")),
        Call(("console", "token", "add", "bob", "--expires", "2h")),
    )
    alice = json.loads(added)
    expires = datetime.fromisoformat(alice["expires_at"])
    assert timedelta(days=29) < expires - datetime.now(UTC) <= timedelta(days=30)
    assert plain.splitlines()[0] == "operator  bob"
    bob = plain.splitlines()[1].split()[1]
    store = cli.store()
    try:
        assert store.console_operator(alice["token"])[0] == "alice"  # type: ignore[index]
        assert store.console_operator(bob)[0] == "bob"  # type: ignore[index]
    finally:
        store.close()
    (listed,) = cli.ok(Call(("console", "token", "list", "--json")))
    rows = json.loads(listed)
    assert sorted((t["operator"], t["state"]) for t in rows) == [
        ("alice", "active"),
        ("bob", "active"),
    ]
    assert alice["token"] not in listed and bob not in listed
    (revoked,) = cli.ok(Call(("console", "token", "revoke", "alice")))
    assert revoked == "revoked 1 console token(s) of alice\n"
    (table,) = cli.ok(Call(("console", "token", "list")))
    assert {line.split()[1]: line.split()[-1] for line in table.splitlines()[1:]} == {
        "alice": "revoked",
        "bob": "active",
    }
    shown_once = cli.outputs[6:]  # after init's and the two adds' stdout and stderr
    assert not any(alice["token"].encode() in out or bob.encode() in out for out in shown_once)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(("add", "Alice"), "invalid operator name 'Alice'", id="a bad name"),
        pytest.param(("add", "carol", "--expires", "soon"), "invalid --expires", id="a bad expiry"),
        pytest.param(
            ("add", "carol", "--expires", "2020-01-01"), "in the past", id="a past expiry"
        ),
        pytest.param(("revoke", "nobody"), "'nobody' has no live console token", id="no such"),
    ],
)
def test_bad_input_is_one_line_and_status_2(cli: Cli, args: tuple[str, ...], message: str) -> None:
    result = cli.run(Call(("console", "token", *args)))
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr


def test_issuing_a_token_needs_the_stores_key(cli: Cli, tmp_path: Path) -> None:
    nokey = ("--key-file", str(tmp_path / "none.key"))
    result = cli.run(Call((*nokey, "console", "token", "add", "mallory")))
    assert result.returncode == 2 and "no master key" in result.stderr
