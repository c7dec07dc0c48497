"""`credproxy policy suggest` as an operator runs it: its file goes through plan and apply as
it is; bad input is one line and exit status 2."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from store.crypto import Secret
from tests.clihelp import Call, Cli

SECRET = b"ghp_SUGGESTCMD_secret_value"
GH = "api.github.com"
UP = "uploads.github.com"


def _line(decision: str = "deny", grant: int | None = None, **fields: object) -> str:
    line = {
        "event": "request",
        "ts": "2026-12-07T10:00:00Z",
        "principal": "agent",
        "client": "127.0.0.1:5000",
        "host": GH,
        "port": 443,
        "method": "GET",
        "path": "/",
        "decision": decision,
        "reason": "no-grant" if decision == "deny" else None,
        "grant_id": grant,
    }
    return json.dumps(line | fields)


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Cli:
    cli = Cli(tmp_path_factory.mktemp("suggest"))
    cli.ok(Call(("init",)))
    return cli


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    cli = Cli(tmp_path)
    cli.ok(Call(("init",)))
    store = cli.store()  # the set-up in-process: the commands under test run as the CLI
    store.add_principal("agent")
    store.add_credential("github", "bearer", [GH, UP], Secret(SECRET))
    store.add_grant("agent", ["*"], credential="github", hosts=[GH])
    store.add_grant("agent", ["GET"], hosts=["pypi.org"])
    store.close()
    lines = [_line(host=UP, path=f"/orgs/acme/members/{i}", method="PUT") for i in range(1, 5)]
    lines += [_line("allow", 1, path=f"/repos/acme/app/pulls/{i}") for i in (10, 11, 12)]
    lines += ["{ torn line", _line(path="/x\x1b]0;owned\x07")]
    lines += [_line(host="evil.example", method="CONNECT", path=None)] * 2
    (tmp_path / "audit.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    return cli


def test_suggest_then_plan_then_apply_and_a_second_suggestion_has_nothing_to_add(
    cli: Cli,
) -> None:
    out = cli.ok(Call(("policy", "suggest", "audit.jsonl.gz", "--out", "s.toml")))[0]
    assert out == "wrote s.toml: 1 to add, 1 to narrow, 1 unused, 1 hosts refused at CONNECT\n"
    text = (cli.root / "s.toml").read_text()
    assert "# skipped: audit lines malformed: 1" in text
    assert "# skipped: audit lines not JSON: 1" in text
    assert "\x1b" not in text and "owned" not in text
    plan = cli.run(Call(("plan", "s.toml")))
    assert plan.returncode == 1, plan.stderr
    assert plan.stdout.splitlines()[:2] == [
        "create grant suggested-bf240df7c55e  principal=agent  credential=github  "
        "hosts=[uploads.github.com]  methods=[PUT]  paths=[/orgs/acme/members/*]  "
        "purpose=suggested from 4 denials",
        "update grant grant-1  methods: [*] -> [GET]  paths: [/] -> [/repos/acme/app/pulls/*]",
    ]
    cli.ok(Call(("apply", "s.toml", "--yes")))
    assert cli.run(Call(("plan", "s.toml"))).returncode == 0
    grants = json.loads(cli.ok(Call(("grant", "list", "--json")))[0])
    assert [(g["methods"], g["paths"]) for g in grants] == [
        (["GET"], ["/repos/acme/app/pulls/*"]),
        (["GET"], ["/"]),  # unused: listed, left alone
        (["PUT"], ["/orgs/acme/members/*"]),
    ]
    again = json.loads(cli.ok(Call(("policy", "suggest", "audit.jsonl.gz", "--json")))[0])
    assert (again["add"], again["narrow"]) == ([], [])
    assert again["skipped"]["denials an active grant now allows"] == 4
    for output in cli.outputs:
        assert SECRET not in output


def test_standard_input_and_json(cli: Cli) -> None:
    data = gzip.decompress((cli.root / "audit.jsonl.gz").read_bytes())
    args = ("policy", "suggest", "-", "--json", "--min-denials", "5", "--out", "s.toml")
    result = cli.run(Call(args, stdin=data))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["add"] == [] and out["skipped"]["denials below --min-denials"] == 4
    assert out["read"] == {
        "lines": 11,
        "requests": 10,
        "denials": 4,
        "uses": 3,
        "connects": 2,
    }
    assert out["hosts"] == [
        {
            "principal": "agent",
            "host": "evil.example",
            "credentials": [],
            "evidence": {
                "count": 2,
                "first": "2026-12-07T10:00:00Z",
                "last": "2026-12-07T10:00:00Z",
                "reasons": {},
                "examples": [],
            },
        }
    ]
    assert out["narrow"][0]["paths"] == {"before": ["/"], "after": ["/repos/acme/app/pulls/*"]}
    assert out["unused"] == [{"id": "grant-2", "grant": 2, "principal": "agent"}]
    assert out["policy"].startswith("# credproxy policy suggest: 0 to add, 1 to narrow")
    assert (cli.root / "s.toml").read_text() == out["policy"]


def test_pending_access_requests_are_evidence_with_requests(cli: Cli) -> None:
    with_store = cli.store()
    for _ in range(3):
        with_store.record_access_request("agent", "pypi.org", 443, "POST", "/legacy/")
    with_store.close()
    out = json.loads(cli.ok(Call(("policy", "suggest", "--requests", "--json")))[0])
    (added,) = out["add"]
    assert (added["hosts"], added["methods"], added["paths"]) == (
        ["pypi.org"],
        ["POST"],
        ["/legacy/"],
    )
    assert added["evidence"]["reasons"] == {"access-request": 3}
    assert (out["narrow"], out["unused"]) == ([], [])  # no audit read: no use evidence


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        pytest.param(("missing.jsonl",), b"", "cannot read missing.jsonl", id="a missing file"),
        pytest.param(
            ("-",), b"\x1f\x8b\x08junk", "standard input: not a whole gzip", id="bad gzip"
        ),
        pytest.param(("-",), b"a\nb\n", "not one line is JSON", id="not an audit"),
        pytest.param(("-", "--since", "soon"), b"", "invalid --since 'soon'", id="a bad --since"),
        pytest.param(("-", "-"), b"", "standard input (-) can be read once", id="stdin twice"),
        pytest.param(
            ("-", "--since", "1h", "--until", "2h"), b"", "--since must come before", id="window"
        ),
        pytest.param(("-", "--max-keys", "0"), b"", "--max-keys", id="no keys at all"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    bare: Cli, args: tuple[str, ...], stdin: bytes, message: str
) -> None:
    result = bare.run(Call(("policy", "suggest", *args), stdin=stdin))
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr
    assert result.stdout == ""
