"""A model call's output limit capped to what its grant's budget has left (`--cap-max-tokens`).

`cap` rewrites the request body: the value of the API's output limit (OpenAI chat/completions
`max_completion_tokens` and `max_tokens`, completions `max_tokens`, responses
`max_output_tokens`, Anthropic messages `max_tokens`) becomes at most what the output limits
have left, and what the total limits have left less the estimate of the body's input; a body
without one gets one. Every other byte stays as sent: the top-level members of the JSON
object are located with the json module's own scanner, and only the limit's value replaced
(each time the key occurs: a provider may read the first or the last). What cannot be capped
with certainty is refused body-undecidable, never forwarded uncapped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from addon.core.reasons import Reason
from addon.core.usage import estimate
from store.rules.budgets import TokenLimit

MAX_CAPPED_BODY = 8 * 1024 * 1024  # bytes of a request body held to be capped
FLOOR = 1  # fewer tokens left than this for each choice: budget-exhausted


@dataclass(frozen=True, slots=True)
class Api:
    """Where one API keeps its output limit, and how many answers one request asks for."""

    keys: tuple[str, ...]  # the output limit's names; the first is added when none is given
    choices: tuple[str, ...] = ()  # each generates a limit's worth of tokens (OpenAI's n)


CHAT = Api(("max_completion_tokens", "max_tokens"), ("n",))
COMPLETIONS = Api(("max_tokens",), ("n", "best_of"))
RESPONSES = Api(("max_output_tokens",))
MESSAGES = Api(("max_tokens",))
# By the path's last segments, as the providers and the OpenAI-compatible servers name them.
APIS = (
    ("/chat/completions", CHAT),
    ("/completions", COMPLETIONS),
    ("/responses", RESPONSES),
    ("/messages", MESSAGES),
)


class Uncappable(Exception):
    """The body cannot be capped with certainty: refused body-undecidable."""

    reason = Reason.BODY_UNDECIDABLE

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Exhausted(Exception):
    """Less than FLOOR tokens left for each answer the request asks for."""

    def __init__(self, limit: TokenLimit, left: int) -> None:
        super().__init__(str(limit))
        self.limit = limit
        self.left = left


@dataclass(frozen=True, slots=True)
class Capped:
    body: bytes
    max_tokens: int  # the output limit forwarded (per answer, for n answers)


# Every API's output-limit keys: each one a body holds is capped, whichever API the path names,
# so that a server reading another key than the path suggests still finds it capped.
KEYS = frozenset(k for _, api in APIS for k in api.keys)


def api_of(path: str) -> Api | None:
    """The API a request path (without its query) names, its case ignored (some servers route
    without it); None for any other."""
    path = path.lower()
    for suffix, api in APIS:
        if path.endswith(suffix):
            return api
    return None


def room(left: Sequence[tuple[TokenLimit, int]], body_size: int) -> tuple[TokenLimit, int]:
    """The output tokens the tightest limit leaves: an output limit's left, a total limit's
    left less the input estimate. `left` holds the budget's limits with what they have left."""
    capping = [
        (limit, n - (estimate(body_size) if limit.kind == "total" else 0))
        for limit, n in left
        if limit.kind in ("output", "total")
    ]
    if not capping:
        raise Uncappable("the grant's budget has no output or total limit to cap max_tokens to")
    return min(capping, key=lambda c: c[1])


def cap(path: str, body: bytes, left: Sequence[tuple[TokenLimit, int]]) -> Capped:
    """The body with its output limit capped to what `left` leaves.

    Raises: Uncappable, Exhausted.
    """
    api = api_of(path)
    if api is None:
        raise Uncappable(
            "this grant caps max_tokens, and this is no chat/completions, completions, "
            "responses or messages call"
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Uncappable("the body is not UTF-8") from e
    start, members = _members(text)
    limit, tokens = room(left, len(body))
    choices = max([_whole(k, v, 1) or 1 for k, _, _, v in members if k in api.choices] or [1])
    each = tokens // choices
    if each < FLOOR:
        raise Exhausted(limit, tokens)
    asked = [_whole(k, v, 0) for k, _, _, v in members if k in KEYS]
    wanted = min([a for a in asked if a is not None] or [each])
    capped = min(wanted, each)
    spans = [(begin, end) for k, begin, end, _ in members if k in KEYS]
    if not spans:
        member = f'"{api.keys[0]}": {capped}' + ("," if members else "")
        return Capped((text[:start] + member + text[start:]).encode(), capped)
    out, at = [], 0
    for begin, end in spans:
        out += [text[at:begin], str(capped)]
        at = end
    out.append(text[at:])
    return Capped("".join(out).encode(), capped)


def _whole(key: str, value: Any, least: int) -> int | None:
    """A count as the API takes it: a whole number of at least `least`, or null (unset)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise Uncappable(f"{key} is not a whole number of at least {least}")
    return value


_WS = re.compile(r"[ \t\n\r]*")


def _skip(text: str, i: int) -> int:
    """Past JSON's whitespace from i."""
    m = _WS.match(text, i)
    assert m is not None  # it matches the empty string
    return m.end()


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _members(text: str) -> tuple[int, list[tuple[str, int, int, Any]]]:
    """Where the object's first member goes, and each top-level member: its key, the span of
    its value in `text`, and the value.

    Raises: Uncappable, for anything but one JSON object.
    """
    try:
        return _scan(text)
    except (ValueError, RecursionError) as e:
        raise Uncappable("the body is not one JSON object") from e


def _scan(text: str) -> tuple[int, list[tuple[str, int, int, Any]]]:
    i = _skip(text, 0)
    if text[i : i + 1] != "{":
        raise ValueError("not an object")
    start = i + 1
    members: list[tuple[str, int, int, Any]] = []
    i = _skip(text, start)
    if text[i : i + 1] == "}":
        i += 1
    else:
        while True:
            if text[i : i + 1] != '"':
                raise ValueError("a key expected")
            key, i = _DECODER.raw_decode(text, i)
            i = _skip(text, i)
            if text[i : i + 1] != ":":
                raise ValueError("':' expected")
            i = _skip(text, i + 1)
            value, end = _DECODER.raw_decode(text, i)
            members.append((key, i, end, value))
            i = _skip(text, end)
            sep, i = text[i : i + 1], i + 1
            if sep == "}":
                break
            if sep != ",":
                raise ValueError("',' or '}' expected")
            i = _skip(text, i)
    if _skip(text, i) != len(text):
        raise ValueError("data after the object")
    return start, members
