"""Hostile input to the CLI, as a subprocess: every refusal is one line on stderr and status 2,
with nothing stored and no secret shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import CREDPROXY, _env

pytestmark = pytest.mark.e2e


@pytest.fixture
def cli_home(tmp_path: Path, initialised_home: Path) -> Path:
    import shutil

    shutil.copytree(initialised_home, tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        pytest.param(
            "--max-tunnels",
            "\u0663",
            id="--max-tunnels takes an Arabic-Indic digit",
        ),
        pytest.param(
            "--max-stale",
            "\u0661",
            id="--max-stale takes an Arabic-Indic digit",
        ),
        pytest.param(
            "--head-timeout",
            "1_0",
            id="--head-timeout takes 1_0 for ten",
        ),
        pytest.param(
            "--drain-timeout",
            "\uff15",
            id="--drain-timeout takes a fullwidth digit",
        ),
        pytest.param("--alert-streak", "\u0663", id="--alert-streak refuses a Unicode digit"),
        pytest.param("--idle-timeout", "nan", id="--idle-timeout refuses nan"),
        pytest.param("--max-connections", "0", id="--max-connections refuses zero"),
    ],
)
def test_run_refuses_a_number_that_is_not_plain_ascii(cli_home: Path, flag: str, value: str):
    """README: every numeric option is refused with one line and status 2 when it is not a
    plain ASCII number."""
    import subprocess

    args = [*CREDPROXY, "run", "--listen", "127.0.0.1:0", flag, value]
    process = subprocess.Popen(
        args, env=_env(cli_home), cwd=cli_home, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = process.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        process.terminate()
        out, err = process.communicate(timeout=10)
        pytest.fail(f"{flag} {value!r} was accepted: the proxy ran")
    assert process.returncode == 2
    assert len(err.decode().strip().splitlines()) == 1 and b"Traceback" not in err


# The 64 KiB bound counts the secret after its one trailing newline is stripped.
def test_a_64_kib_secret_with_its_trailing_newline_is_accepted(cli_home: Path):
    """README: one trailing newline is stripped; a secret may be at most 64 KiB."""
    import subprocess

    secret = b"s" * (64 * 1024) + b"\n"
    args = [*CREDPROXY, "credential", "add", "big", "--scheme", "bearer", "--host", "x.test"]
    done = subprocess.run(
        args, env=_env(cli_home), cwd=cli_home, input=secret, capture_output=True, timeout=20
    )
    assert done.returncode == 0, done.stderr.decode()


# The key cases use a command that needs the key: list commands read none.
@pytest.mark.parametrize(
    ("env", "args"),
    [
        pytest.param(
            {"CREDPROXY_MASTER_KEY": "!!!"}, ["principal", "add", "eve"], id="garbage key"
        ),
        pytest.param({"CREDPROXY_MASTER_KEY": "AAAA"}, ["principal", "add", "eve"], id="short key"),
        pytest.param(
            {"CREDPROXY_KEY_FILE": "/tmp"}, ["principal", "add", "eve"], id="key is a dir"
        ),
        pytest.param({"CREDPROXY_DB": "mysql://x/y"}, ["principal", "list"], id="foreign db"),
        pytest.param(
            {"CREDPROXY_DB": "postgresql://u:sekrit@127.0.0.1:1/db"},
            ["principal", "list"],
            id="unreachable pg, password not shown",
        ),
        pytest.param(
            {"CREDPROXY_DB": "sqlite:////nonexistent/dir/x.db"}, ["init"], id="db in no dir"
        ),
        pytest.param({}, ["grant", "revoke", "99999999999999999999"], id="id past BIGINT"),
        pytest.param(
            {}, ["grant", "add", "p", "--method", "GET", "--expires", "1e999s"], id="huge expiry"
        ),
    ],
)
def test_hostile_cli_input_gets_one_line_and_status_2(cli_home: Path, env, args):
    import subprocess

    before = sorted(p.name for p in cli_home.iterdir())
    done = subprocess.run(
        [*CREDPROXY, *args],
        env={**_env(cli_home), **env},
        cwd=cli_home,
        capture_output=True,
        timeout=20,
        stdin=subprocess.DEVNULL,
    )
    err = done.stderr.decode()
    assert done.returncode == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "sekrit" not in err
    assert sorted(p.name for p in cli_home.iterdir()) == before
