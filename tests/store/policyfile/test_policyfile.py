"""Reading a policy file: every problem named with its file and line, secrets never inline."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from store.errors import InvalidInput
from store.policyfile.parse import PolicyFileError, SecretSource, load
from tests.fakes import POLICY

GOOD = 'token_dir = "tokens"\n\n' + POLICY + "expires = 2027-01-31T00:00:00Z\n"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return path


def test_the_issues_example_reads_as_written(tmp_path: Path) -> None:
    policy = load(_write(tmp_path, GOOD))
    assert policy.problems == ()
    assert policy.token_dir == tmp_path / "tokens"
    assert [p.name for p in policy.principals] == ["agent"]
    (cred,) = policy.credentials
    assert (cred.name, cred.scheme, cred.hosts) == ("github", "bearer", ("api.github.com",))
    assert cred.source == SecretSource(env="GITHUB_TOKEN")
    (grant,) = policy.grants
    assert (grant.key, grant.principal, grant.credential) == ("triage-widgets", "agent", "github")
    assert (grant.methods, grant.paths) == (("GET",), ("/repos/acme/widgets/issues",))
    assert grant.expires_at == datetime(2027, 1, 31, tzinfo=UTC)
    assert grant.line == 12


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            GOOD.replace('methods = ["GET"]', 'methods = ["get"]'),
            "policy.toml:16: grant \"triage-widgets\": invalid method 'get'; methods are "
            "case-sensitive, did you mean 'GET'?",
            id="a lower-case method names the line and suggests the upper-case one",
        ),
        pytest.param(
            GOOD.replace('secret_env = "GITHUB_TOKEN"', 'secret = "ghp_inline"'),
            'policy.toml:10: credential "github": an inline secret is not allowed',
            id="an inline secret is refused where it stands",
        ),
        pytest.param(
            GOOD.replace('name = "agent"', 'nmae = "agent"'),
            "policy.toml:4: principal #1: unknown key 'nmae'; did you mean 'name'?",
            id="an unknown key suggests the known one",
        ),
        pytest.param(
            GOOD.replace("expires = 2027-01-31T00:00:00Z", 'expires = "30d"'),
            "policy.toml:19: grant \"triage-widgets\": expires '30d' must be an instant",
            id="a relative expiry is refused: it would move at every apply",
        ),
        pytest.param(
            GOOD.replace('methods = ["GET"]', 'methods = "GET"'),
            'policy.toml:16: grant "triage-widgets": methods must be a list',
            id="a string where a list belongs",
        ),
        pytest.param(
            GOOD.replace('paths = ["/repos/acme/widgets/issues"]', 'paths = ["/v1/**"]'),
            'policy.toml:17: grant "triage-widgets": invalid path',
            id="a path pattern the CLI refuses is refused here too",
        ),
        pytest.param(
            GOOD + '\n[[grant]]\nid = "triage-widgets"\nprincipal = "agent"\n'
            'hosts = ["a.example"]\nmethods = ["GET"]\n',
            'policy.toml:21: grant "triage-widgets": declared twice (first at line 12)',
            id="a grant id declared twice",
        ),
        pytest.param(
            GOOD.replace('secret_env = "GITHUB_TOKEN"', 'secret_env = "A"\nsecret_file = "b"'),
            'policy.toml:11: credential "github": give secret_env or secret_file, not both',
            id="two secret sources",
        ),
        pytest.param(
            GOOD.replace(
                'secret_env = "GITHUB_TOKEN"',
                'secret_env = "GITHUB_TOKEN"\nplaceholder_env = "NOT-A-NAME"',
            ),
            'policy.toml:11: credential "github": invalid variable name',
            id="a placeholder that is no variable name",
        ),
        pytest.param(
            "[[grant]\nid = 1\n",
            "policy.toml:1: invalid TOML",
            id="a file that is not TOML names the line",
        ),
        pytest.param(
            GOOD + '\n[[grant]]\nid = "open"\nprincipal = "agent"\nmethods = ["GET"]\n',
            'policy.toml:21: grant "open": a grant without a credential needs hosts',
            id="a pass-through grant without hosts",
        ),
        pytest.param(
            GOOD.replace('purpose = "triage', 'encoded_slash = true\npurpose = "triage'),
            "policy.toml:16: grant \"triage-widgets\": encoded_slash only changes what a '*' "
            "segment matches",
            id="encoded_slash without a star path is refused as the CLI refuses it",
        ),
    ],
)
def test_a_problem_names_file_line_and_field(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    try:
        problems = load(path).problems
    except PolicyFileError as e:
        problems = tuple(e.problems)
    shown = [p.replace(str(path), "policy.toml") for p in problems]
    assert any(p.startswith(expected) for p in shown), shown


def test_a_credentials_placeholder_variable_is_one_of_its_options(tmp_path: Path) -> None:
    text = GOOD.replace(
        'secret_env = "GITHUB_TOKEN"', 'secret_env = "GITHUB_TOKEN"\nplaceholder_env = "GH_TOKEN"'
    )
    (credential,) = load(_write(tmp_path, text)).credentials
    assert credential.options == {"placeholder_env": "GH_TOKEN"}


def test_every_problem_is_reported_in_one_run(tmp_path: Path) -> None:
    text = GOOD.replace('methods = ["GET"]', 'methods = ["get"]').replace(
        'name = "agent"', 'name = "Agent"'
    )
    problems = load(_write(tmp_path, text)).problems
    assert len(problems) == 2
    assert "invalid principal name 'Agent'" in problems[0]
    assert "invalid method 'get'" in problems[1]


def test_secret_sources_read_env_and_file_and_refuse_missing_or_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CP_TEST_SECRET", "ghp_from_env\n")
    assert SecretSource(env="CP_TEST_SECRET").read().reveal() == b"ghp_from_env"
    secret_file = tmp_path / "s"
    secret_file.write_bytes(b"ghp_from_file\n")
    assert SecretSource(file=secret_file).read().reveal() == b"ghp_from_file"
    monkeypatch.setenv("CP_TEST_EMPTY", "")
    for source, message in [
        (SecretSource(env="CP_TEST_UNSET_NEVER"), "the variable secret_env names is not set"),
        (SecretSource(env="CP_TEST_EMPTY"), "the secret is empty"),
        (SecretSource(file=tmp_path / "absent"), "No such file"),
    ]:
        with pytest.raises(InvalidInput, match=message):
            source.read()
