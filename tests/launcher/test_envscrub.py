"""The contained environment: a property over generated environments, and a table of shapes."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from addon.launcher.envscrub import scrub, secret_name, secret_value

# No letter that any name rule needs can appear: these names are never secret-shaped.
SAFE_NAME_CHARS = "BFGHIJLMNQRUVWXYZbfghijlmnqruvwxyz0123456789_"
# Neither '-', ':', '_' nor 'A', 'J', 'K': no value shape can form from these.
SAFE_VALUE_CHARS = string.ascii_lowercase + string.digits + "BCDEFGHILMNOPQRSTUVWXYZ" + " /.,=+%"
REAL_NAMES = [
    "PATH",
    "HOME",
    "LANG",
    "TERM",
    "SHELL",
    "USER",
    "PWD",
    "EDITOR",
    "LC_ALL",
    "HOSTNAME",
    "XDG_RUNTIME_DIR",
    "PYTHONPATH",
    "GOPATH",
    "NODE_OPTIONS",
    "JAVA_HOME",
    "TMPDIR",
    "VIRTUAL_ENV",
    "COLUMNS",
    "DISPLAY",
    "http_proxy",
    "NO_PROXY",
    "SSL_CERT_FILE",
]
REAL_VALUES = [
    "/usr/local/bin:/usr/bin:/bin",
    "en_US.UTF-8",
    "xterm-256color",
    "https://example.com/a?b=c",
    "git@github.com:acme/widgets.git",
    "task-0123456789abcdefghijkl",
    "http://localhost:3000",
    "sk-short",
    "eyJhbGciOi",
    "AKIA",
    "1234-5678",
    "/home/me/.ssh/known_hosts",
    "",
]
MARKERS = ["KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH"]


def _random_case(draw: st.DrawFn, text: str) -> str:
    return "".join(c.lower() if draw(st.booleans()) else c for c in text)


safe_text = st.text(SAFE_NAME_CHARS, max_size=8)
safe_name = st.one_of(
    st.sampled_from(REAL_NAMES), st.text(SAFE_NAME_CHARS, min_size=1, max_size=12)
)
safe_value = st.one_of(st.sampled_from(REAL_VALUES), st.text(SAFE_VALUE_CHARS, max_size=40))
b64url = st.text(string.ascii_letters + string.digits + "_-", min_size=4, max_size=30)
alnum = string.ascii_letters + string.digits


@st.composite
def secret_names(draw: st.DrawFn) -> str:
    how = draw(st.sampled_from(["part", "prefix", "suffix"]))
    if how == "part":
        return (
            draw(safe_text) + _random_case(draw, draw(st.sampled_from(MARKERS))) + draw(safe_text)
        )
    if how == "prefix":
        return _random_case(draw, draw(st.sampled_from(["AWS_", "CREDPROXY_"]))) + draw(safe_text)
    return draw(safe_text) + _random_case(draw, draw(st.sampled_from(["_PAT", "_DSN"])))


@st.composite
def secret_values(draw: st.DrawFn) -> str:
    shapes = [
        "sk-" + draw(st.text(alnum + "_-", min_size=16, max_size=40)),
        "sk-ant-api03-" + draw(st.text(alnum, min_size=16, max_size=40)),
        draw(st.sampled_from("pousr")).join(["gh", "_"])
        + draw(st.text(alnum, min_size=36, max_size=40)),
        "github_pat_" + draw(st.text(alnum + "_", min_size=22, max_size=60)),
        "xox"
        + draw(st.sampled_from("abpr"))
        + "-"
        + draw(st.text(alnum + "-", min_size=8, max_size=40)),
        draw(st.sampled_from(["AKIA", "ASIA"]))
        + draw(st.text(string.ascii_uppercase + string.digits, min_size=16, max_size=16)),
        "eyJ" + draw(b64url) + ".eyJ" + draw(b64url) + "." + draw(b64url),
        "-----BEGIN "
        + draw(st.sampled_from(["", "RSA ", "EC ", "OPENSSH ", "ENCRYPTED "]))
        + "PRIVATE KEY-----\nMIIE"
        + draw(b64url),
        draw(st.sampled_from(["https", "postgresql+psycopg", "redis", "git+ssh"]))
        + "://"
        + draw(st.text(alnum, min_size=1, max_size=8))
        + draw(st.sampled_from(["", ":" + draw(st.text(alnum, min_size=1, max_size=12))]))
        + "@host.example/db",
    ]
    shape = draw(st.sampled_from(shapes))
    # Embedded anywhere a word can start: alone, or after a separator.
    return (
        draw(st.sampled_from(["", "x ", "Bearer ", "a,", "/p="]))
        + shape
        + draw(st.sampled_from(["", " tail", "\n", ";more"]))
    )


@st.composite
def environments(draw: st.DrawFn) -> tuple[dict[str, str], set[str], set[str]]:
    """(environment, secret-shaped names, names kept on purpose)."""
    env: dict[str, str] = {}
    secret: set[str] = set()
    for _ in range(draw(st.integers(0, 25))):
        kind = draw(st.sampled_from(["plain", "name", "value", "both"]))
        name = draw(secret_names() if kind in ("name", "both") else safe_name)
        value = draw(secret_values() if kind in ("value", "both") else safe_value)
        if name in env:
            continue
        env[name] = value
        if kind != "plain":
            secret.add(name)
    keep = set(draw(st.lists(st.sampled_from(sorted(env)), unique=True))) if env else set()
    return env, secret, keep


@given(environments())
def test_nothing_secret_shaped_survives_and_nothing_else_is_removed(case) -> None:
    env, secret, keep = case
    kept, removed = scrub(env, keep)
    assert removed == sorted(secret - keep)
    assert kept == {n: v for n, v in env.items() if n not in secret or n in keep}
    for name, value in kept.items():
        assert name in keep or not (secret_name(name) or secret_value(value))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("OPENAI_API_KEY", "dummy", id="a KEY name"),
        pytest.param("github_token", "x", id="a lower-case token name"),
        pytest.param("DB_PASSWD", "x", id="a PASSWD name"),
        pytest.param("SSH_AUTH_SOCK", "/tmp/agent", id="an AUTH name (the ssh agent)"),
        pytest.param("AWS_REGION", "eu-west-1", id="every AWS_ variable"),
        pytest.param("CREDPROXY_DB", "sqlite:///credproxy.db", id="credproxy's own settings"),
        pytest.param("GITLAB_PAT", "x", id="a _PAT suffix"),
        pytest.param("SENTRY_DSN", "x", id="a _DSN suffix"),
        pytest.param("NOTE", "sk-proj-abcdefghijklmnop1234", id="an OpenAI key as a value"),
        pytest.param("X", "ghp_" + "a" * 36, id="a GitHub token as a value"),
        pytest.param("X", "xoxb-1234-abcd", id="a Slack token"),
        pytest.param("X", "AKIAIOSFODNN7EXAMPLE", id="an AWS access key id"),
        pytest.param("X", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig", id="a JWT"),
        pytest.param("X", "-----BEGIN PRIVATE KEY-----\nMII", id="a PEM private key"),
        pytest.param("PIP_INDEX_URL", "https://u:p@pypi.example/simple", id="a URL with userinfo"),
        pytest.param("DB_PASS", "x", id="a PASS name"),
        pytest.param("MYSQL_PWD", "x", id="a _PWD name, but not PWD itself"),
        pytest.param("SESSION_COOKIE", "x", id="a COOKIE name"),
        pytest.param("MSSQL_CONN", "x", id="a _CONN name"),
        pytest.param("V", "sk_live_" + "a" * 24, id="a Stripe key"),
        pytest.param("V", "glpat-" + "a" * 20, id="a GitLab token"),
        pytest.param("V", "hf_" + "a" * 34, id="a Hugging Face token"),
        pytest.param("V", "AIza" + "a" * 35, id="a Google API key"),
        pytest.param("V", "npm_" + "a" * 36, id="an npm token"),
        pytest.param("V", "xapp-1-abcdefgh", id="a Slack app token"),
        pytest.param("V", "-----BEGIN PGP PRIVATE KEY BLOCK-----", id="a PGP private key"),
        pytest.param("V", "-----BEGIN private KEY-----", id="a PEM header in lower case"),
        pytest.param("V", "Server=db;Password=Hunter2!", id="a connection string's password"),
        pytest.param("V", "DefaultEndpointsProtocol=https;AccountKey=abc", id="an account key"),
        pytest.param("V", "Authorization: Bearer abc", id="a header line"),
    ],
)
def test_secret_shapes_are_removed_by_name_or_value(name: str, value: str) -> None:
    assert scrub({name: value, "PATH": "/bin"}) == ({"PATH": "/bin"}, [name])


def test_a_kept_name_stays_whatever_its_shape() -> None:
    assert scrub({"SSH_AUTH_SOCK": "/tmp/a"}, keep={"SSH_AUTH_SOCK"}) == (
        {"SSH_AUTH_SOCK": "/tmp/a"},
        [],
    )


def test_the_shells_working_directory_is_not_a_password() -> None:
    assert scrub({"PWD": "/home/me", "OLDPWD": "/tmp"}) == (
        {"PWD": "/home/me", "OLDPWD": "/tmp"},
        [],
    )
