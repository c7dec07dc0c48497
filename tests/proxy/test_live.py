"""The live policy: its staleness rule, without a store; its updates, with one."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import update
from structlog.testing import capture_logs

from addon.core.policy import Policy
from addon.proxy.live import LivePolicy
from store.crypto import MasterKey, Secret
from store.db.models import StoreState, utcnow
from store.errors import StoreUnavailable
from store.repository import Store
from tests.store.db.test_delta import view
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

    def slow_delta(since: int, mark: int | None = None) -> Any:
        delta = type(live.store).delta(live.store, since, mark)
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


def _copy(url: str, key: MasterKey, name: str) -> tuple[Path, Store]:
    """A copy of the SQLite store at `url` (a backup), opened on its own."""
    db = Path(url.removeprefix("sqlite:///"))
    copy = db.with_name(name)
    source, target = sqlite3.connect(db), sqlite3.connect(copy)
    source.backup(target)
    source.close()
    target.close()
    return copy, Store(f"sqlite:///{copy}", key)


def _restore(url: str, copy: Path) -> None:
    db = Path(url.removeprefix("sqlite:///"))
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    os.replace(copy, db)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_restore_is_read_whole_even_when_its_first_full_read_fails(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store], db_url: str
) -> None:
    """A restored file at the counter the replica had: only a full read can tell them apart.
    The first one failing (a busy store) must not leave the replica on the old file's policy."""
    old = seed(store)
    copy, backup = _copy(db_url, key, "backup.db")
    added = store.add_grant("agent", ["POST"], credential="gh")
    backup.revoke_grant(old)  # the restored store moved on too: the same counter
    backup.close()
    assert store.change_counter() == Store(f"sqlite:///{copy}", key).change_counter()
    live = LivePolicy(open_store(key))
    try:
        policy = live.load()
        assert set(policy._owner) == {old, added}
        build, failed = live._build_policy, []

        def busy_once() -> Any:
            if not failed:
                failed.append(True)
                raise StoreUnavailable("the store did not answer")
            return build()

        live._build_policy = busy_once  # type: ignore[method-assign]
        _restore(db_url, copy)
        with capture_logs() as logs:
            asyncio.run(live.poll())  # store.replaced; its full read fails
            asyncio.run(live.poll())
        assert failed
        events = [line["event"] for line in logs]
        assert "store.replaced" in events and "store.unavailable" in events
        restored = open_store(key)
        assert live.policy is not None
        assert view(live.policy) == view(Policy(restored.snapshot()))
        assert live.policy.grant_count == 0
    finally:
        live.close()


def test_a_key_file_updated_after_the_rotation_is_picked_up_without_another_change(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    """`key rotate` commits, then moves the new key file into place (and a mounted secret may
    take longer to reach a replica): a replica that read the old file in between must not
    stay with every credential unreadable until the next store change."""
    seed(store)
    new = MasterKey.generate("new")
    on_disk = [key]
    live = LivePolicy(open_store(key), reload_key=lambda: on_disk[0])
    try:
        live.load()
        store.rotate_key(new)
        asyncio.run(live.poll())  # the key file still holds the old key
        assert live.policy is not None and live.policy.unreadable == ("gh",)
        assert live.policy.grant_count == 0
        on_disk[0] = new  # the key file, moved into place
        asyncio.run(live.poll())  # no store change since
        assert live.policy.unreadable == () and live.policy.grant_count == 1
        assert view(live.policy) == view(Policy(open_store(new).snapshot()))
    finally:
        live.close()


def test_a_delta_that_fails_half_applied_is_never_served(
    store: Store,
    key: MasterKey,
    open_store: Callable[[MasterKey | None], Store],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fail closed: a policy left half changed by an exception (its credentials rotated, its
    rules not) is dropped at once, and the whole store read instead."""
    from addon.core import policy as policy_module

    seed(store)
    live = LivePolicy(open_store(key))
    try:
        served = live.load()
        store.rotate_credential("gh", Secret(b"ghp_rotated0123456789"))

        def broken(*args: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(policy_module, "_rule", broken)
        seen: list[Any] = []
        build = live._build_policy

        def full() -> Any:
            seen.append(live.current())  # what requests get while the whole store is read
            monkeypatch.undo()
            return build()

        live._build_policy = full  # type: ignore[method-assign]
        with capture_logs() as logs:
            asyncio.run(live.poll())
        assert seen == [None]  # not the half-changed policy
        assert "policy.apply_failed" in [line["event"] for line in logs]
        assert live.policy is not served and live.current() is live.policy
        assert view(live.policy) == view(Policy(store.snapshot()))
    finally:
        live.close()


def test_a_store_restored_in_place_to_an_earlier_counter_is_read_whole(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    """A PostgreSQL restore (or an SQLite file restored into the same inode) takes the
    counter back: nothing in the log can be applied to the replica's policy."""
    from sqlalchemy import delete as sql_delete

    from store.db.models import ChangeLog, Grant

    grant = seed(store)
    counter = store.change_counter()
    added = store.add_grant("agent", ["POST"], credential="gh")
    live = LivePolicy(open_store(key))
    try:
        live.load()
        with store.engine.begin() as connection:  # the backup, as of `counter`, minus a grant
            connection.execute(sql_delete(ChangeLog).where(ChangeLog.counter > counter))
            connection.execute(sql_delete(Grant).where(Grant.id == added))
            connection.execute(update(Grant).where(Grant.id == grant).values(revoked_at=utcnow()))
            connection.execute(update(StoreState).values(change_counter=counter))
        (line,) = _poll(live)
        assert line["mode"] == "full"
        assert live.policy is not None and live.policy.grant_count == 0
        assert view(live.policy) == view(Policy(store.snapshot()))
    finally:
        live.close()


def test_a_store_restored_in_place_and_changed_to_the_same_counter_is_read_whole(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    """Restored in place (a PostgreSQL restore) to an earlier counter, then changed back up
    to the replica's counter before it looked: the counters agree, the stores do not."""
    from sqlalchemy import delete as sql_delete

    from store.db.models import ChangeLog, Grant

    grant = seed(store)
    counter = store.change_counter()
    added = store.add_grant("agent", ["POST"], credential="gh")  # counter + 1
    live = LivePolicy(open_store(key))
    try:
        live.load()
        with store.engine.begin() as connection:  # the backup, as of `counter`
            connection.execute(sql_delete(ChangeLog).where(ChangeLog.counter > counter))
            connection.execute(sql_delete(Grant).where(Grant.id == added))
            connection.execute(update(StoreState).values(change_counter=counter))
        store.revoke_grant(grant)  # after the restore: counter + 1 again
        assert store.change_counter() == live.policy.counter  # type: ignore[union-attr]
        with capture_logs() as logs:
            asyncio.run(live.poll())
        assert "store.diverged" in [line["event"] for line in logs]
        assert live.policy is not None and live.policy.grant_count == 0
        assert view(live.policy) == view(Policy(store.snapshot()))
        store.add_grant("agent", ["PUT"], credential="gh")
        (line,) = _poll(live)
        assert line["mode"] == "incremental"  # and from there on, as before
    finally:
        live.close()


def test_a_delta_from_a_store_restored_in_place_and_changed_past_the_counter_is_none(
    store: Store,
) -> None:
    from sqlalchemy import delete as sql_delete

    from store.db.models import ChangeLog, Grant

    grant = seed(store)
    counter = store.change_counter()
    added = store.add_grant("agent", ["POST"], credential="gh")
    policy = Policy(store.snapshot())
    with store.engine.begin() as connection:  # restored to `counter`, then changed twice
        connection.execute(sql_delete(ChangeLog).where(ChangeLog.counter > counter))
        connection.execute(sql_delete(Grant).where(Grant.id == added))
        connection.execute(update(StoreState).values(change_counter=counter))
    store.revoke_grant(grant)
    store.add_principal("intern")
    assert store.change_counter() == policy.counter + 1
    assert store.delta(policy.counter, policy.mark) is None
    assert store.delta(policy.counter) is not None  # what the log alone would have said
