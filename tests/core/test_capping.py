"""A model call's output limit capped to what the budget leaves: the body rewritten, or refused."""

from __future__ import annotations

import json
import math

import pytest

from addon.core import capping
from addon.core.capping import Exhausted, Uncappable, cap
from store.rules.budgets import TokenLimit

OUTPUT = TokenLimit("output", 1000, "day")
TOTAL = TokenLimit("total", 100000, "day")
INPUT = TokenLimit("input", 100000, "day")
CHAT = "/v1/chat/completions"


def _left(output: int | None = None, total: int | None = None) -> list[tuple[TokenLimit, int]]:
    left = [(INPUT, 5)]  # never what a cap is taken from
    if output is not None:
        left.append((OUTPUT, output))
    if total is not None:
        left.append((TOTAL, total))
    return left


def _capped(path: str, body: object, **left: int) -> dict[str, object]:
    out: dict[str, object] = json.loads(cap(path, json.dumps(body).encode(), _left(**left)).body)
    return out


@pytest.mark.parametrize(
    ("path", "asked", "forwarded"),
    [
        pytest.param(CHAT, {"max_tokens": 1000}, {"max_tokens": 100}, id="chat max_tokens"),
        pytest.param(
            CHAT,
            {"max_completion_tokens": 1000},
            {"max_completion_tokens": 100},
            id="chat max_completion_tokens",
        ),
        pytest.param(
            CHAT,
            {"max_tokens": 1000, "max_completion_tokens": 500},
            {"max_tokens": 100, "max_completion_tokens": 100},
            id="chat with both: both capped",
        ),
        pytest.param(CHAT, {}, {"max_completion_tokens": 100}, id="chat without one gets one"),
        pytest.param(
            CHAT, {"max_tokens": None}, {"max_tokens": 100}, id="chat null means no limit"
        ),
        pytest.param(CHAT, {"max_tokens": 30}, {"max_tokens": 30}, id="a smaller ask is kept"),
        pytest.param(
            "/v1/responses",
            {"max_output_tokens": 4096},
            {"max_output_tokens": 100},
            id="responses",
        ),
        pytest.param("/v1/responses", {}, {"max_output_tokens": 100}, id="responses, none"),
        pytest.param("/v1/messages", {"max_tokens": 1000}, {"max_tokens": 100}, id="messages"),
        pytest.param("/v1/completions", {"max_tokens": 500}, {"max_tokens": 100}, id="legacy"),
        pytest.param(
            "/openai/deployments/d/chat/completions",
            {"max_tokens": 500},
            {"max_tokens": 100},
            id="an Azure deployment's chat/completions",
        ),
    ],
)
def test_the_output_limit_is_capped_to_what_the_output_budget_leaves(
    path: str, asked: dict[str, object], forwarded: dict[str, object]
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **asked}
    assert _capped(path, body, output=100) == body | forwarded


def test_only_the_limit_changes_every_other_byte_stays_as_sent() -> None:
    body = b'{ "model" :"m",\n "temperature": 1.0000, "x": "\\u00e9\xc3\xa9", "max_tokens":  900 }'
    capped = cap(CHAT, body, _left(output=100))
    assert capped.body == body.replace(b"900", b"100") and capped.max_tokens == 100
    added = cap(CHAT, b'{"model": "m"}', _left(output=7)).body
    assert added == b'{"max_completion_tokens": 7,"model": "m"}'
    assert cap(CHAT, b" {} ", _left(output=7)).body == b' {"max_completion_tokens": 7} '


def test_a_repeated_key_is_capped_wherever_it_occurs() -> None:
    body = b'{"max_tokens": 900, "model": "m", "max_tokens": 50}'
    assert cap(CHAT, body, _left(output=100)).body == (
        b'{"max_tokens": 50, "model": "m", "max_tokens": 50}'
    )


def test_a_total_budget_leaves_what_is_left_less_the_input_estimate() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 400}]})
    estimate = math.ceil(len(body) / 4)
    capped = cap(CHAT, body.encode(), _left(total=estimate + 60))
    assert capped.max_tokens == 60
    # The tighter of the two wins.
    assert cap(CHAT, body.encode(), _left(output=50, total=estimate + 60)).max_tokens == 50
    assert cap(CHAT, body.encode(), _left(output=80, total=estimate + 60)).max_tokens == 60


def test_n_choices_share_what_is_left() -> None:
    assert _capped(CHAT, {"n": 4, "max_tokens": 1000}, output=100)["max_tokens"] == 25
    assert _capped(CHAT, {"n": None}, output=100)["max_completion_tokens"] == 100
    best = _capped("/v1/completions", {"n": 2, "best_of": 5}, output=100)
    assert best["max_tokens"] == 20


@pytest.mark.parametrize(
    ("left", "body"),
    [
        pytest.param(_left(output=0), b"{}", id="no output left"),
        pytest.param(_left(total=30), json.dumps({"p": "x" * 200}).encode(), id="input eats it"),
        pytest.param(_left(output=3), b'{"n": 4}', id="less than one token a choice"),
    ],
)
def test_too_little_left_is_exhausted_naming_the_limit(
    left: list[tuple[TokenLimit, int]], body: bytes
) -> None:
    with pytest.raises(Exhausted) as e:
        cap(CHAT, body, left)
    assert e.value.limit in (OUTPUT, TOTAL)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/embeddings", b'{"input": "x"}', id="an API without an output limit"),
        pytest.param("/v1/messages/batches", b'{"requests": []}', id="a batch"),
        pytest.param(CHAT, b"model=m&max_tokens=9", id="not JSON"),
        pytest.param(CHAT, b'[{"max_tokens": 9}]', id="not an object"),
        pytest.param(CHAT, b'{"max_tokens": 9} {}', id="two documents"),
        pytest.param(CHAT, b'{"max_tokens": 9', id="cut short"),
        pytest.param(CHAT, b'{"max_tokens": 9,}', id="a trailing comma"),
        pytest.param(CHAT, b'{"max_tokens": NaN}', id="NaN"),
        pytest.param(CHAT, b'{"max_tokens": 1e9}', id="a limit that is not whole"),
        pytest.param(CHAT, b'{"max_tokens": "9"}', id="a limit as a string"),
        pytest.param(CHAT, b'{"max_tokens": true}', id="a limit as a boolean"),
        pytest.param(CHAT, b'{"max_tokens": -1}', id="a negative limit"),
        pytest.param(CHAT, b'{"n": 0}', id="no choices"),
        pytest.param(CHAT, b'{"m": "\xff"}', id="not UTF-8"),
        pytest.param(CHAT, b"\xef\xbb\xbf{}", id="a byte order mark"),
        pytest.param(CHAT, b'{"a":' * 100000 + b"1" + b"}" * 100000, id="nested too deeply"),
    ],
)
def test_a_body_that_cannot_be_capped_with_certainty_is_refused(path: str, body: bytes) -> None:
    with pytest.raises(Uncappable):
        cap(path, body, _left(output=100))


def test_a_budget_with_neither_output_nor_total_cannot_cap() -> None:
    with pytest.raises(Uncappable):
        cap(CHAT, b"{}", [(INPUT, 100)])


def test_the_api_is_told_by_the_path_alone() -> None:
    assert capping.api_of("/v1/chat/completions") is capping.CHAT
    assert capping.api_of("/v1/completions") is capping.COMPLETIONS
    assert capping.api_of("/v1/models") is None


def test_every_output_limit_key_the_body_holds_is_capped_whatever_the_path_names() -> None:
    """A server may read another API's key than the path suggests, or route the path without
    its case: each is capped all the same."""
    body = {"max_tokens": 1000, "max_completion_tokens": 900, "max_output_tokens": 800}
    got = _capped("/openai/deployments/x/Chat/Completions", body, output=100)
    assert got == {"max_tokens": 100, "max_completion_tokens": 100, "max_output_tokens": 100}
    assert _capped("/v1/Messages", {"max_tokens": 1000}, output=100) == {"max_tokens": 100}
