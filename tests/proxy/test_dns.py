"""The resolver: shared lookups, vetted answers reused, failures cached briefly, rebinding refused.

A fake lookup counts queries and a fake clock moves time; the guard is the real one.
"""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from addon.core.guard import DestinationGuard
from addon.proxy.dns import FORBIDDEN, UNRESOLVABLE, LookupFailed, Resolver

PUBLIC = "93.184.216.34"
OTHER_PUBLIC = "93.184.216.35"


class FakeDNS:
    def __init__(self, answers: dict[str, list[str]] | None = None) -> None:
        self.answers = answers or {"api.test": [PUBLIC]}
        self.queries: list[tuple[str, int]] = []
        self.hang: set[str] = set()
        self.gate = asyncio.Event()
        self.gate.set()
        self.release = asyncio.Event()

    async def __call__(self, host: str, port: int) -> list[str]:
        self.queries.append((host, port))
        await self.gate.wait()
        if host in self.hang:
            await self.release.wait()
        if host not in self.answers:
            raise OSError("no such name")
        return list(self.answers[host])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def settled(r: Resolver) -> None:
    """Wait until no lookup is in flight."""
    while r._inflight:
        await asyncio.sleep(0)


def resolver(dns: FakeDNS, clock: Clock, **kwargs: float) -> Resolver:
    return Resolver(DestinationGuard(), lookup=dns, clock=clock, **kwargs)  # type: ignore[arg-type]


async def test_a_thousand_requests_cost_one_lookup() -> None:
    dns, clock = FakeDNS(), Clock()
    r = resolver(dns, clock)
    for _ in range(1000):
        address, _waited = await r.resolve("api.test", 443)
        assert address == (PUBLIC, 443)
    assert dns.queries == [("api.test", 443)]
    assert (r.stats.lookups, r.stats.hits) == (1, 999)


async def test_concurrent_first_requests_share_one_lookup() -> None:
    dns, clock = FakeDNS(), Clock()
    dns.gate.clear()
    r = resolver(dns, clock)
    waiting = [asyncio.ensure_future(r.resolve("api.test", 443)) for _ in range(50)]
    await asyncio.sleep(0)
    dns.gate.set()
    results = await asyncio.gather(*waiting)
    assert {address for address, _ in results} == {(PUBLIC, 443)}
    assert len(dns.queries) == 1


async def test_ports_are_looked_up_apart() -> None:
    dns, clock = FakeDNS(), Clock()
    r = resolver(dns, clock)
    await r.resolve("api.test", 443)
    assert (await r.resolve("api.test", 8443))[0] == (PUBLIC, 8443)
    assert len(dns.queries) == 2


async def test_after_the_ttl_the_stale_answer_serves_while_one_lookup_refreshes() -> None:
    dns, clock = FakeDNS(), Clock()
    r = resolver(dns, clock, ttl=30.0)
    await r.resolve("api.test", 443)
    dns.answers["api.test"] = [OTHER_PUBLIC]
    clock.now += 31
    address, waited = await r.resolve("api.test", 443)
    assert address == (PUBLIC, 443) and waited == 0.0  # no wait: the vetted answer still serves
    await settled(r)
    assert (await r.resolve("api.test", 443))[0] == (OTHER_PUBLIC, 443)
    assert len(dns.queries) == 2


async def test_past_twice_the_ttl_a_request_waits_for_a_new_lookup() -> None:
    dns, clock = FakeDNS(), Clock()
    r = resolver(dns, clock, ttl=30.0)
    await r.resolve("api.test", 443)
    dns.answers["api.test"] = [OTHER_PUBLIC]
    clock.now += 61
    assert (await r.resolve("api.test", 443))[0] == (OTHER_PUBLIC, 443)


@pytest.mark.parametrize("rebound", ["127.0.0.1", "10.0.0.1", "::1", "169.254.169.254"])
async def test_a_rebinding_answer_is_refused_when_revetted(rebound: str) -> None:
    dns, clock = FakeDNS(), Clock()
    r = resolver(dns, clock, ttl=30.0)
    assert (await r.resolve("api.test", 443))[0] == (PUBLIC, 443)
    dns.answers["api.test"] = [rebound]
    clock.now += 61
    with pytest.raises(LookupFailed) as e:
        await r.resolve("api.test", 443)
    assert e.value.detail == FORBIDDEN
    # and it stays refused: the forbidden answer is never dialled, cached or not
    with pytest.raises(LookupFailed):
        await r.resolve("api.test", 443)


async def test_one_forbidden_answer_among_public_ones_refuses() -> None:
    dns, clock = FakeDNS({"api.test": [PUBLIC, "127.0.0.1"]}), Clock()
    with pytest.raises(LookupFailed) as e:
        await resolver(dns, clock).resolve("api.test", 443)
    assert e.value.detail == FORBIDDEN


async def test_every_returned_address_was_vetted() -> None:
    """Whatever the answers, the address returned is one the guard permits."""
    guard = DestinationGuard()
    answers = [PUBLIC, "127.0.0.1", "::ffff:127.0.0.1", "64:ff9b::7f00:1", "8.8.8.8", "fe80::1"]
    clock = Clock()
    for i, first in enumerate(answers):
        for second in answers:
            dns = FakeDNS({"api.test": [first, second]})
            r = resolver(dns, clock)
            try:
                (address, _), _ = await r.resolve("api.test", 443)
            except LookupFailed:
                continue
            assert guard.permits(ipaddress.ip_address(address), 443), (i, first, second)


async def test_failures_are_cached_briefly_then_retried() -> None:
    dns, clock = FakeDNS({}), Clock()
    r = resolver(dns, clock, negative_ttl=2.0)
    for _ in range(100):
        with pytest.raises(LookupFailed) as e:
            await r.resolve("gone.test", 443)
        assert e.value.detail == UNRESOLVABLE
    assert len(dns.queries) == 1
    dns.answers["gone.test"] = [PUBLIC]
    clock.now += 2.5
    assert (await r.resolve("gone.test", 443))[0] == (PUBLIC, 443)
    assert len(dns.queries) == 2
    assert r.stats.failures == 1


async def test_a_hanging_lookup_times_out_and_delays_only_its_own_name() -> None:
    dns, clock = FakeDNS({"api.test": [PUBLIC]}), Clock()
    dns.hang.add("slow.test")
    r = resolver(dns, clock, timeout=0.2)
    slow = asyncio.ensure_future(r.resolve("slow.test", 443))
    await asyncio.sleep(0)
    # Another name resolves while the first hangs.
    assert (await asyncio.wait_for(r.resolve("api.test", 443), 0.1))[0] == (PUBLIC, 443)
    with pytest.raises(LookupFailed) as e:
        await slow
    assert e.value.detail == UNRESOLVABLE


async def test_a_cancelled_request_does_not_cancel_the_shared_lookup() -> None:
    dns, clock = FakeDNS(), Clock()
    dns.gate.clear()
    r = resolver(dns, clock)
    first = asyncio.ensure_future(r.resolve("api.test", 443))
    second = asyncio.ensure_future(r.resolve("api.test", 443))
    await asyncio.sleep(0)
    first.cancel()
    dns.gate.set()
    assert (await second)[0] == (PUBLIC, 443)
    assert len(dns.queries) == 1


async def test_a_new_guard_drops_what_the_old_one_vetted() -> None:
    dns, clock = FakeDNS({"internal.test": ["10.0.0.5"]}), Clock()
    r = Resolver(DestinationGuard.parse(["10.0.0.0/8"]), lookup=dns, clock=clock)  # type: ignore[arg-type]
    assert (await r.resolve("internal.test", 443))[0] == ("10.0.0.5", 443)
    r.reconfigure(DestinationGuard())
    with pytest.raises(LookupFailed):
        await r.resolve("internal.test", 443)
    assert len(dns.queries) == 2


async def test_the_cache_is_bounded() -> None:
    answers = {f"h{i}.test": [PUBLIC] for i in range(100)}
    dns, clock = FakeDNS(answers), Clock()
    r = resolver(dns, clock, max_entries=10)  # type: ignore[arg-type]
    for name in answers:
        await r.resolve(name, 443)
    assert len(r._entries) == 10
    await r.resolve("h99.test", 443)  # the newest is kept
    assert len(dns.queries) == 100


async def test_the_system_resolver_answers_localhost() -> None:
    r = Resolver(DestinationGuard.parse(["127.0.0.0/8", "::1/128"]))
    (address, port), waited = await r.resolve("localhost", 443)
    assert ipaddress.ip_address(address).is_loopback and port == 443 and waited >= 0


async def test_answers_arriving_after_the_guard_changed_are_judged_by_the_new_guard() -> None:
    dns, clock = FakeDNS({"internal.test": ["10.0.0.5"]}), Clock()
    dns.gate.clear()
    r = Resolver(DestinationGuard.parse(["10.0.0.0/8"]), lookup=dns, clock=clock)  # type: ignore[arg-type]
    waiting = asyncio.ensure_future(r.resolve("internal.test", 443))
    while not dns.queries:  # the lookup is under way
        await asyncio.sleep(0)
    r.reconfigure(DestinationGuard())
    dns.gate.set()
    with pytest.raises(LookupFailed):
        await waiting
    with pytest.raises(LookupFailed):
        await r.resolve("internal.test", 443)  # the cached answer is the new guard's refusal
    assert len(dns.queries) == 1


async def test_a_timed_out_lookup_is_remembered_and_never_doubled_while_its_thread_hangs() -> None:
    dns, clock = FakeDNS({"slow.test": [PUBLIC]}), Clock()
    dns.hang.add("slow.test")
    r = resolver(dns, clock, timeout=0.05, negative_ttl=2.0)
    with pytest.raises(LookupFailed):
        await r.resolve("slow.test", 443)
    with pytest.raises(LookupFailed):  # remembered from the timeout's end: no new lookup
        await r.resolve("slow.test", 443)
    clock.now += 3
    with pytest.raises(LookupFailed):  # the first lookup still waits: no second one
        await r.resolve("slow.test", 443)
    assert len(dns.queries) == 1
    dns.hang.clear()
    dns.release.set()
    await asyncio.sleep(0)
    clock.now += 3
    assert (await r.resolve("slow.test", 443))[0] == (PUBLIC, 443)
    assert len(dns.queries) == 2
