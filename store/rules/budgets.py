"""Token budgets of a grant: `total=200000/day`, parsed once, and the UTC windows they count in.

A budget is a set of limits, each a kind of token (input, output or total) and a number per
window (hour, day or month, in UTC), and whether the proxy caps a model call's output limit
(`max_tokens`) to what is left. Stored as canonical JSON in grants.budget: the list of limits,
or, with the cap, `{"limits": [...], "cap_max_tokens": true}` (a replica that predates the cap
reads neither as a budget and leaves the grant out, never serving it uncapped). The usage it
is checked against is kept per grant and window in budget_usage (store/tables/budgets.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from store.errors import InvalidInput

KINDS = ("input", "output", "total", "spend")
WINDOWS = ("hour", "day", "month")
MAX_TOKENS = 10**15
MICROS = 10**6  # a spend limit is kept in micro-US dollars
MAX_SPEND = 10**9  # US dollars per limit
_SPEC = re.compile(r"(input|output|total)=([0-9]{1,16})/(hour|day|month)")
_SPEND = re.compile(r"spend=([0-9]{1,10})(?:\.([0-9]{1,6}))?/(hour|day|month)")


@dataclass(frozen=True, order=True)
class TokenLimit:
    kind: str  # input, output, total, or spend
    tokens: int  # micro-US dollars for spend
    window: str  # hour, day or month

    def __str__(self) -> str:
        amount = usd(self.tokens) if self.kind == "spend" else str(self.tokens)
        return f"{self.kind}={amount}/{self.window}"


def usd(micros: int) -> str:
    """Micro-US dollars as the operator writes dollars: 2.5, 0.000125, 10."""
    whole, part = divmod(micros, MICROS)
    return f"{whole}.{part:06d}".rstrip("0").rstrip(".")


CAP_KEY = "cap_max_tokens"
CAP_NEEDS = ("output", "total")  # the kinds a model call's output limit can be capped to


@dataclass(frozen=True)
class Budget:
    limits: tuple[TokenLimit, ...]
    cap: bool = False  # a model call's max_tokens is capped to what is left (docs/budgets.md)

    def to_json(self) -> str:
        specs = [str(limit) for limit in self.limits]
        return json.dumps({"limits": specs, CAP_KEY: True} if self.cap else specs)

    def describe(self) -> str:
        said = ", ".join(str(limit) for limit in self.limits)
        return f"{said}, max_tokens capped" if self.cap else said

    def specs(self) -> tuple[str, ...]:
        return tuple(str(limit) for limit in self.limits)

    def windows(self) -> tuple[str, ...]:
        return tuple(w for w in WINDOWS if any(limit.window == w for limit in self.limits))


def parse(specs: Sequence[str], cap: bool = False) -> Budget | None:
    """`total=200000/day` and the like, each kind at most once per window; None for none.
    With `cap`, the budget must have an output or total limit to cap to.

    Raises: InvalidInput.
    """
    found: dict[tuple[str, str], TokenLimit] = {}
    for spec in specs:
        limit = _limit(spec)
        if (limit.kind, limit.window) in found:
            raise InvalidInput(
                f"{{budget}} names {limit.kind} per {limit.window} twice", budget="budget"
            )
        found[(limit.kind, limit.window)] = limit
    if cap and not any(kind in CAP_NEEDS for kind, _ in found):
        raise InvalidInput(
            "{cap_max_tokens} needs an output or total {budget} to cap max_tokens to",
            cap_max_tokens="cap_max_tokens",
            budget="budget",
        )
    if not found:
        return None
    order = {w: i for i, w in enumerate(WINDOWS)}
    kinds = {k: i for i, k in enumerate(KINDS)}
    limits = sorted(found.values(), key=lambda x: (order[x.window], kinds[x.kind]))
    return Budget(tuple(limits), cap)


def _limit(spec: object) -> TokenLimit:
    text = spec if isinstance(spec, str) else ""
    m = _SPEC.fullmatch(text)
    if m is not None:
        tokens = int(m.group(2))
        if not 1 <= tokens <= MAX_TOKENS:
            raise InvalidInput(f"invalid {{budget}} {text!r}: 1 to {MAX_TOKENS}", budget="budget")
        return TokenLimit(m.group(1), tokens, m.group(3))
    m = _SPEND.fullmatch(text)
    if m is not None:
        micros = int(m.group(1)) * MICROS + int((m.group(2) or "").ljust(6, "0"))
        if not 1 <= micros <= MAX_SPEND * MICROS:
            raise InvalidInput(
                f"invalid {{budget}} {text!r}: 0.000001 to {MAX_SPEND} US dollars",
                budget="budget",
            )
        return TokenLimit("spend", micros, m.group(3))
    raise InvalidInput(
        f"invalid {{budget}} {str(spec)[:60]!r}: KIND=TOKENS/WINDOW, KIND input, output or "
        "total, WINDOW hour, day or month (e.g. total=200000/day), or spend=DOLLARS/WINDOW",
        budget="budget",
    )


def from_json(text: str) -> Budget | None:
    """A stored budget; None when it cannot be read (the grant is then left out, never
    served without its budget)."""
    try:
        stored = json.loads(text)
        cap = isinstance(stored, dict) and stored.keys() == {"limits", CAP_KEY}
        if cap and stored[CAP_KEY] is True:
            stored = stored["limits"]
        elif cap:
            return None
        if not isinstance(stored, list) or not stored:
            return None
        return parse(stored, cap)
    except (ValueError, InvalidInput):
        return None


def canonical(specs: Sequence[str], cap: bool = False) -> str | None:
    """The column's text for these specs; None for no budget. Raises: InvalidInput."""
    budget = parse(specs, cap)
    return None if budget is None else budget.to_json()


def capping(text: str | None) -> bool:
    """Whether a stored budget caps max_tokens."""
    budget = from_json(text) if text is not None else None
    return budget is not None and budget.cap


def describe(text: str | None) -> str | None:
    budget = from_json(text) if text is not None else None
    return None if budget is None else budget.describe()


def window_start(window: str, now: datetime) -> datetime:
    now = now.astimezone(UTC)
    if window == "hour":
        return now.replace(minute=0, second=0, microsecond=0)
    if window == "day":
        return now.replace(hour=0, minute=0, second=0, microsecond=0)
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def window_end(window: str, now: datetime) -> datetime:
    start = window_start(window, now)
    if window == "hour":
        return start + timedelta(hours=1)
    if window == "day":
        return start + timedelta(days=1)
    return (start + timedelta(days=32)).replace(day=1)


def window_key(window: str, now: datetime) -> str:
    """The budget_usage row's name for the window `now` falls in: `day:2026-12-07`."""
    start = window_start(window, now)
    if window == "hour":
        return f"hour:{start:%Y-%m-%dT%H}"
    if window == "day":
        return f"day:{start:%Y-%m-%d}"
    return f"month:{start:%Y-%m}"
