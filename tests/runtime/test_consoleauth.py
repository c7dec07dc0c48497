"""The console's operators, sessions and same-origin check, without a server."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import pytest

from addon.runtime.config import parse_console
from addon.runtime.consoleauth import Operators, Sessions, csrf_ok, same_origin
from store.errors import InvalidInput

TOKEN = "a" * 32  # noqa: S105 - a test's own


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "operators"
    path.write_text(text)
    return str(path)


def test_operators_are_kept_as_digests_and_found_by_token(tmp_path: Path) -> None:
    operators = Operators.read(_file(tmp_path, f"# who\n\nalice:{TOKEN}\nbob:{'b' * 40}\n"))
    assert operators.operator(TOKEN) == "alice"
    assert operators.operator("b" * 40) == "bob"
    assert operators.operator("a" * 31) is None
    assert operators.operator("") is None
    assert TOKEN not in repr(operators)


def test_operators_may_come_from_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(f"ops:{TOKEN}\n".encode())))
    assert Operators.read("-").operator(TOKEN) == "ops"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        pytest.param("", "no NAME:TOKEN line", id="an empty file"),
        pytest.param(f"{TOKEN}\n", "line 1 is not NAME:TOKEN", id="a token without a name"),
        pytest.param("alice:short\n", "line 1 is not NAME:TOKEN", id="a short token"),
        pytest.param(f"al ice:{TOKEN}\n", "line 1", id="a name with a space"),
        pytest.param(f"alice:{TOKEN} x\n", "line 1", id="a token with a space"),
        pytest.param(f"a:{TOKEN}\na:{'c' * 32}\n", "named twice", id="one name twice"),
    ],
)
def test_a_bad_token_file_is_one_line_without_its_tokens(
    tmp_path: Path, text: str, said: str
) -> None:
    with pytest.raises(InvalidInput, match=said) as raised:
        Operators.read(_file(tmp_path, text))
    assert TOKEN not in str(raised.value) and "\n" not in str(raised.value)


def test_a_missing_token_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot read --console-token-file"):
        Operators.read(str(tmp_path / "absent"))


def test_a_huge_token_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="larger than"):
        Operators.read(_file(tmp_path, f"a:{TOKEN}\n" * 3000))


def _args(**given: object) -> argparse.Namespace:
    values: dict[str, object] = {"console": None, "console_token_file": None, "workers": 1}
    values.update(given)
    return argparse.Namespace(**values)


def test_the_console_is_off_by_default() -> None:
    assert parse_console(_args()) == (None, None)


def test_the_console_alone_signs_in_with_the_stores_tokens_only() -> None:
    assert parse_console(_args(console="127.0.0.1:0")) == (("127.0.0.1", 0), None)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        pytest.param({"console_token_file": "x"}, "needs --console", id="tokens alone"),
        pytest.param(
            {"console": "127.0.0.1:0", "console_token_file": "x", "workers": 2},
            "--workers",
            id="with workers",
        ),
        pytest.param(
            {"console": "nowhere", "console_token_file": "x"}, "invalid --console", id="no port"
        ),
    ],
)
def test_console_flags_are_checked_at_start(given: dict[str, object], said: str) -> None:
    with pytest.raises(InvalidInput, match=said):
        parse_console(_args(**given))


def test_sessions_are_bounded_oldest_out_first() -> None:
    sessions = Sessions(limit=2)
    first, _ = sessions.open("a")
    second, _ = sessions.open("b")
    third, _ = sessions.open("c")
    assert len(sessions) == 2
    assert sessions.find(first) is None
    assert sessions.find(second) is not None and sessions.find(third) is not None


def test_a_session_expires() -> None:
    sessions = Sessions(lifetime=0)
    cookie, _ = sessions.open("a")
    assert sessions.find(cookie) is None
    assert len(sessions) == 0


def test_the_csrf_token_is_the_sessions_own() -> None:
    sessions = Sessions()
    _, one = sessions.open("a")
    _, two = sessions.open("a")
    assert csrf_ok(one, one.csrf)
    assert not csrf_ok(one, two.csrf)
    assert not csrf_ok(one, "")


@pytest.mark.parametrize(
    ("headers", "ok"),
    [
        pytest.param({"host": "h:1", "origin": "http://h:1"}, True, id="its own origin"),
        pytest.param(
            {"host": "h:1", "origin": "http://h:1", "sec-fetch-site": "same-origin"},
            True,
            id="its own origin, fetch metadata agreeing",
        ),
        pytest.param({"host": "h:1", "origin": "http://h:2"}, False, id="another port"),
        pytest.param({"host": "h:1"}, False, id="no origin"),
        pytest.param({"origin": "http://h:1"}, False, id="no host"),
        pytest.param(
            {"host": "h:1", "origin": "http://h:1", "sec-fetch-site": "cross-site"},
            False,
            id="fetch metadata says cross-site",
        ),
        pytest.param(
            {"host": "h:1", "origin": "http://h:1", "sec-fetch-site": "none"},
            False,
            id="fetch metadata says typed by the user",
        ),
    ],
)
def test_same_origin(headers: dict[str, str], ok: bool) -> None:
    assert same_origin(headers) is ok
