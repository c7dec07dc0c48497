"""The `credproxy` entry point (`addon.cli:main`), run as a subprocess.

Each start costs a second or two of imports, so independent commands run concurrently and one
store, set up the way an operator would, serves most tests.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import shutil
import socket
import stat
import subprocess
import tomllib
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from cryptography import x509
from sqlalchemy import select

from addon.cli.cli import build_parser
from store.db.models import Principal
from store.repository import Store
from tests.clihelp import ADVERTISE, COMMAND, Call, Cli

WRONG_KEY = base64.b64encode(bytes(range(32))).decode()
# Where CREDPROXY_* point when a command must find its locations through flags instead.
NOWHERE = {
    "CREDPROXY_DB": "sqlite:///nowhere/x.db",
    "CREDPROXY_KEY_FILE": "nowhere.key",
    "CREDPROXY_CERTS": "nowhere",
}


def _token_hashes(store: Store) -> list[tuple[str, str]]:
    """Each live principal's token hash, which no listing shows."""
    query = (
        select(Principal.name, Principal.token_hash)
        .where(Principal.disabled_at.is_(None))
        .order_by(Principal.name)
    )
    with store.engine.connect() as connection:
        return [(name, token_hash) for name, token_hash in connection.execute(query)]


def _state(cli: Cli) -> tuple[Any, ...]:
    store = cli.store()
    try:
        return (
            store.change_counter(),
            _token_hashes(store),
            [(c.name, c.fingerprint, c.hosts) for c in store.list_credentials()],
            store.list_grants(),
        )
    finally:
        store.close()


# -- one store, set up through the CLI ------------------------------------------------


class Secrets(NamedTuple):
    bearer: bytes
    rotated: bytes
    header: bytes
    basic: bytes
    query: bytes


@dataclass
class Session:
    cli: Cli
    first_init: str
    second_init: dict[str, Any]
    key_before: bytes
    ca_before: bytes
    principal: dict[str, Any]
    grant: dict[str, Any]
    credentials: list[dict[str, Any]]
    grants: list[dict[str, Any]]
    secrets: Secrets


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Session:
    cli = Cli(tmp_path_factory.mktemp("cli"))
    tag = secrets.token_hex(8)
    # '+', '/', '=' and '&' make the URL-encoded forms differ from the plaintext.
    sec = Secrets(
        bearer=f"sk-LEAKCHECK-{tag}-bearer+/=".encode(),
        rotated=f"sk-LEAKCHECK-{tag}-rotated+/=".encode(),
        header=f"sk-LEAKCHECK-{tag}-header".encode(),
        basic=f"leakuser:sk-LEAKCHECK-{tag}-basic".encode(),
        query=f"sk-LEAKCHECK-{tag}-query&x=1".encode(),
    )
    (first_init,) = cli.ok(Call(("init",)))
    key_before = cli.key_file.read_bytes()
    ca_before = (cli.root / "certs" / "credproxy-ca.pem").read_bytes()
    second_init, principal, *_ = cli.ok(
        # Flags before the subcommand win over CREDPROXY_*.
        Call((*cli.flags, "init", "--json"), env=NOWHERE),
        Call(("principal", "add", "agent", "--json")),
        Call(
            ("credential", "add", "gh", "--scheme", "bearer", "--host", "api.github.com"),
            sec.bearer + b"\n",
        ),
        Call(
            (
                "credential",
                "add",
                "ex",
                "--scheme",
                "header",
                "--header",
                "X-Api-Key",
                "--host",
                "*.example.com",
                "--host",
                "example.com:8443",
            ),
            sec.header,
        ),
        Call(
            ("credential", "add", "basic", "--scheme", "basic", "--host", "registry.example.org"),
            sec.basic + b"\r\n",
        ),
        Call(
            (
                "credential",
                "add",
                "maps",
                "--scheme",
                "query",
                "--param",
                "key",
                "--host",
                "maps.example.org",
            ),
            sec.query + b"\n",
        ),
    )
    grant, _ = cli.ok(
        Call(
            (
                "grant",
                "add",
                "agent",
                "--credential",
                "gh",
                "--method",
                "GET",
                "--method",
                "POST",
                "--path",
                "/repos/*/issues",
                "--expires",
                "2h",
                "--purpose",
                "triage",
                "--json",
            )
        ),
        Call(("credential", "rotate", "gh"), sec.rotated + b"\n"),
    )
    # ...and so do flags after it.
    cli.ok(Call(("key", "rotate", *cli.flags), env=NOWHERE))
    credentials, grants = cli.ok(
        Call(("credential", "list", "--json", *cli.flags), env=NOWHERE),
        Call((*cli.flags[:2], "grant", "list", "--json", *cli.flags[2:]), env=NOWHERE),
    )
    return Session(
        cli=cli,
        first_init=first_init,
        second_init=json.loads(second_init),
        key_before=key_before,
        ca_before=ca_before,
        principal=json.loads(principal),
        grant=json.loads(grant),
        credentials=json.loads(credentials),
        grants=json.loads(grants),
        secrets=sec,
    )


def test_the_installed_credproxy_runs_the_main_these_tests_run() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"credproxy": "addon.cli.cli:main"}
    assert COMMAND[1:] == ["-m", "addon.cli.cli"]


def test_init_reports_what_it_created(session: Session) -> None:
    assert "(created)" in session.first_init
    assert str(session.cli.db_file) in session.first_init


def test_second_init_keeps_the_key_and_the_ca(session: Session) -> None:
    second = session.second_init
    assert (second["key_created"], second["ca_created"]) == (False, False)
    assert second["schema"] is not None
    assert second["key_source"] == f"key file {session.cli.key_file}"
    assert session.ca_before == (session.cli.root / "certs" / "credproxy-ca.pem").read_bytes()


def test_location_flags_win_before_and_after_the_subcommand(session: Session) -> None:
    # Had CREDPROXY_* been used, these commands would have failed or created `nowhere*`.
    assert sorted(p.name for p in session.cli.root.glob("nowhere*")) == []
    assert session.second_init["db"] == f"sqlite:///{session.cli.db_file}"
    assert session.cli.key_file.read_bytes() != session.key_before


def test_key_rotation_replaces_the_key_file_privately(session: Session) -> None:
    assert stat.S_IMODE(session.cli.key_file.stat().st_mode) == 0o600
    assert session.cli.key_file.read_bytes() != session.key_before
    assert not session.cli.root.joinpath("credproxy.key.new").exists()


def test_database_file_is_private(session: Session) -> None:
    assert stat.S_IMODE(session.cli.db_file.stat().st_mode) == 0o600


def test_init_creates_a_ca_and_a_private_bundle(session: Session) -> None:
    certs = session.cli.root / "certs"
    public = (certs / "credproxy-ca.pem").read_bytes()
    assert b"PRIVATE KEY" not in public
    cert = x509.load_pem_x509_certificate(public)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign is True
    bundle = certs / "mitmproxy-ca.pem"
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in bundle.read_bytes()
    assert x509.load_pem_x509_certificate(bundle.read_bytes()) == cert


def test_principal_add_prints_the_token_and_proxy_url(session: Session) -> None:
    p = session.principal
    assert p["name"] == "agent"
    assert len(p["token"]) >= 22
    assert p["proxy_url"] == f"http://agent:{p['token']}@{ADVERTISE}"


def test_credentials_of_every_scheme_are_listed(session: Session) -> None:
    listed = {c["name"]: c for c in session.credentials}
    assert {n: (c["scheme"], c["header"], c["param"]) for n, c in listed.items()} == {
        "basic": ("basic", None, None),
        "ex": ("header", "X-Api-Key", None),
        "gh": ("bearer", None, None),
        "maps": ("query", None, "key"),
    }
    assert listed["ex"]["hosts"] == ["*.example.com", "example.com:8443"]
    assert listed["gh"]["rotated_at"] is not None
    assert len({c["fingerprint"] for c in session.credentials}) == 4


def test_secrets_read_from_stdin_open_under_the_rotated_key(session: Session) -> None:
    store = session.cli.store()
    try:
        store.check_ready()
        opened = {n: c.secret.reveal() for n, c in store.snapshot().credentials.items()}
    finally:
        store.close()
    sec = session.secrets
    # One trailing newline (LF or CRLF) is stripped, nothing more.
    assert opened == {"gh": sec.rotated, "ex": sec.header, "basic": sec.basic, "maps": sec.query}


def test_grant_add_returns_its_id(session: Session) -> None:
    (grant,) = session.grants
    assert session.grant["id"] == grant["id"]
    assert session.grant["expires_at"] is not None
    assert (grant["credential"], grant["methods"], grant["paths"], grant["purpose"]) == (
        "gh",
        ["GET", "POST"],
        ["/repos/*/issues"],
        "triage",
    )
    assert grant["state"] == "active"


def _forms(secret: bytes) -> dict[str, bytes]:
    forms = {
        "plaintext": secret,
        "base64": base64.b64encode(secret),
        "urlsafe base64": base64.urlsafe_b64encode(secret),
        "URL-encoded": urllib.parse.quote(secret, safe="").encode(),
        "hex": secret.hex().encode(),
    }
    if b":" in secret:
        password = secret.split(b":", 1)[1]
        forms |= {"password": password, "base64 password": base64.b64encode(password)}
    return forms


def test_no_secret_leaks_into_the_database_or_any_output(session: Session) -> None:
    cli = session.cli
    files = {
        path.name: path.read_bytes()
        for suffix in ("", "-wal", "-shm", "-journal")
        if (path := Path(f"{cli.db_file}{suffix}")).exists()
    }
    assert files[cli.db_file.name]
    haystacks = files | {f"output {i}": out for i, out in enumerate(cli.outputs)}
    for secret in session.secrets:
        for form_name, form in _forms(secret).items():
            for where, data in haystacks.items():
                assert form not in data, f"{form_name} of a secret found in {where}"
    token = session.principal["token"].encode()
    for where, data in files.items():
        assert token not in data, f"principal token found in {where}"


# -- bad input -------------------------------------------------------------------------


class Bad(NamedTuple):
    args: tuple[str, ...]
    says: tuple[str, ...]
    stdin: bytes = b"s3cret"
    env: dict[str, str] = {}


GRANT = ("grant", "add", "agent", "--credential", "gh", "--method", "GET")
CRED = ("credential", "add", "new", "--scheme", "bearer")
UNREACHABLE = "postgresql+psycopg://user:hunter2pw@127.0.0.1:1/x"

BAD_INPUT = {
    "unknown principal": Bad(
        ("grant", "add", "nobody", "--credential", "gh", "--method", "GET"), ("'nobody'",)
    ),
    "unknown credential": Bad(
        ("grant", "add", "agent", "--credential", "nope", "--method", "GET"), ("'nope'",)
    ),
    "grant host outside the credential's hosts": Bad(
        (*GRANT, "--host", "evil.example.net"), ("outside", "evil.example.net")
    ),
    "invalid host": Bad((*CRED, "--host", "exa mple.com"), ("invalid host",)),
    "wildcard over a TLD": Bad((*CRED, "--host", "*.com"), ("public suffix",)),
    "path without a leading slash": Bad((*GRANT, "--path", "v1"), ("invalid path pattern",)),
    "path with an empty segment": Bad((*GRANT, "--path", "/a//b"), ("invalid path pattern",)),
    "path with a dot-dot segment": Bad((*GRANT, "--path", "/a/../b"), ("invalid path pattern",)),
    "path with a dot-dot part beside %2F": Bad(
        (*GRANT, "--path", "/a%2F.."), ("invalid path pattern", "between two names")
    ),
    "encoded slash without a star path": Bad(
        (*GRANT, "--encoded-slash", "--path", "/@s%2Fn"), ("--encoded-slash", "no --path has one")
    ),
    "lower-case method": Bad(
        ("grant", "add", "agent", "--credential", "gh", "--method", "get"), ("invalid method",)
    ),
    "empty secret": Bad((*CRED, "--host", "a.example.com"), ("empty",), stdin=b""),
    "secret with CRLF inside": Bad(
        (*CRED, "--host", "a.example.com"), ("control characters",), b"tok\r\nX-Evil: 1\n"
    ),
    "duplicate principal": Bad(("principal", "add", "agent"), ("already exists",)),
    "duplicate credential": Bad(
        ("credential", "add", "gh", "--scheme", "bearer", "--host", "api.github.com"),
        ("already exists",),
    ),
    "expiry in the past": Bad((*GRANT, "--expires", "2000-01-01T00:00:00Z"), ("past",)),
    "a token budget without a window": Bad(
        (*GRANT, "--budget", "total=1000"), ("invalid --budget 'total=1000'",)
    ),
    "a grant's budget neither given nor cleared": Bad(
        ("grant", "budget", "1"), ("give --budget (repeatable), --[no-]cap-max-tokens or --clear",)
    ),
    "a cap of max_tokens without a budget": Bad(
        (*GRANT, "--cap-max-tokens"), ("--cap-max-tokens needs an output or total --budget",)
    ),
    "a cap of max_tokens with only an input budget": Bad(
        (*GRANT, "--cap-max-tokens", "--budget", "input=5/day"),
        ("--cap-max-tokens needs an output or total --budget",),
    ),
    "a budget cleared and capped at once": Bad(
        ("grant", "budget", "1", "--clear", "--cap-max-tokens"), ("--clear", "alone")
    ),
    "a token budget twice for one window": Bad(
        (*GRANT, "--budget", "total=5/day", "--budget", "total=9/day"), ("--budget", "twice")
    ),
    "wrong master key": Bad(
        ("principal", "add", "eve"),
        ("CREDPROXY_MASTER_KEY", "is not the key"),
        env={"CREDPROXY_MASTER_KEY": WRONG_KEY},
    ),
    "key file readable by others": Bad(
        ("principal", "add", "eve", "--key-file", "loose.key"), ("loose.key", "mode 644")
    ),
    "a URL for a credential's host": Bad(
        (*CRED, "--host", "https://api.github.com"),
        ("'https://api.github.com': a host is expected, not a URL: use api.github.com",),
    ),
    "a URL for a grant's host": Bad(
        (*GRANT, "--host", "https://user:hunter2pw@API.github.com:8443/repos"),
        ("not a URL: use api.github.com:8443",),
    ),
    "unreachable database": Bad(
        ("principal", "list", "--db", UNREACHABLE), ("cannot reach database", "127.0.0.1:1")
    ),
    "a secret on the principal command line": Bad(
        ("principal", "add", "eve", "--secret", "x"), ("unrecognized arguments",)
    ),
}


@dataclass
class Outcomes:
    results: dict[str, subprocess.CompletedProcess[str]]
    before: tuple[Any, ...]
    after: tuple[Any, ...]


def test_grant_add_budget_is_listed_and_usage_shows_what_remains(session: Session) -> None:
    root = session.cli.root.parent / "budget"
    root.mkdir()
    cli = Cli(root)
    for name in ("credproxy.db", "credproxy.key"):
        shutil.copy2(session.cli.root / name, root / name)
    (added,) = cli.ok(
        Call((*GRANT, "--budget", "total=200000/day", "--budget", "output=5000/hour", "--json"))
    )
    grant_id = json.loads(added)["id"]
    (listed, usage, table) = cli.ok(
        Call(("grant", "list", "--json")), Call(("usage", "--json")), Call(("usage",))
    )
    (row,) = [g for g in json.loads(listed) if g["id"] == grant_id]
    assert row["budget"] == "output=5000/hour, total=200000/day"
    assert [(u["grant"], u["budget"], u["used"], u["remaining"]) for u in json.loads(usage)] == [
        (grant_id, "output/hour", 0, 5000),
        (grant_id, "total/day", 0, 200000),
    ]
    assert table.splitlines()[0].split()[:4] == ["grant", "principal", "state", "budget"]
    (raised,) = cli.ok(
        Call(("grant", "budget", str(grant_id), "--budget", "total=400000/day", "--json"))
    )
    (usage,) = cli.ok(Call(("usage", "--json")))
    assert json.loads(raised) == {"id": grant_id, "budget": "total=400000/day"}
    assert [(u["budget"], u["limit"]) for u in json.loads(usage)] == [("total/day", 400000)]
    assert row["cap_max_tokens"] is False


def test_a_grant_caps_max_tokens_and_keeps_the_cap_when_its_budget_is_raised(
    session: Session,
) -> None:
    root = session.cli.root.parent / "cap"
    root.mkdir()
    cli = Cli(root)
    for name in ("credproxy.db", "credproxy.key"):
        shutil.copy2(session.cli.root / name, root / name)
    (added,) = cli.ok(Call((*GRANT, "--budget", "output=500/day", "--cap-max-tokens", "--json")))
    grant_id = str(json.loads(added)["id"])

    def shown() -> tuple[str | None, bool]:
        (listed,) = cli.ok(Call(("grant", "list", "--json")))
        (row,) = [g for g in json.loads(listed) if str(g["id"]) == grant_id]
        return row["budget"], row["cap_max_tokens"]

    assert shown() == ("output=500/day, max_tokens capped", True)
    (raised,) = cli.ok(Call(("grant", "budget", grant_id, "--budget", "output=900/day")))
    assert raised.strip() == f"grant {grant_id} budget: output=900/day, max_tokens capped"
    cli.ok(Call(("grant", "budget", grant_id, "--no-cap-max-tokens")))
    assert shown() == ("output=900/day", False)
    cli.ok(Call(("grant", "budget", grant_id, "--cap-max-tokens")))
    assert shown() == ("output=900/day, max_tokens capped", True)
    cli.ok(Call(("grant", "budget", grant_id, "--clear")))
    assert shown() == (None, False)


@pytest.fixture(scope="module")
def bad(session: Session) -> Iterator[Outcomes]:
    """Every bad command, run concurrently against the session's store."""
    cli = session.cli
    loose = cli.root / "loose.key"
    shutil.copyfile(cli.key_file, loose)
    loose.chmod(0o644)
    before = _state(cli)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {
            name: pool.submit(cli.run, Call(bad.args, bad.stdin, bad.env))
            for name, bad in BAD_INPUT.items()
        }
        results = {name: f.result() for name, f in futures.items()}
    yield Outcomes(results, before, _state(cli))
    loose.unlink()


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in BAD_INPUT])
def test_bad_input_is_one_line_and_status_2(bad: Outcomes, name: str) -> None:
    result = bad.results[name]
    assert "Traceback" not in result.stderr
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("credproxy: error: ")
    for phrase in BAD_INPUT[name].says:
        assert phrase in line


def test_unreachable_database_is_named_without_its_password(bad: Outcomes) -> None:
    assert not any("hunter2pw" in r.stderr for r in bad.results.values())
    stderr = bad.results["unreachable database"].stderr
    assert "user:***@127.0.0.1:1/x" in stderr


def test_failed_commands_leave_the_store_unchanged(bad: Outcomes) -> None:
    _, principals, credentials, grants = bad.after
    assert bad.after == bad.before
    assert [p[0] for p in principals] == ["agent"]
    assert [c[0] for c in credentials] == ["basic", "ex", "gh", "maps"]
    assert len(grants) == 1


def test_an_expiry_past_the_year_9999_is_one_line(session: Session) -> None:
    result = session.cli.run(Call((*GRANT, "--expires", "9999-12-31T23:59:59-01:00")))
    assert (result.returncode, result.stdout) == (2, "")
    (line,) = result.stderr.splitlines()
    assert line.startswith("credproxy: error: ") and "too far away" in line


# -- numbers: never NaN, never negative, infinite only where stated ----------------------------

BAD_NUMBERS = {
    "max-stale nan": (("run", "--max-stale", "nan"), "--max-stale"),
    "max-stale inf": (("run", "--max-stale", "inf"), "--max-stale"),
    "max-stale overflowing to inf": (("run", "--max-stale", "1e999"), "--max-stale"),
    "max-stale negative": (("run", "--max-stale", "-1"), "--max-stale"),
    "alert-streak zero": (("run", "--alert-streak", "0"), "--alert-streak"),
    "alert-streak negative": (("run", "--alert-streak", "-3"), "--alert-streak"),
    "alert-streak fractional": (("run", "--alert-streak", "2.5"), "--alert-streak"),
    "alert-streak in other digits": (("run", "--alert-streak", "\u0663"), "--alert-streak"),
    "grant id negative": (("grant", "revoke", "-1"), "id"),
    "grant id zero": (("grant", "revoke", "0"), "id"),
    "grant id past BIGINT": (("grant", "revoke", "99999999999999999999"), "id"),
    "request id past BIGINT": (("request", "approve", "99999999999999999999"), "id"),
    "request id not a number": (("request", "deny", "nan"), "id"),
}


@pytest.fixture(scope="module")
def bad_numbers(session: Session) -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {
            name: pool.submit(session.cli.run, Call(args))
            for name, (args, _) in BAD_NUMBERS.items()
        }
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in BAD_NUMBERS])
def test_a_bad_number_is_one_line_and_status_2(
    bad_numbers: dict[str, subprocess.CompletedProcess[str]], name: str
) -> None:
    result = bad_numbers[name]
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    (line,) = result.stderr.splitlines()
    assert "error:" in line and BAD_NUMBERS[name][1] in line


# -- stores this CLI must not touch ----------------------------------------------------------

COMMANDS_ON_A_STORE = {
    "run": ("run", "--listen", "127.0.0.1:0"),
    "principal list": ("principal", "list"),
    "principal add": ("principal", "add", "agent2"),
    "grant list": ("grant", "list"),
    "grant revoke": ("grant", "revoke", "1"),
    "request list": ("request", "list"),
    "key rotate": ("key", "rotate"),
}


@pytest.fixture(scope="module")
def missing_store(session: Session) -> tuple[Cli, dict[str, subprocess.CompletedProcess[str]]]:
    """Every command against a store whose file was deleted (the key and CA remain)."""
    root = session.cli.root.parent / "deleted-store"
    root.mkdir()
    cli = Cli(root)
    shutil.copyfile(session.cli.key_file, cli.key_file)
    cli.key_file.chmod(0o600)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {n: pool.submit(cli.run, Call(a)) for n, a in COMMANDS_ON_A_STORE.items()}
        return cli, {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in COMMANDS_ON_A_STORE])
def test_only_init_creates_a_store(
    missing_store: tuple[Cli, dict[str, subprocess.CompletedProcess[str]]], name: str
) -> None:
    cli, results = missing_store
    result = results[name]
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    (line,) = result.stderr.splitlines()
    assert line == f"credproxy: error: no store at {cli.db_file}: run credproxy init"
    assert not cli.db_file.exists()


def test_grant_add_encoded_slash_is_listed(session: Session) -> None:
    root = session.cli.root.parent / "encoded-slash"
    root.mkdir()
    cli = Cli(root)
    for name in ("credproxy.db", "credproxy.key"):
        shutil.copy2(session.cli.root / name, root / name)
    (added,) = cli.ok(
        Call((*GRANT, "--path", "/@s%2fn/-/", "--path", "/*", "--encoded-slash", "--json"))
    )
    (listed,) = cli.ok(Call(("grant", "list", "--json")))
    (row,) = [g for g in json.loads(listed) if g["id"] == json.loads(added)["id"]]
    assert (row["paths"], row["encoded_slash"]) == (["/*", "/@s%2Fn/-/"], True)
    (table,) = cli.ok(Call(("grant", "list")))
    assert "encoded_slash" in table.splitlines()[0]


@pytest.fixture(scope="module")
def newer_store(session: Session) -> dict[str, subprocess.CompletedProcess[str]]:
    """A copy of the session's store whose schema a newer credproxy wrote."""
    root = session.cli.root.parent / "newer-store"
    root.mkdir()
    cli = Cli(root)
    for name in ("credproxy.db", "credproxy.key"):
        shutil.copy2(session.cli.root / name, root / name)
    store = cli.store()
    with store.engine.begin() as connection:
        connection.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    store.close()
    commands = {
        "init": ("init",),
        "run": ("run", "--listen", "127.0.0.1:0"),
        "grant list": ("grant", "list"),
    }
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {n: pool.submit(cli.run, Call(a)) for n, a in commands.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", ["init", "run", "grant list"])
def test_a_newer_schema_is_one_line_for_every_command(
    newer_store: dict[str, subprocess.CompletedProcess[str]], name: str
) -> None:
    result = newer_store[name]
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("credproxy: error: ")
    assert "is at schema 9999, newer than this credproxy's" in line


def test_run_on_an_address_in_use_is_one_line(session: Session) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = session.cli.run(Call(("run", "--listen", f"127.0.0.1:{port}")))
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"credproxy: error: cannot listen on --listen 127.0.0.1:{port}")


# -- the CLI a newcomer meets (issue 16) --------------------------------------------------

BAD_DB: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "two slashes": (
        {"--db": "sqlite://credproxy.db"},
        ("--db: invalid database URL 'sqlite://credproxy.db'", "(sqlite:///credproxy.db)"),
    ),
    "a path and no scheme, from the environment": (
        {"CREDPROXY_DB": "credproxy.db"},
        ("CREDPROXY_DB: invalid database URL 'credproxy.db': use sqlite:///PATH",),
    ),
    "an in-memory database": ({"--db": "sqlite://"}, ("in-memory",)),
    "another database": ({"--db": "mysql://u@db/x"}, ("unsupported database 'mysql://u@db/x'",)),
    "another driver": ({"--db": "sqlite+pysqlcipher:///x.db"}, ("unsupported database driver",)),
    "a port that is no number": (
        {"--db": "postgresql://u:hunter2pw@db:port/x"},
        ("invalid database URL 'postgresql://u:***@db:port/x'",),
    ),
    "a port out of range": (
        {"CREDPROXY_DB": "postgresql://u:hunter2pw@db:99999/x"},
        ("CREDPROXY_DB: invalid database URL", "invalid port 99999"),
    ),
}


@pytest.fixture(scope="module")
def bad_db(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Cli, Any]]:
    """`init` (the one command that creates) and a read-only command, each in an empty dir."""
    calls = {}
    for name, (where, _) in BAD_DB.items():
        for command in (("init",), ("principal", "list")):
            cli = Cli(tmp_path_factory.mktemp("bad-db"))
            flag = ("--db", where["--db"]) if "--db" in where else ()
            env = {k: v for k, v in where.items() if k != "--db"}
            calls[name, command[0]] = cli, Call((*command, *flag), env=env)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {key: pool.submit(cli.run, call) for key, (cli, call) in calls.items()}
        return {key: (calls[key][0], f.result()) for key, f in futures.items()}


@pytest.mark.parametrize("command", ["init", "principal"])
@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in BAD_DB])
def test_a_bad_database_url_is_one_line_and_creates_nothing(
    bad_db: dict[tuple[str, str], tuple[Cli, Any]], name: str, command: str
) -> None:
    cli, result = bad_db[name, command]
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("credproxy: error: ")
    for phrase in BAD_DB[name][1]:
        assert phrase in line
    assert "hunter2pw" not in line
    assert list(cli.root.iterdir()) == []


READ_ONLY = {
    "principal list": ("principal", "list"),
    "credential list": ("credential", "list"),
    "grant list": ("grant", "list"),
    "request list": ("request", "list"),
}


@dataclass
class WithoutKey:
    cli: Cli
    results: dict[str, subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def without_key(session: Session) -> WithoutKey:
    """A copy of the session's store with a once-grant more, then its key file taken away."""
    cli = Cli(session.cli.root.parent / "without-key")
    cli.root.mkdir()
    for name in ("credproxy.db", "credproxy.key"):
        shutil.copy2(session.cli.root / name, cli.root / name)
    cli.ok(
        Call(
            (
                "grant",
                "add",
                "agent",
                "--credential",
                "ex",
                "--host",
                "eu.example.com",
                "--method",
                "GET",
                "--once",
            )
        )
    )
    cli.key_file.unlink()
    calls = (
        {name: Call(args) for name, args in READ_ONLY.items()}
        | {f"{name} --json": Call((*args, "--json")) for name, args in READ_ONLY.items()}
        | {
            "--json grant list": Call(("--json", "grant", "list")),
            "missing store": Call(("principal", "list", "--db", "sqlite:///other.db")),
            "a write": Call(("principal", "add", "eve")),
        }
    )
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {name: pool.submit(cli.run, call) for name, call in calls.items()}
        return WithoutKey(cli, {name: f.result() for name, f in futures.items()})


@pytest.mark.parametrize("name", [*READ_ONLY, *(f"{n} --json" for n in READ_ONLY)])
def test_read_only_commands_need_no_key(without_key: WithoutKey, name: str) -> None:
    result = without_key.results[name]
    assert (result.returncode, result.stderr) == (0, "")
    if name.endswith("--json"):
        assert isinstance(json.loads(result.stdout), list)
    assert not without_key.cli.key_file.exists()


def test_a_read_only_command_on_a_missing_store_creates_nothing(without_key: WithoutKey) -> None:
    result = without_key.results["missing store"]
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "credproxy: error: no store at other.db: run credproxy init\n"
    assert not (without_key.cli.root / "other.db").exists()
    assert not without_key.cli.key_file.exists()


def test_a_write_still_needs_the_key(without_key: WithoutKey) -> None:
    result = without_key.results["a write"]
    assert result.returncode == 2
    assert "no master key" in result.stderr


def test_grant_list_shows_the_credentials_hosts_and_yes_or_no(without_key: WithoutKey) -> None:
    header, *rows = without_key.results["grant list"].stdout.splitlines()
    columns = header.split()
    table = [dict(zip(columns, row.split(), strict=False)) for row in rows]
    assert [(r["credential"], r["hosts"], r["once"]) for r in table] == [
        ("gh", "api.github.com", "no"),
        ("ex", "eu.example.com", "yes"),
    ]


def test_grant_list_json_keeps_its_types_before_and_after_the_command(
    without_key: WithoutKey,
) -> None:
    after = json.loads(without_key.results["grant list --json"].stdout)
    before = json.loads(without_key.results["--json grant list"].stdout)
    assert before == after
    assert [(g["hosts"], g["once"]) for g in after] == [(None, False), (["eu.example.com"], True)]


def _helps(parser: argparse.ArgumentParser, path: str = "credproxy") -> Iterator[tuple[str, Any]]:
    """(where, help) of every option, argument, command and subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield f"{path} {action.metavar}", action.help
            for choice in action._choices_actions:
                yield f"{path} {choice.dest}", choice.help
            for name, sub in action.choices.items():
                yield from _helps(sub, f"{path} {name}")
        else:
            yield f"{path} {action.option_strings or action.dest}", action.help


def test_every_command_and_argument_has_help_text() -> None:
    helps = list(_helps(build_parser()))
    assert len(helps) > 100
    missing = [where for where, text in helps if not text or text == argparse.SUPPRESS]
    assert missing == []


@pytest.fixture(scope="module")
def top_level(session: Session) -> dict[str, subprocess.CompletedProcess[str]]:
    calls = {
        "help": Call(("--help",)),
        "version": Call(("--version",)),
        "principal help": Call(("principal", "--help")),
        "list help": Call(("grant", "list", "--help")),
    }
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {name: pool.submit(session.cli.run, call) for name, call in calls.items()}
        return {name: f.result() for name, f in futures.items()}


def test_the_top_level_help_lists_every_command_and_the_global_options(
    top_level: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    result = top_level["help"]
    assert (result.returncode, result.stderr) == (0, "")
    (commands,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"run", "demo", "init", "principal", "grant"} <= set(commands.choices)
    for choice in commands._choices_actions:
        line = rf"^    {choice.dest} +{re.escape(str(choice.help))}$"
        assert re.search(line, result.stdout, re.M)
    for option in ("--db URL", "--key-file FILE", "--certs DIR", "--json", "--version"):
        assert option in result.stdout
    for name in ("principal help", "list help"):
        assert top_level[name].returncode == 0
    assert re.search(r"^    list +live principals$", top_level["principal help"].stdout, re.M)
    assert "--db URL" in top_level["list help"].stdout


def test_version(top_level: dict[str, subprocess.CompletedProcess[str]]) -> None:
    result = top_level["version"]
    version = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert result.returncode == 0
    assert result.stdout.startswith(f"credproxy {version['project']['version']} (mitmproxy 1")
