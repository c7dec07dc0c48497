"""AssumeRole sessions without a network: what a failure, an idle session and a changed
credential do. The calls to STS themselves are tested end to end (tests/e2e/test_sigv4.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from botocore.credentials import Credentials

from addon.schemes import assume
from addon.schemes.assume import IDLE, RoleSession, Sessions, Temporary, Unavailable

BASE = Credentials("AKIAREALKEYREALKEY00", "real-secret")
OPTIONS = {"assume_role": "arn:aws:iam::123456789012:role/agent"}


async def unreachable(host: str, port: int) -> tuple[str, int]:
    raise OSError("no route")


def keys(expires_in: float) -> Temporary:
    return Temporary(Credentials("ASIA1", "s", "t"), time.time() + expires_in, (b"s", b"t"))


async def test_no_keys_and_sts_unreachable_is_unavailable() -> None:
    session = RoleSession("role", BASE, OPTIONS, unreachable, None)
    with pytest.raises(Unavailable):
        await session.ensure()
    session.close()


async def test_keys_at_their_expiry_are_never_used() -> None:
    session = RoleSession("role", BASE, OPTIONS, unreachable, None)
    session.current = keys(assume.MARGIN / 2)
    assert session.now() is None
    session.current = keys(60)
    assert session.now() is session.current
    assert (await session.ensure()) is session.current  # valid keys: no call made
    session.close()


async def test_an_idle_session_stops_renewing() -> None:
    session = RoleSession("role", BASE, OPTIONS, unreachable, None)
    loop = asyncio.get_running_loop()
    session._schedule(loop, 60)
    assert session._timer is not None
    session._used = time.monotonic() - IDLE - 1
    session._schedule(loop, 60)
    assert session._timer is None
    session.close()


def test_a_changed_credential_gets_a_new_session() -> None:
    sessions = Sessions()
    first = sessions.get("role", "fp-1", BASE, OPTIONS)
    assert sessions.get("role", "fp-1", BASE, dict(OPTIONS)) is first
    rotated = sessions.get("role", "fp-2", BASE, OPTIONS)
    assert rotated is not first
    other = sessions.get("role", "fp-2", BASE, {**OPTIONS, "external_id": "x"})
    assert other is not rotated
    assert repr(other) == "RoleSession('role')"


async def test_a_session_closed_while_a_request_waits_for_its_first_keys_is_unavailable() -> None:
    """A rotated or removed credential closes its session: a request waiting on the first
    fetch is refused (credentials-unavailable), not cancelled as if the agent had left."""
    started = asyncio.Event()

    async def hanging(host: str, port: int) -> tuple[str, int]:
        started.set()
        await asyncio.sleep(60)
        raise OSError("never")

    session = RoleSession("role", BASE, OPTIONS, hanging, None)
    waiting = asyncio.create_task(session.ensure())
    await started.wait()
    session.close()
    with pytest.raises(Unavailable):
        await waiting
