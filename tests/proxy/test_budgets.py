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
from addon.core.policy import Rule
from addon.core.usage import Charge
from addon.proxy.budgets import METERS, _path_model
from store.errors import StoreUnavailable
from store.records import Usage
from store.rules import budgets
from tests.e2e.fakeaws import BEDROCK_INPUT, BEDROCK_OUTPUT, event
from tests.e2e.fakeaws import USAGE as BEDROCK_USAGE
from tests.fakes import CRED, Chain, StaticLive, grant, https_flow, reason, snapshot_policy

USAGE = {"usage": {"prompt_tokens": 11, "completion_tokens": 7}, "model": "m"}


class BudgetLive(StaticLive):
    """A live policy whose store holds `used` tokens in every window and records charges."""

    def __init__(self, budget: str, used: int = 0, down: bool = False, cap: bool = False) -> None:
        record = dataclasses.replace(
            grant(1, methods=("POST", "GET")), budget=budgets.parse([budget], cap)
        )
        super().__init__(snapshot_policy(record))
        self.used, self.down, self.policy_cap = used, down, cap
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


async def test_an_event_stream_passes_unchanged_and_is_charged_from_its_metadata() -> None:
    live = BudgetLive("total=1000/day")
    chain = _chain(live)
    answer = event("messageStart", {"role": "assistant"}) + event(
        "metadata", {"usage": BEDROCK_USAGE, "metrics": {"latencyMs": 1}}
    )
    with taddons.context(chain.entry):
        flow = await _post(chain)
        kind = {"content-type": "application/vnd.amazon.eventstream"}
        flow.response = http.Response.make(200, b"", kind)
        flow.response.headers.pop("content-length", None)
        chain.responseheaders(flow)
        stream = flow.response.stream
        assert callable(stream)
        out = [stream(answer[at : at + 5]) for at in range(0, len(answer), 5)] + [stream(b"")]
        waiting = chain.response(flow)
        if waiting is not None:
            await waiting
    assert b"".join(o if isinstance(o, bytes) else b"".join(o) for o in out) == answer
    # api.test is no Bedrock endpoint: its path names no model.
    assert [(c.model, c.input_tokens, c.output_tokens, c.estimated) for c in live.charges] == [
        (None, BEDROCK_INPUT, BEDROCK_OUTPUT, False)
    ]


BEDROCK = "bedrock-runtime.us-east-1.amazonaws.com"
CONVERSE = "/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse-stream"
SIGV4 = dataclasses.replace(CRED, scheme="sigv4")


@pytest.mark.parametrize(
    ("credential", "host", "expected"),
    [
        pytest.param(SIGV4, BEDROCK, "anthropic.claude-3-haiku-20240307-v1:0", id="signed for it"),
        pytest.param(
            CRED, BEDROCK, "anthropic.claude-3-haiku-20240307-v1:0", id="a Bedrock API key"
        ),
        pytest.param(
            dataclasses.replace(SIGV4, options={"service": "bedrock", "region": "us-east-1"}),
            "llm.internal.test",
            "anthropic.claude-3-haiku-20240307-v1:0",
            id="another name, signed for Bedrock by --service",
        ),
        pytest.param(CRED, "api.test", None, id="elsewhere the path is the agent's to write"),
        pytest.param(SIGV4, "sqs.eu-west-1.amazonaws.com", None, id="another AWS service"),
        pytest.param(
            dataclasses.replace(SIGV4, options={"service": "sqs"}),
            BEDROCK,
            None,
            id="a Bedrock name signed for another service",
        ),
    ],
)
def test_the_path_names_the_model_only_for_bedrock(
    credential: Any, host: str, expected: str | None
) -> None:
    rule = Rule(1, credential, (), None, (), False, False, None)
    assert _path_model(rule, host, CONVERSE) == expected


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        pytest.param(200, "named-by-path", id="a success: the model named by the path ran"),
        pytest.param(400, None, id="an error: the path's name is only the agent's"),
    ],
)
async def test_the_path_names_the_model_only_of_a_successful_answer(
    status: int, expected: str | None
) -> None:
    live = BudgetLive("total=100/day")
    chain = _chain(live)
    with taddons.context(chain.entry):
        flow = await _post(chain)
        METERS[flow].model = "named-by-path"
        body = b'{"message": "no such model"}'
        flow.response = http.Response.make(status, body, {"content-length": str(len(body))})
        chain.responseheaders(flow)
        waiting = chain.response(flow)
        if waiting is not None:
            await waiting
    assert [c.model for c in live.charges] == [expected]


CHAT = b"/v1/chat/completions"


async def _capped(
    live: BudgetLive, body: bytes, path: bytes = CHAT, headers: dict[str, str] | None = None
) -> Any:
    """A request of a capping grant through requestheaders and, its body whole, request."""
    chain = _chain(live)
    with taddons.context(chain.entry):
        flow = https_flow(chain, path)
        flow.request.method = "POST"
        flow.request.headers.update(headers or {})
        chunked = "transfer-encoding" in (headers or {})
        if chunked:
            del flow.request.headers["content-length"]
        await chain.requestheaders(flow)
        if flow.response is None and live.policy_cap:
            # Held for its body: nothing stamped yet.
            assert flow.request.headers.get("authorization") is None
        flow.request.raw_content = body  # the body as it came, once whole
        if not chunked:
            flow.request.headers["content-length"] = str(len(body))
        await chain.request(flow)
    return flow


async def test_a_capping_grant_forwards_max_tokens_capped_to_the_output_left() -> None:
    flow = await _capped(BudgetLive("output=100/day", cap=True), b'{"max_tokens": 1000}')
    assert flow.response is None
    assert flow.request.raw_content == b'{"max_tokens": 100}'
    assert flow.request.headers["content-length"] == "19"
    assert flow.request.headers["authorization"]  # stamped after the cap
    assert flow.metadata["credproxy"].max_tokens == 100
    assert flow.metadata["credproxy"].bytes_out == 19


async def test_without_the_cap_the_body_goes_as_sent() -> None:
    flow = await _capped(BudgetLive("output=100/day"), b'{"max_tokens": 1000}')
    assert flow.response is None and flow.request.raw_content == b'{"max_tokens": 1000}'


@pytest.mark.parametrize(
    ("body", "headers", "path", "status", "why"),
    [
        pytest.param(b"not json", {}, CHAT, 400, "body-undecidable", id="not JSON"),
        pytest.param(
            b'{"max_tokens": 1000}',
            {"content-encoding": "gzip"},
            CHAT,
            400,
            "body-undecidable",
            id="compressed",
        ),
        pytest.param(b'{"input": "x"}', {}, b"/v1/embeddings", 400, "body-undecidable", id="api"),
        pytest.param(b'{"n": 200}', {}, CHAT, 429, "budget-exhausted", id="too little left"),
    ],
)
async def test_a_capping_grant_refuses_what_it_cannot_cap_before_stamping(
    body: bytes, headers: dict[str, str], path: bytes, status: int, why: str
) -> None:
    flow = await _capped(BudgetLive("output=100/day", cap=True), body, path, headers)
    assert flow.response.status_code == status and reason(flow) == why
    assert flow.request.headers.get("authorization") is None
    if why == "budget-exhausted":
        assert 1 <= int(flow.response.headers["retry-after"]) <= 86400


async def test_a_capping_grant_refuses_a_body_over_its_bound_from_its_length() -> None:
    from addon.core.capping import MAX_CAPPED_BODY

    length = str(MAX_CAPPED_BODY + 1)
    live = BudgetLive("output=100/day", cap=True)
    chain = _chain(live)
    with taddons.context(chain.entry):
        flow = https_flow(chain, CHAT)
        flow.request.method = "POST"
        flow.request.headers["content-length"] = length
        await chain.requestheaders(flow)
    assert flow.response.status_code == 413 and reason(flow) == "body-too-large"


async def test_a_capping_grant_forwards_a_request_without_a_body_unchanged() -> None:
    flow = await _capped(BudgetLive("output=100/day", cap=True), b"", b"/v1/models")
    assert flow.response is None and flow.request.raw_content == b""


async def test_a_capped_body_that_came_in_chunks_goes_with_its_length() -> None:
    live = BudgetLive("output=100/day", cap=True)
    flow = await _capped(live, b'{"max_tokens": 1000}', CHAT, {"transfer-encoding": "chunked"})
    assert flow.response is None and "transfer-encoding" not in flow.request.headers
    assert flow.request.headers["content-length"] == "19"


async def test_a_long_conversation_is_capped_off_the_event_loop_all_the_same() -> None:
    from addon.proxy.budgets import OFF_LOOP

    messages = [{"role": "user", "content": "x" * 100}] * (OFF_LOOP // 50)
    body = json.dumps({"messages": messages, "max_tokens": 1000}).encode()
    flow = await _capped(BudgetLive("output=100/day", cap=True), body)
    assert flow.response is None and len(body) > OFF_LOOP
    assert flow.request.raw_content == body.replace(b'"max_tokens": 1000', b'"max_tokens": 100')
