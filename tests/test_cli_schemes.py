"""`credential add | list | rotate` for the sigv4 and path schemes, through the real entry point:
JSON secrets on stdin, checked in one line with exit 2 and nothing stored, scopes derived."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.clihelp import Call, Cli

KEY_ID = "AKIA" + secrets.token_hex(8).upper()
SECRET_KEY = "real/" + secrets.token_urlsafe(30)
TOKEN = "FwoG" + secrets.token_urlsafe(60)
ROTATED_KEY = "rotated/" + secrets.token_urlsafe(30)
KEYS = json.dumps({"access_key_id": KEY_ID, "secret_access_key": SECRET_KEY})
WITH_TOKEN = json.dumps(
    {"access_key_id": KEY_ID, "secret_access_key": ROTATED_KEY, "session_token": TOKEN},
    indent=2,  # as jq prints it: whitespace between the fields is JSON too
)
TG_TOKEN = "123456:" + secrets.token_urlsafe(24)
SIGV4 = ("credential", "add", "--scheme", "sigv4")
ROLE = "arn:aws:iam::123456789012:role/agent"


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Cli:
    cli = Cli(tmp_path_factory.mktemp("schemes"))
    cli.ok(Call(("init",)))
    (cli.root / "policy.json").write_text('{\n  "Version": "2012-10-17", "Statement": []\n}\n')
    (cli.root / "bad-policy.json").write_text("Version: 2012")
    role = ("--assume-role", ROLE, "--external-id", "ext-1", "--session-policy", "policy.json")
    cli.ok(
        Call((*SIGV4, "role", "--host", "sqs.eu-west-1.amazonaws.com", *role), KEYS.encode()),
        Call(
            (
                *SIGV4,
                "aws",
                "--host",
                "bedrock-runtime.us-east-1.amazonaws.com",
                "--host",
                "mybucket.s3.eu-west-1.amazonaws.com",
                "--host",
                "sts.amazonaws.com",
            ),
            KEYS.encode() + b"\n",
        ),
        Call(
            (
                *SIGV4,
                "gw",
                "--host",
                "api.internal.example",
                "--service",
                "execute-api",
                "--region",
                "eu-west-2",
            ),
            KEYS.encode(),
        ),
        Call(
            (
                "credential",
                "add",
                "tg",
                "--scheme",
                "path",
                "--host",
                "api.telegram.org",
                "--placeholder",
                "CREDPROXY_TELEGRAM",
                "--position",
                "/bot{}",
                "--position",
                "/file/bot{}",
            ),
            TG_TOKEN.encode(),
        ),
    )
    cli.ok(Call(("credential", "rotate", "aws"), WITH_TOKEN.encode()))
    return cli


def test_list_shows_region_service_and_the_key_ids_last_four(cli: Cli) -> None:
    (out,) = cli.ok(Call(("credential", "list", "--json")))
    listed = {c["name"]: c for c in json.loads(out)}
    assert (listed["aws"]["region"], listed["aws"]["service"]) == (
        "eu-west-1,us-east-1",
        "bedrock,s3,sts",
    )
    assert listed["aws"]["access_key_id"] == "…" + KEY_ID[-4:]
    assert (listed["gw"]["region"], listed["gw"]["service"]) == ("eu-west-2", "execute-api")
    assert listed["role"]["assume_role"] == ROLE
    assert listed["tg"]["placeholder"] == "CREDPROXY_TELEGRAM"
    assert listed["tg"]["positions"] == ["/bot{}", "/file/bot{}"]
    (table,) = cli.ok(Call(("credential", "list")))
    assert "bedrock,s3,sts" in table and "…" + KEY_ID[-4:] in table


def test_the_rotated_json_secret_is_stored_compact(cli: Cli) -> None:
    store = cli.store()
    try:
        opened = store.snapshot().credentials
    finally:
        store.close()
    assert json.loads(opened["aws"].secret.reveal()) == json.loads(WITH_TOKEN)
    assert b"\n" not in opened["aws"].secret.reveal()
    assert opened["tg"].secret.reveal() == TG_TOKEN.encode()


BAD = {
    "malformed JSON": ((*SIGV4, "b1", "--host", "sts.amazonaws.com"), b'{"access_key_id": '),
    "not an object": ((*SIGV4, "b2", "--host", "sts.amazonaws.com"), b'["AKIA"]'),
    "a missing field": (
        (*SIGV4, "b3", "--host", "sts.amazonaws.com"),
        json.dumps({"access_key_id": KEY_ID}).encode(),
    ),
    "an unknown field": (
        (*SIGV4, "b4", "--host", "sts.amazonaws.com"),
        json.dumps(
            {"access_key_id": KEY_ID, "secret_access_key": SECRET_KEY, SECRET_KEY: "x"}
        ).encode(),
    ),
    "a field twice": (
        (*SIGV4, "b5", "--host", "sts.amazonaws.com"),
        (
            f'{{"access_key_id": "{KEY_ID}", "secret_access_key": "{SECRET_KEY}", '
            '"secret_access_key": "x"}'
        ).encode(),
    ),
    "a key id that is not one": (
        (*SIGV4, "b6", "--host", "sts.amazonaws.com"),
        json.dumps({"access_key_id": "akia" + SECRET_KEY, "secret_access_key": "x"}).encode(),
    ),
    "a host whose service cannot be told": (
        (*SIGV4, "b7", "--host", "sqs.example.com"),
        KEYS.encode(),
    ),
    "a region that is not one": (
        (*SIGV4, "b8", "--host", "sts.amazonaws.com", "--region", "mars"),
        KEYS.encode(),
    ),
    "a region flag for another scheme": (
        (
            "credential",
            "add",
            "b9",
            "--scheme",
            "bearer",
            "--host",
            "a.example",
            "--region",
            "us-east-1",
        ),
        b"sk-" + SECRET_KEY.encode(),
    ),
    "a path credential without a position": (
        (
            "credential",
            "add",
            "b10",
            "--scheme",
            "path",
            "--host",
            "a.example",
            "--placeholder",
            "CREDPROXY_X1",
        ),
        TG_TOKEN.encode(),
    ),
    "a position without {}": (
        (
            "credential",
            "add",
            "b11",
            "--scheme",
            "path",
            "--host",
            "a.example",
            "--placeholder",
            "CREDPROXY_X1",
            "--position",
            "/bot",
        ),
        TG_TOKEN.encode(),
    ),
    "a path secret that would need escaping": (
        (
            "credential",
            "add",
            "b12",
            "--scheme",
            "path",
            "--host",
            "a.example",
            "--placeholder",
            "CREDPROXY_X1",
            "--position",
            "/bot{}",
        ),
        b"a/b" + SECRET_KEY.encode(),
    ),
    "a role that is no role ARN": (
        (*SIGV4, "b13", "--host", "sts.amazonaws.com", "--assume-role", "arn:aws:iam::1:user/x"),
        KEYS.encode(),
    ),
    "an external id without a role": (
        (*SIGV4, "b14", "--host", "sts.amazonaws.com", "--external-id", "ext-1"),
        KEYS.encode(),
    ),
    "a session policy that is not JSON": (
        (*SIGV4, "b15", "--host", "sts.amazonaws.com", "--assume-role", ROLE)
        + ("--session-policy", "bad-policy.json"),
        KEYS.encode(),
    ),
    "a session policy file that is not there": (
        (*SIGV4, "b16", "--host", "sts.amazonaws.com", "--assume-role", ROLE)
        + ("--session-policy", "missing.json"),
        KEYS.encode(),
    ),
    "rotating a sigv4 credential to a bad secret": (
        ("credential", "rotate", "aws"),
        json.dumps({"secret_access_key": SECRET_KEY}).encode(),
    ),
}


@pytest.fixture(scope="module")
def refused(cli: Cli) -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {name: pool.submit(cli.run, Call(*call)) for name, call in BAD.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_exit_2_and_nothing_stored(
    cli: Cli, refused: dict[str, subprocess.CompletedProcess[str]], name: str
) -> None:
    result = refused[name]
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1
    assert result.stderr.startswith("credproxy: error: ")
    assert "Traceback" not in result.stderr


def test_refusals_name_flags_and_store_nothing(
    cli: Cli, refused: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    assert "--service" in refused["a host whose service cannot be told"].stderr
    assert (
        "--region does not go with --scheme bearer"
        in refused["a region flag for another scheme"].stderr
    )
    (out,) = cli.ok(Call(("credential", "list", "--json")))
    assert sorted(c["name"] for c in json.loads(out)) == ["aws", "gw", "role", "tg"]
    store = cli.store()
    try:
        (role,) = [c for c in store.list_credentials() if c.name == "role"]
    finally:
        store.close()
    assert role.options["session_policy"] == '{"Version":"2012-10-17","Statement":[]}'
    assert role.options["external_id"] == "ext-1"


def test_no_secret_in_any_output(cli: Cli, refused) -> None:
    text = b"".join(cli.outputs)
    for secret in (SECRET_KEY, ROTATED_KEY, TOKEN, KEY_ID, TG_TOKEN):
        assert secret.encode() not in text
