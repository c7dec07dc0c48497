"""The budget addon with the hooks called directly: checked before forwarding, fail closed,
the answer read beside its stream and charged."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.test import taddons
from structlog.testing import capture_logs

from addon.core.hosts import ResolveMap
from addon.core.usage import Charge
from store.errors import StoreUnavailable
from store.records import Usage
from store.rules import budgets
from tests.fakes import Chain, StaticLive, grant, https_flow, reason, snapshot_policy

USAGE = {"usage": {"prompt_tokens": 11, "completion_tokens": 7}, "model": "m"}


class BudgetLive(StaticLive):
    """A live policy whose store holds `used` tokens in every window and records charges."""

    def __init__(self, budget: str, used: int = 0, down: bool = False) -> None:
        record = dataclasses.replace(grant(1, methods=("POST",)), budget=budgets.parse([budget]))
        super().__init__(snapshot_policy(record))
        self.used, self.down = used, down
        self.charges: list[Charge] = []

    async def budget_used(self, grant_id: int, windows: list[str]) -> dict[str, Usage]:
        if self.down:
            raise StoreUnavailable("down")
        return {w: Usage(self.used, 0) for w in windows}

    async def charge_budget(
        self, grant_id: int, windows: list[str], charge: Charge, spend: int = 0
    ) -> None:
        self.charges.append(charge)


def _chain(live: BudgetLive) -> Chain:
    return Chain(live, ResolveMap.parse(["api.test=127.0.0.1:9443"]))


async def _post(chain: Chain) -> Any:
    flow = https_flow(chain)
    flow.request.method = "POST"
    await chain.requestheaders(flow)
    return flow


async def test_a_spent_budget_refuses_before_forwarding_with_retry_after() -> None:
    chain = _chain(BudgetLive("input=10/hour", used=10))
    with taddons.context(chain.entry):
        flow = await _post(chain)
    assert flow.response.status_code == 429 and reason(flow) == "budget-exhausted"
    assert 1 <= int(flow.response.headers["retry-after"]) <= 3600
    assert flow.request.headers.get("authorization") is None  # never stamped


class RecordingLive(BudgetLive):
    """Its store takes budget requests: one row, id 5."""

    def __init__(self, budget: str, used: int) -> None:
        super().__init__(budget, used)
        self.recorded: list[tuple[Any, ...]] = []

    async def call(self, fn: Any, *args: Any) -> Any:
        assert fn is self.store.record_budget_request
        self.recorded.append(args)
        return 5, "pending"


async def test_a_spent_budget_records_one_budget_request_and_names_it() -> None:
    live = RecordingLive("input=10/hour", used=10)
    chain = _chain(live)
    with taddons.context(chain.entry):
        flows = [await _post(chain) for _ in range(3)]
    for flow in flows:
        assert flow.response.status_code == 429 and reason(flow) == "budget-exhausted"
        body = json.loads(flow.response.content)
        assert body["access_request"] == {"id": 5, "state": "pending"}
    # One store write per grant in the window; the principal, grant and spent limits only.
    assert live.recorded == [("a", 1, "api.test", 443, "POST", "/v1/x", "input=10/hour")]


async def test_a_budget_the_store_cannot_check_refuses() -> None:
    chain = _chain(BudgetLive("total=10/day", down=True))
    with taddons.context(chain.entry):
        flow = await _post(chain)
    assert flow.response.status_code == 503 and reason(flow) == "store-unavailable"
    assert flow.request.headers.get("authorization") is None


async def test_budget_left_forwards_asking_for_plain_answers_then_charges_the_usage() -> None:
    live = BudgetLive("total=100/day", used=99)
    chain = _chain(live)
    with taddons.context(chain.entry):
        flow = await _post(chain)
        assert flow.response is None and flow.request.headers["accept-encoding"] == "identity"
        body = json.dumps(USAGE).encode()
        flow.response = http.Response.make(
            200, body, {"content-type": "application/json", "content-length": str(len(body))}
        )
        chain.responseheaders(flow)
        waiting = chain.response(flow)
        if waiting is not None:
            await waiting
    assert [(c.model, c.input_tokens, c.output_tokens) for c in live.charges] == [("m", 11, 7)]


async def test_a_streamed_answer_passes_unchanged_while_it_is_read() -> None:
    live = BudgetLive("total=100/day")
    chain = _chain(live)
    events = [b'data: {"model":"m","choices":[]}\n\n', b"data: " + json.dumps(USAGE).encode()]
    with taddons.context(chain.entry):
        flow = await _post(chain)
        flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
        flow.response.headers.pop("content-length", None)
        chain.responseheaders(flow)
        stream = flow.response.stream
        assert callable(stream)
        out = [stream(e) for e in [*events, b"\n\n", b""]]
        waiting = chain.response(flow)
        if waiting is not None:
            await waiting
    assert b"".join(o if isinstance(o, bytes) else b"".join(o) for o in out) == b"".join(
        [*events, b"\n\n"]
    )
    assert [(c.input_tokens, c.output_tokens, c.estimated) for c in live.charges] == [
        (11, 7, False)
    ]


async def test_a_failing_usage_reader_kills_no_stream_and_charges_the_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    live = BudgetLive("total=100/day")
    chain = _chain(live)
    with taddons.context(chain.entry):
        flow = await _post(chain)
        flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
        flow.response.headers.pop("content-length", None)
        chain.responseheaders(flow)
        from addon.proxy.budgets import METERS

        def boom(chunk: bytes) -> None:
            raise RuntimeError("injected fault")

        meter = METERS[flow]
        assert meter.reader is not None
        monkeypatch.setattr(meter.reader, "feed", boom)
        assert flow.response.stream(b"data: x\n\n") == b"data: x\n\n"
        flow.response.stream(b"")
        waiting = chain.response(flow)
        if waiting is not None:
            await waiting
    assert flow.error is None
    assert [c.estimated for c in live.charges] == [True]


async def test_an_exception_in_the_budget_hook_kills_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chain = _chain(BudgetLive("total=100/day"))
    with taddons.context(chain.entry):
        flow = await _post(chain)
        flow.response = http.Response.make(200, b"{}", {"content-length": "2"})
        monkeypatch.setattr("addon.proxy.budgets.UsageReader", None)
        chain.responseheaders(flow)
    assert flow.error is not None and flow.error.msg == "Connection killed."


async def test_a_charge_the_store_does_not_take_is_logged_with_its_counts() -> None:
    class DownAtCharge(BudgetLive):
        async def charge_budget(
            self, grant_id: int, windows: list[str], charge: Charge, spend: int = 0
        ) -> None:
            raise StoreUnavailable("down")

    chain = _chain(DownAtCharge("total=100/day"))
    lines: list[dict[str, Any]] = []
    with taddons.context(chain.entry), capture_logs() as logs:
        flow = await _post(chain)
        body = json.dumps(USAGE).encode()
        flow.response = http.Response.make(200, body, {"content-length": str(len(body))})
        chain.responseheaders(flow)
        chain.trail.write = lambda rec, decision, **f: lines.append({"rec": rec, **f})
        waiting = chain.response(flow)
        if waiting is not None:
            await waiting
    assert [
        (e["grant_id"], e["input_tokens"], e["output_tokens"])
        for e in logs
        if e["event"] == "budget.charge_failed"
    ] == [(1, 11, 7)]
    (line,) = lines
    assert (line["rec"].input_tokens, line["rec"].output_tokens) == (11, 7)
    assert flow.error is None
