"""Holds without a proxy: a fake store and clock-free decisions, for the fail-closed paths."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from mitmproxy.test import tflow

from addon.core.policy import Policy
from addon.core.reasons import Reason
from addon.core.verdict import HeaderScan, Verdict
from addon.observe.metrics import Metrics
from addon.proxy.approval import Holds, HoldSettings, operation_of
from addon.proxy.failclosed import Denied
from addon.proxy.state import Record, Step
from store.errors import StoreUnavailable
from tests.fakes import grant, policy


class FakeStore:
    def __init__(self) -> None:
        self.states: dict[int, str] = {}
        self.down = False
        self.polls = 0

    def _up(self) -> None:
        if self.down:
            raise StoreUnavailable("down")

    def hold_request(self, *args: Any) -> tuple[int, bool]:
        self._up()
        request_id = len(self.states) + 1
        self.states[request_id] = "pending"
        return request_id, True

    def hold_states(self, ids: list[int]) -> dict[int, str]:
        self.polls += 1
        self._up()
        return {i: self.states[i] for i in ids}

    def settle_hold(self, request_id: int) -> str:
        self._up()
        if self.states[request_id] == "pending":
            self.states[request_id] = "expired"
        return self.states[request_id]


class FakeLive:
    def __init__(self, held_policy: Policy) -> None:
        self.store = FakeStore()
        self.policy: Policy | None = held_policy
        self.store_up = True

    def current(self) -> Policy | None:
        return self.policy

    async def call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


def _held_policy(approval: str = "each", hold: int = 1) -> Policy:
    return policy(dataclasses.replace(grant(1), approval=approval, hold=hold))


def _step(held: Policy) -> Step:
    rule = held.rule(1)
    assert rule is not None
    verdict = Verdict(host="api.test", port=443, method="GET", path="/v1/x", rule=rule)
    return Step(HeaderScan({}), "a", None, held, verdict)


def _holds(live: FakeLive, **settings: int) -> Holds:
    metrics = Metrics(snapshot_age=lambda: 0.0, store_up=lambda: True)
    return Holds(live, metrics, HoldSettings(**settings), poll_interval=0.01)  # type: ignore[arg-type]


def _wait(holds: Holds, live: FakeLive, decide: str | None = None) -> Denied | None:
    step = _step(live.current() or _held_policy())
    rec = Record(0.0, "id", "client")

    async def run() -> None:
        flow = tflow.tflow()
        flow.request.scheme, flow.request.host, flow.request.port = "https", "api.test", 443
        waiting = asyncio.ensure_future(holds.wait(flow, step, rec))
        if decide is not None:
            while not live.store.states:
                await asyncio.sleep(0.005)
            live.store.states[1] = decide
        await waiting

    try:
        asyncio.run(run())
    except Denied as e:
        return e
    return None


def test_an_approved_hold_returns_and_a_denied_one_refuses() -> None:
    live = FakeLive(_held_policy(hold=5))
    assert _wait(_holds(live), live, "approved") is None
    live = FakeLive(_held_policy(hold=5))
    denied = _wait(_holds(live), live, "denied")
    assert denied is not None and denied.reason == Reason.APPROVAL_DENIED


def test_with_the_store_down_a_request_is_refused_not_held() -> None:
    live = FakeLive(_held_policy())
    live.store_up = False
    refused = _wait(_holds(live), live)
    assert refused is not None and refused.reason == Reason.STORE_UNAVAILABLE
    assert live.store.states == {}


def test_a_store_that_fails_while_held_ends_in_a_timeout_never_an_approval() -> None:
    live = FakeLive(_held_policy(hold=1))
    holds = _holds(live)
    original = live.store.hold_request

    def record_then_fail(*args: Any) -> tuple[int, bool]:
        found = original(*args)
        live.store.down = True
        return found

    live.store.hold_request = record_then_fail  # type: ignore[method-assign]
    refused = _wait(holds, live)
    assert refused is not None and refused.reason == Reason.APPROVAL_TIMEOUT
    assert live.store.polls > 0


def test_the_caps_refuse_beyond_them() -> None:
    live = FakeLive(_held_policy(hold=5))
    holds = _holds(live, total=1, per_principal=1)
    holds._held["a"] = 1  # one already held
    refused = _wait(holds, live)
    assert refused is not None and refused.reason == Reason.TOO_MANY_HOLDS
    assert live.store.states == {}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        pytest.param(lambda p: policy(), Reason.NO_GRANT, id="revoked while held"),
        pytest.param(lambda p: None, Reason.STORE_UNAVAILABLE, id="policy gone stale"),
    ],
)
def test_an_approval_counts_only_while_the_grant_still_serves(change: Any, reason: Reason) -> None:
    live = FakeLive(_held_policy(hold=5))
    step = _step(live.policy)  # type: ignore[arg-type]
    holds = _holds(live)

    async def run() -> None:
        waiting = asyncio.ensure_future(holds.wait(tflow.tflow(), step, Record(0.0, "i", "c")))
        while not live.store.states:
            await asyncio.sleep(0.005)
        live.policy = change(live.policy)
        live.store.states[1] = "approved"
        await waiting

    with pytest.raises(Denied) as info:
        asyncio.run(run())
    assert info.value.reason == reason


# What an owner is asked to approve names the tool, the resource or the prompt: the keys the
# body rule's summary writes (addon/core/bodies.py), never an argument.
@pytest.mark.parametrize(
    ("body", "operation"),
    [
        ({"graphql": [{"type": "mutation", "fields": ["addComment"]}]}, "mutation addComment"),
        ({"mcp": [{"method": "tools/call", "tool": "search"}]}, "tools/call search"),
        (
            {"mcp": [{"method": "resources/read", "resource": "repo://acme/app"}]},
            "resources/read repo://acme/app",
        ),
        ({"mcp": [{"method": "prompts/get", "prompt": "triage"}]}, "prompts/get triage"),
        ({"mcp": [{"method": "ping"}]}, "ping"),
        ({"jsonrpc": ["eth_call"]}, "eth_call"),
        (None, None),
    ],
)
def test_a_held_body_is_named_by_what_it_asks(body: Any, operation: str | None) -> None:
    assert operation_of(body) == operation
