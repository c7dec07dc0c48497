"""The one renewal loop, without a network: single flight, the retry gate, idleness, closing;
and that each kind keeps its own reasons and timing (minted tokens back off and refuse
meanwhile, a role retries every RETRY seconds and asks again)."""

from __future__ import annotations

import asyncio
import time

import pytest
from botocore.credentials import Credentials

from addon.schemes import assume
from addon.schemes.assume import ROLE_UNAVAILABLE, RoleSession
from addon.schemes.renewal import IDLE, Renewal, Unavailable
from addon.schemes.tokens import TokenSession
from tests.schemes.test_mint import FakeMinter, session


class Counter(Renewal[int]):
    """A kind whose value is a number, usable while positive; `fail` makes a renewal fail."""

    error, changed = "counter-unavailable", "the counter changed"

    def __init__(self, delay: float = 60.0) -> None:
        super().__init__("counter")
        self.calls = 0
        self.fail = False
        self.delay = delay

    async def _obtain(self) -> int:
        self.calls += 1
        await asyncio.sleep(0.02)  # concurrent callers arrive meanwhile
        if self.fail:
            raise OSError("down")
        return self.calls

    def _usable(self, value: int) -> bool:
        return value > 0

    def _renewed(self, fresh: int) -> float:
        return self.delay

    def _failed(self, e: Exception) -> float:
        self._failure = "the counter is down"
        return self.delay


async def test_concurrent_first_uses_share_one_renewal() -> None:
    counter = Counter()
    found = await asyncio.gather(*(counter.ensure() for _ in range(50)))
    assert counter.calls == 1 and set(found) == {1}
    counter.close()


async def test_a_failure_is_unavailable_with_the_kinds_detail_and_error_class() -> None:
    counter = Counter()
    counter.fail = True
    with pytest.raises(Unavailable) as raised:
        await counter.ensure()
    assert (raised.value.detail, raised.value.error) == (
        "the counter is down",
        "counter-unavailable",
    )
    assert counter._timer is not None  # retried after the kind's delay
    counter.close()


async def test_a_value_that_is_no_longer_usable_is_renewed_first() -> None:
    counter = Counter()
    counter.current = 0
    assert counter.now() is None
    assert await counter.ensure() == 1
    counter.close()


async def test_a_background_renewal_runs_at_the_kinds_delay() -> None:
    counter = Counter(delay=0.05)
    await counter.ensure()
    await asyncio.sleep(0.2)
    assert counter.calls >= 2 and (counter.current or 0) >= 2
    counter.close()


async def test_an_idle_session_stops_renewing() -> None:
    counter = Counter()
    loop = asyncio.get_running_loop()
    counter._used = time.monotonic() - IDLE - 1
    counter._schedule(loop, 60)
    assert counter._timer is None


async def test_a_closed_session_refuses_and_is_never_renewed() -> None:
    counter = Counter()
    counter.closed = True
    with pytest.raises(Unavailable, match="the counter changed"):
        await counter.ensure()
    counter._refresh()
    assert counter.calls == 0 and counter._task is None


async def test_a_token_failure_refuses_at_once_until_its_backoff_has_passed() -> None:
    minter = FakeMinter()
    minter.fail = OSError("down")  # type: ignore[assignment]  # any failure, not only MintFailed
    s = session(minter)
    with pytest.raises(Unavailable) as raised:
        await s.ensure()
    assert raised.value.error == "token-unavailable"
    with pytest.raises(Unavailable, match="could not be reached"):
        await s.ensure()
    assert minter.calls == 1  # backing off: not asked again
    s.close()


async def test_a_role_failure_sets_no_gate_and_the_next_request_asks_sts_again() -> None:
    calls = []

    async def unreachable(host: str, port: int) -> tuple[str, int]:
        calls.append(host)
        raise OSError("no route")

    role = RoleSession("role", Credentials("AKIA", "s"), {"assume_role": "arn"}, unreachable, None)
    for _ in range(2):
        with pytest.raises(Unavailable) as raised:
            await role.ensure()
        assert (raised.value.detail, raised.value.error) == (
            ROLE_UNAVAILABLE,
            "role-keys-unavailable",
        )
    assert calls == [assume.STS_HOST] * 2
    assert role._timer is not None and role._timer.when() - asyncio.get_running_loop().time() <= (
        assume.RETRY
    )
    role.close()


async def test_only_a_token_wait_is_timed_in_the_audit() -> None:
    assert TokenSession.timed and not RoleSession.timed
    s = session(FakeMinter())
    assert repr(s) == "TokenSession('cred')"
    s.close()
