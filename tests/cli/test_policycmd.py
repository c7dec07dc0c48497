"""`credproxy plan | apply | export` as an operator runs them: exit codes, tokens, two shells."""

from __future__ import annotations

import json
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.clihelp import Call, Cli

SECRET = "ghp_POLICYCMD_secret_value"
ENV = {"CP_GITHUB": SECRET}
POLICY = """\
token_dir = "tokens"

[[principal]]
name = "agent"

[[credential]]
name = "github"
scheme = "bearer"
hosts = ["api.github.com"]
secret_env = "CP_GITHUB"

[[grant]]
id = "triage-widgets"
principal = "agent"
credential = "github"
methods = ["GET"]
paths = ["/repos/acme/widgets/issues"]
purpose = "triage widgets issues"
"""


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    cli = Cli(tmp_path)
    cli.ok(Call(("init",)))
    (tmp_path / "policy.toml").write_text(POLICY)
    return cli


def _no_secret_anywhere(cli: Cli) -> None:
    for output in cli.outputs:
        assert SECRET.encode() not in output


def test_plan_exits_1_on_drift_0_when_applied_and_apply_writes_tokens_privately(
    cli: Cli,
) -> None:
    plan = cli.run(Call(("plan", "policy.toml"), env=ENV))
    assert plan.returncode == 1, plan.stderr
    assert plan.stdout.splitlines()[0] == "create principal agent"
    applied = cli.run(Call(("apply", "policy.toml", "--yes"), env=ENV))
    assert applied.returncode == 0, applied.stderr
    token_file = cli.root / "tokens" / "agent.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert token and token not in applied.stdout  # written, never printed unless asked
    assert f"token of agent written to {Path('tokens/agent.token')}" in applied.stdout
    again = cli.run(Call(("plan", "policy.toml"), env=ENV))
    assert (again.returncode, again.stdout.strip()) == (0, "no changes")
    twice = cli.run(Call(("apply", "policy.toml", "--yes", "--json"), env=ENV))
    assert json.loads(twice.stdout) == {"applied": {"changes": [], "untouched": []}}
    _no_secret_anywhere(cli)


def test_a_bad_file_exits_2_names_every_problem_and_applies_nothing(cli: Cli) -> None:
    bad = POLICY.replace('["GET"]', '["get"]').replace('secret_env = "CP_GITHUB"', 'secret = "x"')
    (cli.root / "bad.toml").write_text(bad)
    for args in (("plan", "bad.toml"), ("apply", "bad.toml", "--yes")):
        result = cli.run(Call(args))
        assert result.returncode == 2
        lines = result.stderr.splitlines()
        assert len(lines) == 2, lines
        assert 'bad.toml:10: credential "github": an inline secret is not allowed' in lines[0]
        assert "bad.toml:16: grant \"triage-widgets\": invalid method 'get'" in lines[1]
        assert "Traceback" not in result.stderr
    assert cli.run(Call(("principal", "list", "--json"))).stdout.strip() == "[]"


def test_new_principals_need_a_place_for_their_tokens(cli: Cli) -> None:
    (cli.root / "policy.toml").write_text(POLICY.replace('token_dir = "tokens"\n', ""))
    refused = cli.run(Call(("apply", "policy.toml", "--yes"), env=ENV))
    assert refused.returncode == 2
    assert "need somewhere for their tokens" in refused.stderr
    assert cli.run(Call(("principal", "list", "--json"))).stdout.strip() == "[]"
    printed = cli.run(Call(("apply", "policy.toml", "--yes", "--print-tokens", "--json"), env=ENV))
    assert printed.returncode == 0, printed.stderr
    assert set(json.loads(printed.stdout)["tokens"]) == {"agent"}


def test_apply_without_yes_off_a_terminal_shows_the_plan_and_applies_nothing(cli: Cli) -> None:
    result = cli.run(Call(("apply", "policy.toml"), env=ENV))
    assert result.returncode == 2
    assert "create principal agent" in result.stdout
    assert "pass --yes" in result.stderr
    assert cli.run(Call(("principal", "list", "--json"))).stdout.strip() == "[]"


def test_export_then_apply_is_a_no_op(cli: Cli) -> None:
    cli.ok(Call(("apply", "policy.toml", "--yes"), env=ENV))
    cli.ok(
        Call(
            (
                "grant",
                "add",
                "agent",
                "--host",
                "example.com",
                "--method",
                "GET",
                "--path",
                "/v1/",
                "--once",
            )
        ),
    )
    exported = cli.run(Call(("export", "--out", "exported.toml")))
    assert exported.returncode == 0, exported.stderr
    assert stat.S_IMODE((cli.root / "exported.toml").stat().st_mode) == 0o600
    plan = cli.run(Call(("plan", "exported.toml", "--prune")))
    assert (plan.returncode, plan.stdout.strip()) == (0, "no changes"), plan.stdout
    _no_secret_anywhere(cli)


def test_two_shells_applying_at_once_never_leave_half_an_apply(cli: Cli, db_url: str) -> None:
    env = {"CREDPROXY_DB": db_url}
    cli.ok(Call(("init",), env=env))
    files = []
    for side in ("a", "b"):
        grants = "".join(
            f'\n[[grant]]\nid = "{side}{i}"\nprincipal = "agent"\ncredential = "github"\n'
            f'methods = ["GET"]\npaths = ["/{side}/{i}"]\n'
            for i in range(40)
        )
        (cli.root / f"{side}.toml").write_text(POLICY + grants)
        files.append(f"{side}.toml")
    calls = [Call(("apply", f, "--yes", "--json"), env=env | ENV) for f in files]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(cli.run, calls))
    succeeded = [r for r in results if r.returncode == 0]
    for r in results:
        assert r.returncode in (0, 2), r.stderr
        assert "Traceback" not in r.stderr
    listed = json.loads(cli.run(Call(("grant", "list", "--json"), env=env)).stdout)
    # Each apply is all or nothing: 40 grants of its own, and the shared one once.
    assert len(listed) == 1 + 40 * len(succeeded)
    assert len(succeeded) >= 1
    tokens = list((cli.root / "tokens").iterdir())
    assert [t.name for t in tokens] == ["agent.token"]


def test_the_master_key_file_is_no_secret_source_and_prune_needs_a_declaration(cli: Cli) -> None:
    leak = POLICY.replace('secret_env = "CP_GITHUB"', f'secret_file = "{cli.key_file}"')
    (cli.root / "leak.toml").write_text(leak)
    refused = cli.run(Call(("plan", "leak.toml")))
    assert refused.returncode == 2
    assert "may not be credproxy's master key file" in refused.stderr
    (cli.root / "empty.toml").write_text("# nothing\n")
    emptied = cli.run(Call(("apply", "empty.toml", "--prune", "--yes")))
    assert emptied.returncode == 2
    assert "declares nothing" in emptied.stderr
