"""Token buckets for grant and principal rates, per replica, with no store round trip.

A bucket holds up to `burst` tokens (default: the rate's count) and refills at the rate.
A request takes one token from each bucket that applies, or from none: a request refused by
one limit never spends another's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from addon.failclosed import Denied
from addon.policy import Reason, Rule
from store.grammar import Rate

# Buckets kept at most; past it the oldest is dropped (it starts again full). Keys are grant
# ids and principal names, so this bounds only what the store itself bounds.
MAX_BUCKETS = 65_536


class Limit(NamedTuple):
    key: Hashable
    rate: Rate
    burst: int | None
    what: str  # how the audit line names it: "rate 60/m of grant 7"


class Buckets:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[Hashable, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, limits: Sequence[Limit], *, take: bool = True) -> tuple[Limit, float] | None:
        """Take a token from every bucket, or from none: the first limit that refuses, and
        the seconds until it would admit a request. `take=False` only looks."""
        now = self._clock()
        levels = []
        for limit in limits:
            capacity = float(limit.burst or limit.rate.count)
            key = (limit.key, limit.rate, capacity)  # a changed rate starts a new bucket
            tokens, at = self._state.get(key, (capacity, now))
            tokens = min(capacity, tokens + (now - at) * limit.rate.per_second)
            if tokens < 1.0:
                return limit, (1.0 - tokens) / limit.rate.per_second
            levels.append((key, tokens))
        if not take:
            return None
        for key, tokens in levels:
            self._state.pop(key, None)
            if len(self._state) >= MAX_BUCKETS:
                del self._state[next(iter(self._state))]
            self._state[key] = (tokens - 1.0, now)
        return None


class Limiter:
    """The proxy's buckets; a refused request raises Denied(rate-limited) with Retry-After."""

    def __init__(self, buckets: Buckets | None = None) -> None:
        self.buckets = buckets or Buckets()

    def check(self, limits: Sequence[Limit], *, take: bool = True) -> None:
        refused = self.buckets.take(limits, take=take)
        if refused is not None:
            limit, wait = refused
            raise Denied(
                Reason.RATE_LIMITED,
                f"over the {limit.what}",
                {"retry_after": max(1, math.ceil(wait))},
            )


def principal_limit(principal: str, rate: Rate, burst: int | None) -> Limit:
    return Limit(
        ("principal", principal), rate, burst, f"rate {rate.text} of principal {principal}"
    )


def grant_limit(rule: Rule) -> Limit | None:
    if rule.rate is None:
        return None
    return Limit(
        ("grant", rule.grant_id),
        rule.rate,
        rule.burst,
        f"rate {rule.rate.text} of grant {rule.grant_id}",
    )
