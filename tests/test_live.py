"""The live policy: its staleness rule, without a store; its updates, with one."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import update
from structlog.testing import capture_logs

from addon.live import LivePolicy
from store.crypto import MasterKey
from store.errors import StoreUnavailable
from store.models import StoreState
from store.repository import Store
from tests.stores import seed


@pytest.mark.parametrize(
    ("max_stale", "age", "served"),
    [
        pytest.param(30.0, 1.0, True, id="a fresh policy is served"),
        pytest.param(30.0, 31.0, False, id="a policy older than max-stale is not"),
        pytest.param(float("nan"), 0.0, False, id="a NaN limit reads as stale"),
    ],
)
def test_current_fails_closed(max_stale: float, age: float, served: bool) -> None:
    store: Any = SimpleNamespace()
    live = LivePolicy(store, max_stale=max_stale)
    try:
        live.policy = object()  # type: ignore[assignment]
        live.last_ok = time.monotonic() - age
        assert (live.current() is not None) is served
    finally:
        live._executor.shutdown()


# -- with a store: incremental updates, full reloads -----------------------------------------


def _poll(live: LivePolicy, **kwargs: Any) -> list[dict[str, Any]]:
    with capture_logs() as logs:
        asyncio.run(live.poll(**kwargs))
    return [line for line in logs if line["event"] == "policy.reloaded"]


def test_a_change_is_applied_incrementally_and_a_gap_reloads_whole(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    seed(store)
    live = LivePolicy(open_store(key))  # the proxy's own connection to the store
    try:
        policy = live.load()
        once = store.add_grant("agent", ["GET"], credential="gh", paths=["/o/"], once=True)
        store.consume_once(once)
        (line,) = _poll(live)
        assert (line["mode"], line["changes"], line["counter"]) == (
            "incremental",
            2,
            store.change_counter(),
        )
        assert live.policy is policy and policy._principals["agent"].rules[once].consumed
        with store.engine.begin() as connection:  # a change the log does not hold
            connection.execute(
                update(StoreState).values(change_counter=StoreState.change_counter + 1)
            )
        (line,) = _poll(live)
        assert line["mode"] == "full" and live.policy is not policy
        assert _poll(live) == []  # nothing changed: nothing read
    finally:
        live.close()


def test_the_periodic_full_reload_runs_beside_changes_and_catches_up(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    seed(store)
    live = LivePolicy(open_store(key), full_interval=0.0)
    try:

        async def run() -> list[str]:
            live.load()
            modes = []
            with capture_logs() as logs:
                store.add_grant("agent", ["POST"], credential="gh")
                await live.poll()  # incremental; the full read starts after it
                assert live._full is not None
                store.add_grant("agent", ["PUT"], credential="gh")
                await asyncio.wait_for(asyncio.shield(live._full), 10)
                await live.poll()  # the full read's policy, caught up with the PUT grant
            modes = [line["mode"] for line in logs if line["event"] == "policy.reloaded"]
            return modes

        assert asyncio.run(run()) == ["incremental", "full"]
        assert live.policy is not None and live.policy.counter == store.change_counter()
        assert live.policy.grant_count == 3
    finally:
        live.close()


def test_a_slow_poll_never_takes_the_policy_back_over_a_later_one(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    """The timer's poll and SIGHUP's may overlap: the one that read first applies first."""
    store.add_principal("agent")
    live = LivePolicy(open_store(key))
    read, release = threading.Event(), threading.Event()
    reads = []

    def slow_delta(since: int) -> Any:
        delta = type(live.store).delta(live.store, since)
        if not reads:
            reads.append(delta)
            read.set()
            release.wait(10)
        return delta

    try:

        async def run() -> None:
            live.load()
            grant = store.add_grant("agent", ["GET"], hosts=["pypi.org"])
            live.store.delta = slow_delta  # type: ignore[method-assign]
            first = asyncio.create_task(live.poll())  # reads the grant, then waits
            while not read.is_set():
                await asyncio.sleep(0.01)
            store.revoke_grant(grant)
            second = asyncio.create_task(live.poll())
            await asyncio.sleep(0.3)
            release.set()
            await asyncio.gather(first, second)

        asyncio.run(run())
        assert live.policy is not None and live.policy.counter == store.change_counter()
        assert live.policy.grant_count == 0
    finally:
        release.set()
        live.close()


def test_a_full_read_pauses_the_cyclic_collector_and_restores_it() -> None:
    import gc
    import sys

    from addon import live

    interval, collecting = sys.getswitchinterval(), gc.isenabled()
    gc.enable()
    try:
        with live._responsive():
            with live._responsive():  # the periodic read and a forced one, overlapping
                assert not gc.isenabled()
            assert not gc.isenabled()
            assert sys.getswitchinterval() == pytest.approx(live.FULL_READ_SWITCH_INTERVAL)
        assert gc.isenabled() and sys.getswitchinterval() == pytest.approx(interval)
        gc.disable()  # start-up: the runner turns it on once it listens
        with live._responsive():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable() if collecting else gc.disable()


def test_a_failed_periodic_full_read_keeps_the_incremental_policy(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    seed(store)
    live = LivePolicy(open_store(key), full_interval=0.0)
    try:

        async def run() -> list[str]:
            policy = live.load()

            def unavailable() -> Any:
                raise StoreUnavailable("the store kept changing while its snapshot was read")

            live._build_policy = unavailable  # type: ignore[method-assign]
            with capture_logs() as logs:
                store.add_grant("agent", ["POST"], credential="gh")
                await live.poll()  # incremental; the full read starts, and fails
                assert live._full is not None
                live.full_interval = 3600.0
                await asyncio.wait({live._full}, timeout=10)
                store.add_grant("agent", ["PUT"], credential="gh")
                await live.poll()
                assert live.policy is policy and live._full is None  # not retried at once
            return [line["event"] + ":" + str(line.get("mode")) for line in logs]

        events = asyncio.run(run())
        assert events == [
            "policy.reloaded:incremental",
            "policy.full_reload_failed:None",
            "policy.reloaded:incremental",
        ]
        assert live.policy is not None and live.policy.grant_count == 3
    finally:
        live.close()
