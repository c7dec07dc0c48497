"""Token buckets: a burst, a refill at the rate, all-or-none across limits, a bounded table."""

from __future__ import annotations

import pytest

from addon.core.reasons import Reason
from addon.proxy import ratelimit
from addon.proxy.failclosed import Denied
from addon.proxy.ratelimit import Buckets, Limit, Limiter
from store.rules.grammar import parse_rate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limit(key: str, rate: str, burst: int | None = None) -> Limit:
    return Limit(key, parse_rate(rate), burst, f"rate {rate} of {key}")


def test_a_bucket_admits_its_burst_then_one_request_per_interval() -> None:
    clock = Clock()
    buckets = Buckets(clock)
    two_per_second = limit("g", "2/s", burst=2)
    assert buckets.take([two_per_second]) is None
    assert buckets.take([two_per_second]) is None
    refused = buckets.take([two_per_second])
    assert refused is not None and refused[0] is two_per_second
    assert refused[1] == pytest.approx(0.5)
    clock.now += 0.5
    assert buckets.take([two_per_second]) is None
    assert buckets.take([two_per_second]) is not None


def test_the_burst_defaults_to_the_rates_count_and_never_grows_past_it() -> None:
    clock = Clock()
    buckets = Buckets(clock)
    sixty = limit("g", "60/m")
    clock.now += 3600  # idle for an hour: still at most 60 at once
    admitted = sum(buckets.take([sixty]) is None for _ in range(100))
    assert admitted == 60


def test_a_request_refused_by_one_limit_spends_no_other() -> None:
    clock = Clock()
    buckets = Buckets(clock)
    roomy, tight = limit("p", "100/s"), limit("g", "1/m")
    assert buckets.take([roomy, tight]) is None
    for _ in range(5):
        refused = buckets.take([roomy, tight])
        assert refused is not None and refused[0] is tight
    # The principal's bucket lost only the one token the admitted request took.
    assert sum(buckets.take([roomy]) is None for _ in range(200)) == 99


def test_a_changed_rate_starts_a_bucket_of_its_own() -> None:
    buckets = Buckets(Clock())
    assert buckets.take([limit("g", "1/h")]) is None
    assert buckets.take([limit("g", "1/h")]) is not None
    assert buckets.take([limit("g", "2/h")]) is None


def test_the_table_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimit, "MAX_BUCKETS", 10)
    buckets = Buckets(Clock())
    for i in range(100):
        buckets.take([limit(f"g{i}", "1/s")])
    assert len(buckets._state) <= 10


def test_the_limiter_denies_rate_limited_with_a_whole_retry_after() -> None:
    limiter = Limiter(Buckets(Clock()))
    one_per_minute = limit("grant 7", "1/m")
    limiter.check([one_per_minute])
    with pytest.raises(Denied) as denied:
        limiter.check([one_per_minute])
    assert denied.value.reason is Reason.RATE_LIMITED
    assert denied.value.extra == {"retry_after": 60}
    assert denied.value.detail == "over the rate 1/m of grant 7"
