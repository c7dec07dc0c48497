"""Token budgets end to end: a real proxy, a local TLS provider that answers like OpenAI and
Anthropic (JSON and SSE), httpx as the agent; and Bedrock's Converse through the sigv4 scheme,
boto3 as the agent, against the fake AWS (tests/e2e/fakeaws.py)."""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import trustme
from botocore.config import Config
from botocore.exceptions import ClientError

from store.crypto import Secret
from store.rules import budgets, validation
from tests.e2e.conftest import CREDPROXY, Proxy, start_proxy, stop_proxy
from tests.e2e.fakeaws import BEDROCK_INPUT, BEDROCK_OUTPUT, USAGE, FakeAws, Keys
from tests.e2e.fakemodels import COMPLETION, INPUT, LONG, OUTPUT, FakeModels
from tests.e2e.relay import pg_database

pytestmark = pytest.mark.e2e

OPENAI = "https://api.openai.test/v1/chat/completions"
ANTHROPIC = "https://api.anthropic.test/v1/messages"
PROMPT = "a prompt that must never reach the audit stream"
BEDROCK = "bedrock-runtime.us-east-1.amazonaws.com"
BEDROCK_MODEL = "anthropic.claude-3-haiku-20240307-v1:0"
AWS_KEYS = Keys("AKIA" + secrets.token_hex(8).upper(), "real/" + secrets.token_urlsafe(30))


@pytest.fixture(scope="module")
def models(upstream_ca: trustme.CA) -> Iterator[FakeModels]:
    with FakeModels(upstream_ca) as server:
        yield server


@pytest.fixture(scope="module")
def aws(upstream_ca: trustme.CA) -> Iterator[FakeAws]:
    with FakeAws(upstream_ca, [BEDROCK], AWS_KEYS) as server:
        server.state.release.set()  # ConverseStream sends its events without waiting
        yield server


@pytest.fixture(scope="module")
def proxy(
    tmp_path_factory: pytest.TempPathFactory,
    models: FakeModels,
    aws: FakeAws,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    resolve = [f"{n}=127.0.0.1:{models.port}" for n in ("api.openai.test", "api.anthropic.test")]
    resolve.append(f"{BEDROCK}=127.0.0.1:{aws.port}")
    running = start_proxy(
        tmp_path_factory.mktemp("budgets"), upstream_ca, resolve, template=initialised_home
    )
    yield running
    stop_proxy(running)


def _agent(
    proxy: Proxy,
    names: Callable[[str], str],
    *budget: str,
    bedrock: bool = False,
    cap: bool = False,
) -> tuple[str, str, int]:
    """A principal with a budgeted grant: to the fake OpenAI and Anthropic with a bearer
    token, or to Bedrock with AWS keys (sigv4)."""
    agent, cred = names("agent"), names("llm")
    token = proxy.store.add_principal(agent)
    if bedrock:
        proxy.store.add_credential(cred, "sigv4", [BEDROCK], Secret(AWS_KEYS.json()))
    else:
        proxy.store.add_credential(
            cred, "bearer", ["api.openai.test", "api.anthropic.test"], Secret(b"sk-budget-e2e")
        )
    limits = validation.limits(None, None, budget=budget, cap_max_tokens=cap)
    grant_id = proxy.store.add_grant(
        agent,
        ["POST"],
        credential=cred,
        paths=["/model/"] if bedrock else ["/v1/*"],
        limits=limits,
    )
    proxy.wait_reload()
    return agent, token, grant_id


def _chat(model: str, stream: bool = False, usage: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    return body


def _message(model: str, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 256,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    return body | ({"stream": True} if stream else {})


def _calls(proxy: Proxy, agent: str) -> list[dict[str, Any]]:
    return [r for r in proxy.requests(agent) if "input_tokens" in r]


def _used(proxy: Proxy, grant_id: int, window: str = "day") -> tuple[int, int]:
    key = budgets.window_key(window, datetime.now(UTC))
    usage = proxy.store.budget_used(grant_id, [key])[key]
    return usage.input_tokens, usage.output_tokens


def test_a_spent_daily_budget_answers_429_until_midnight_and_nothing_goes_up(
    proxy: Proxy, models: FakeModels, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=250/day")
    sent = len(models.received)
    with proxy.client(agent, token) as client:
        statuses = [client.post(OPENAI, json=_chat("gpt-test")) for _ in range(4)]
    # 120 tokens an answer: checked before each, so the third (at 240) still goes.
    assert [r.status_code for r in statuses] == [200, 200, 200, 429]
    refused = statuses[-1]
    assert refused.headers["x-credproxy-reason"] == "budget-exhausted"
    now = datetime.now(UTC)
    to_midnight = (budgets.window_end("day", now) - now).total_seconds()
    assert abs(int(refused.headers["retry-after"]) - math.ceil(to_midnight)) <= 5
    problem = refused.json()
    assert problem["reason"] == "budget-exhausted" and "total=250/day" in problem["detail"]
    assert len(models.received) - sent == 3
    assert _used(proxy, grant_id) == (3 * INPUT, 3 * OUTPUT)
    lines = _calls(proxy, agent)
    assert [(r["model"], r["input_tokens"], r["output_tokens"]) for r in lines] == [
        ("gpt-test", INPUT, OUTPUT)
    ] * 3
    assert not any(r["tokens_estimated"] for r in lines)
    # The owner raises it: the usage stays, the new budget counts from it.
    proxy.store.set_grant_budget(grant_id, ["total=400/day"])
    proxy.wait_reload()
    with proxy.client(agent, token) as client:
        assert client.post(OPENAI, json=_chat("gpt-test")).status_code == 200
        assert client.post(OPENAI, json=_chat("gpt-test")).status_code == 429
    assert _used(proxy, grant_id) == (4 * INPUT, 4 * OUTPUT)


def test_an_openai_stream_stays_streamed_and_is_charged_from_its_usage_chunk(
    proxy: Proxy, models: FakeModels, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=100000/day")
    models.gate.clear()
    got: list[str] = []
    with proxy.client(agent, token, timeout=15) as client:
        with client.stream("POST", OPENAI, json=_chat("gated", stream=True)) as answer:
            assert answer.headers["content-type"] == "text/event-stream"
            lines = answer.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    got.append(line)
                    break
            # The provider holds the rest until the agent has read its first event.
            models.gate.set()
            got += [line for line in lines if line.startswith("data:")]
    text = "".join(
        json.loads(g[6:])["choices"][0]["delta"].get("content", "")
        for g in got
        if g.startswith("data: {") and json.loads(g[6:])["choices"]
    )
    assert text == COMPLETION
    assert got[-1] == "data: [DONE]"
    (line,) = _calls(proxy, agent)
    assert (line["model"], line["input_tokens"], line["output_tokens"]) == ("gated", INPUT, OUTPUT)
    assert line["tokens_estimated"] is False
    assert _used(proxy, grant_id) == (INPUT, OUTPUT)


@pytest.mark.parametrize("stream", [False, True], ids=["JSON", "SSE"])
def test_anthropic_messages_are_charged_input_with_cache_and_the_last_output_count(
    proxy: Proxy, names: Callable[[str], str], stream: bool
) -> None:
    agent, token, grant_id = _agent(proxy, names, "input=1000/hour", "output=1000/hour")
    with proxy.client(agent, token) as client:
        answer = client.post(ANTHROPIC, json=_message("claude-test", stream))
    assert answer.status_code == 200
    if stream:
        assert "event: message_delta" in answer.text
    (line,) = _calls(proxy, agent)
    assert (line["model"], line["input_tokens"], line["output_tokens"]) == (
        "claude-test",
        INPUT,
        OUTPUT,
    )
    assert _used(proxy, grant_id, "hour") == (INPUT, OUTPUT)


@pytest.mark.parametrize(
    ("url", "body"),
    [
        pytest.param(OPENAI, _chat("no-usage"), id="OpenAI JSON without usage"),
        pytest.param(OPENAI, _chat("gpt-test", stream=True, usage=False), id="stream, no usage"),
        pytest.param(ANTHROPIC, _message("no-usage", stream=True), id="Anthropic stream, none"),
    ],
)
def test_an_answer_without_usage_is_charged_the_byte_estimate_and_audited_as_estimated(
    proxy: Proxy, names: Callable[[str], str], url: str, body: dict[str, Any]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=100000/day")
    with proxy.client(agent, token) as client:
        answer = client.post(url, json=body)
    assert answer.status_code == 200
    (line,) = _calls(proxy, agent)
    assert line["tokens_estimated"] is True
    assert line["input_tokens"] == math.ceil(line["bytes_out"] / 4)
    assert line["output_tokens"] == math.ceil(len(answer.content) / 4)
    assert _used(proxy, grant_id) == (line["input_tokens"], line["output_tokens"])


def _bedrock(proxy: Proxy, agent: str, token: str) -> Any:
    """boto3's bedrock-runtime client with dummy keys, asking for compressed answers."""
    session = boto3.session.Session(
        aws_access_key_id="AKIADUMMYDUMMYDUMMY1",
        aws_secret_access_key="dummy-secret-access-key",
        region_name="us-east-1",
    )
    client = session.client(
        "bedrock-runtime",
        verify=str(proxy.ca_file),
        config=Config(
            proxies={"https": proxy.url(agent, token)},
            retries={"max_attempts": 1, "mode": "standard"},
        ),
    )

    def gzip(request: Any, **_: Any) -> None:
        request.headers["Accept-Encoding"] = "gzip"

    client.meta.events.register("before-sign.bedrock-runtime.*", gzip)
    return client


MESSAGES = [{"role": "user", "content": [{"text": PROMPT}]}]


def test_bedrock_converse_and_its_stream_charge_the_budget_from_usage_then_429(
    proxy: Proxy, aws: FakeAws, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=250/day", bedrock=True)
    client = _bedrock(proxy, agent, token)
    seen = len(aws.checked)
    answer = client.converse(modelId=BEDROCK_MODEL, messages=MESSAGES)
    assert answer["output"]["message"]["content"] == [{"text": "hello"}]
    events = list(client.converse_stream(modelId=BEDROCK_MODEL, messages=MESSAGES)["stream"])
    assert [next(iter(e)) for e in events][:2] == ["messageStart", "contentBlockDelta"]
    assert events[-1]["metadata"]["usage"] == USAGE  # passed to the agent as sent
    # 120 tokens an answer: checked before each, so the third (at 240) still goes.
    client.converse(modelId=BEDROCK_MODEL, messages=MESSAGES)
    with pytest.raises(ClientError) as refused:
        client.converse(modelId=BEDROCK_MODEL, messages=MESSAGES)
    meta = refused.value.response["ResponseMetadata"]
    assert meta["HTTPStatusCode"] == 429
    assert meta["HTTPHeaders"]["x-credproxy-reason"] == "budget-exhausted"
    checked = aws.checked[seen:]
    assert [c.refused for c in checked] == [None] * 3  # each signature verified as received
    for c in checked:
        # The agent asked for gzip; the budget's plain answers were asked for before signing.
        assert c.received.header("accept-encoding") == ["identity"]
        (authorization,) = c.received.header("authorization")
        assert "accept-encoding" in authorization.split("SignedHeaders=")[1].split(",")[0]
    lines = _calls(proxy, agent)
    assert [
        (r["model"], r["input_tokens"], r["output_tokens"], r["tokens_estimated"]) for r in lines
    ] == [(BEDROCK_MODEL, BEDROCK_INPUT, BEDROCK_OUTPUT, False)] * 3
    assert _used(proxy, grant_id) == (3 * BEDROCK_INPUT, 3 * BEDROCK_OUTPUT)
    assert PROMPT not in proxy.output()


def test_a_bedrock_model_named_by_an_arn_is_audited_and_charged_by_its_arn(
    proxy: Proxy, aws: FakeAws, names: Callable[[str], str]
) -> None:
    arn = (
        "arn:aws:bedrock:us-east-1:123456789012:inference-profile/"
        "us.anthropic.claude-3-5-sonnet-20241022-v2:0"
    )
    assert len(arn) > 100  # kept whole, as a price table names it
    agent, token, _ = _agent(proxy, names, "total=100000/day", bedrock=True)
    _bedrock(proxy, agent, token).converse(modelId=arn, messages=MESSAGES)
    assert aws.checked[-1].received.target.startswith("/model/arn%3Aaws%3Abedrock%3A")
    (line,) = _calls(proxy, agent)
    assert (line["model"], line["input_tokens"], line["tokens_estimated"]) == (
        arn,
        BEDROCK_INPUT,
        False,
    )


@pytest.mark.parametrize(
    "model",
    [
        pytest.param("no-usage", id="a stream without its metadata event"),
        pytest.param("huge", id="an event larger than is read"),
    ],
)
def test_a_bedrock_stream_whose_usage_cannot_be_read_is_charged_the_estimate(
    proxy: Proxy, names: Callable[[str], str], model: str
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=100000/day", bedrock=True)
    client = _bedrock(proxy, agent, token)
    events = list(client.converse_stream(modelId=model, messages=MESSAGES)["stream"])
    assert next(iter(events[-1])) == ("messageStop" if model == "no-usage" else "metadata")
    (line,) = _calls(proxy, agent)
    assert line["model"] == model and line["tokens_estimated"] is True
    assert line["input_tokens"] == math.ceil(line["bytes_out"] / 4)
    assert line["output_tokens"] == math.ceil(line["bytes_in"] / 4)
    assert _used(proxy, grant_id) == (line["input_tokens"], line["output_tokens"])


def test_a_cut_stream_is_charged_what_it_reported_and_the_estimate_for_the_rest(
    proxy: Proxy, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=100000/day")
    with proxy.client(agent, token) as client, pytest.raises(httpx.HTTPError):
        client.post(ANTHROPIC, json=_message("cut", stream=True))
    deadline = time.monotonic() + 3
    while not _calls(proxy, agent) and time.monotonic() < deadline:
        time.sleep(0.05)
    (line,) = _calls(proxy, agent)
    assert line["decision"] == "error"
    # message_start said the input (and one output token): the output is what passed, by bytes.
    assert line["input_tokens"] == INPUT and line["tokens_estimated"] is True
    assert line["output_tokens"] == math.ceil(line["bytes_in"] / 4) > 1
    assert _used(proxy, grant_id) == (INPUT, line["output_tokens"])


def test_the_audit_stream_carries_counts_never_prompts_or_completions(
    proxy: Proxy, names: Callable[[str], str]
) -> None:
    agent, token, _ = _agent(proxy, names, "total=100000/day")
    with proxy.client(agent, token) as client:
        client.post(OPENAI, json=_chat("gpt-test"))
        client.post(ANTHROPIC, json=_message("claude-test", stream=True))
    assert len(_calls(proxy, agent)) == 2
    out = proxy.output()
    assert PROMPT not in out
    assert "Budgets" not in out and "answers." not in out


def test_credproxy_usage_shows_each_budget_and_what_remains(
    proxy: Proxy, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "output=50/hour", "total=1000/day")
    with proxy.client(agent, token) as client:
        assert client.post(OPENAI, json=_chat("gpt-test")).status_code == 200
    shown = subprocess.run(
        [*CREDPROXY, "usage", "--principal", agent, "--json"],
        env=proxy.env,
        cwd=proxy.home,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {r["budget"]: r for r in json.loads(shown.stdout)}
    assert rows["output/hour"]["used"] == OUTPUT and rows["output/hour"]["remaining"] == 30
    assert rows["total/day"]["used"] == INPUT + OUTPUT
    assert rows["total/day"]["remaining"] == 1000 - INPUT - OUTPUT
    assert {r["grant"] for r in rows.values()} == {grant_id}
    table = subprocess.run(
        [*CREDPROXY, "usage", "--principal", agent],
        env=proxy.env,
        cwd=proxy.home,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert table[0].split()[:4] == ["grant", "principal", "state", "budget"]
    assert len(table) == 3


def test_concurrent_requests_overshoot_by_at_most_one_answer_each(
    proxy: Proxy, models: FakeModels, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=600/day")
    barrier = threading.Barrier(8)
    statuses: list[int] = []

    def agent_loop() -> None:
        with proxy.client(agent, token) as client:
            barrier.wait()
            for _ in range(4):
                statuses.append(client.post(OPENAI, json=_chat("gpt-test")).status_code)

    threads = [threading.Thread(target=agent_loop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spent = sum(_used(proxy, grant_id))
    # Checked against what was charged before: at most the 8 in flight pass the last check.
    assert 600 <= spent <= 600 + 8 * (INPUT + OUTPUT)
    assert statuses.count(200) * (INPUT + OUTPUT) == spent
    assert 429 in statuses


def test_a_capping_grant_forwards_max_tokens_capped_to_the_output_left_and_never_overshoots(
    proxy: Proxy, models: FakeModels, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "output=120/day", cap=True)
    with proxy.client(agent, token) as client:
        sent = len(models.received)
        first = client.post(OPENAI, json=_chat("gpt-test"))  # writes OUTPUT: 100 left
        asked = json.dumps(_chat("long") | {"max_tokens": LONG}).encode()
        # The first in chunks (no Content-Length): held whole, capped, sent with its length.
        long = [
            client.post(OPENAI, content=body, headers={"content-type": "application/json"})
            for body in (iter([asked[:20], asked[20:]]), asked)
        ]
    assert first.status_code == 200
    assert models.received[sent][1]["max_completion_tokens"] == 120  # none asked: one set
    assert long[0].status_code == 200
    forwarded = models.received[sent + 1][1]
    assert forwarded["max_tokens"] == 100 and "max_completion_tokens" not in forwarded
    assert forwarded["messages"] == _chat("long")["messages"]
    assert (
        long[1].status_code == 429 and long[1].headers["x-credproxy-reason"] == "budget-exhausted"
    )
    assert len(models.received) - sent == 2
    # Capped, the model writes no more than was left: the output budget is never overshot
    # (uncapped, this one answer alone would have charged LONG output tokens).
    assert _used(proxy, grant_id) == (2 * INPUT, 120)
    assert [r.get("max_tokens") for r in _calls(proxy, agent)] == [120, 100]


def test_a_capping_grant_overshoots_a_total_budget_by_no_more_than_its_input_estimate_missed(
    proxy: Proxy, models: FakeModels, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=300/day", cap=True)
    body = json.dumps(_message("long", stream=True) | {"max_tokens": LONG}).encode()
    estimate = math.ceil(len(body) / 4)
    with proxy.client(agent, token) as client:
        sent = len(models.received)
        answer = client.post(ANTHROPIC, content=body, headers={"content-type": "application/json"})
        refused = client.post(ANTHROPIC, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 200 and "event: message_delta" in answer.text  # still a stream
    assert refused.status_code == 429
    assert models.received[sent][1]["max_tokens"] == 300 - estimate
    # The stated bound: what the provider counted as input beyond the estimate of the body.
    spent = sum(_used(proxy, grant_id))
    assert spent == 300 + (INPUT - estimate)
    assert spent < INPUT + LONG  # what the same request charged uncapped


def test_concurrent_capped_requests_overshoot_an_output_budget_by_what_was_left_each(
    proxy: Proxy, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "output=200/day", cap=True)
    clients = 6
    barrier = threading.Barrier(clients)
    statuses: list[int] = []

    def agent_loop() -> None:
        with proxy.client(agent, token) as client:
            barrier.wait()
            for _ in range(3):
                asked = _chat("long") | {"max_tokens": LONG}
                statuses.append(client.post(OPENAI, json=asked).status_code)

    threads = [threading.Thread(target=agent_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, output = _used(proxy, grant_id)
    # Each in flight was capped to what was left when it was checked, at most the budget:
    # the last check's overshoot is at most (in flight - 1) x 200, never 6 x LONG.
    assert 200 <= output <= 200 + (clients - 1) * 200
    assert 429 in statuses


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory,
    models: FakeModels,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[list[Proxy]]:
    """Two proxies on one PostgreSQL store."""
    with pg_database("credproxy_budget_", required_in_ci=True) as url:
        shared = tmp_path_factory.mktemp("budget-shared")
        shutil.copy2(initialised_home / "credproxy.key", shared / "credproxy.key")
        env = {
            **os.environ,
            "CREDPROXY_DB": url,
            "CREDPROXY_KEY_FILE": str(shared / "credproxy.key"),
        }
        subprocess.run([*CREDPROXY, "init"], env=env, cwd=shared, check=True, capture_output=True)
        resolve = [
            f"{n}=127.0.0.1:{models.port}" for n in ("api.openai.test", "api.anthropic.test")
        ]
        extra = ["--key-file", str(shared / "credproxy.key")]
        running = [
            start_proxy(
                tmp_path_factory.mktemp(f"budget-{label}"),
                upstream_ca,
                resolve,
                extra=extra,
                template=initialised_home,
                db=url,
            )
            for label in ("a", "b")
        ]
        yield running
        for proxy in running:
            stop_proxy(proxy)


def test_two_replicas_on_one_store_overshoot_by_at_most_one_answer_per_request_in_flight(
    replicas: list[Proxy], names: Callable[[str], str]
) -> None:
    a, b = replicas
    agent, token, grant_id = _agent(a, names, "total=1200/day")
    b.wait_reload()
    clients = 6  # per replica
    barrier = threading.Barrier(2 * clients)
    statuses: dict[int, list[int]] = {a.port: [], b.port: []}

    def agent_loop(proxy: Proxy) -> None:
        with proxy.client(agent, token) as client:
            barrier.wait()
            for _ in range(5):
                statuses[proxy.port].append(client.post(OPENAI, json=_chat("gpt-test")).status_code)

    threads = [threading.Thread(target=agent_loop, args=(p,)) for p in [a, b] * clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spent = sum(_used(a, grant_id))
    served = statuses[a.port].count(200) + statuses[b.port].count(200)
    assert served * (INPUT + OUTPUT) == spent  # every answer charged once, by either replica
    assert 1200 <= spent <= 1200 + 2 * clients * (INPUT + OUTPUT)
    assert 429 in statuses[a.port] and 429 in statuses[b.port]


PRICES = b"""
[models."gpt-test"]
input = 2.50
output = 10.00

[models."cheap"]
input = 0.10
output = 0.40
"""


@pytest.fixture(scope="module")
def priced(
    tmp_path_factory: pytest.TempPathFactory,
    models: FakeModels,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    home = tmp_path_factory.mktemp("priced")
    (home / "prices.toml").write_bytes(PRICES)
    resolve = [f"{n}=127.0.0.1:{models.port}" for n in ("api.openai.test", "api.anthropic.test")]
    extra = ["--prices", str(home / "prices.toml")]
    running = start_proxy(home, upstream_ca, resolve, extra=extra, template=initialised_home)
    yield running
    stop_proxy(running)


def test_a_spend_limit_is_charged_by_the_price_table_and_refuses_once_spent(
    priced: Proxy, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(priced, names, "spend=0.001/day")
    with priced.client(agent, token) as client:
        statuses = [client.post(OPENAI, json=_chat("gpt-test")).status_code for _ in range(4)]
    # 100 input tokens at $2.50/M and 20 output at $10/M: $0.00045 an answer.
    assert statuses == [200, 200, 200, 429]
    lines = _calls(priced, agent)
    assert [r["cost_usd"] for r in lines] == [0.00045] * 3
    key = budgets.window_key("day", datetime.now(UTC))
    assert priced.store.budget_used(grant_id, [key])[key].spend_micros == 3 * 450
    shown = subprocess.run(
        [*CREDPROXY, "usage", "--principal", agent, "--json"],
        env=priced.env,
        cwd=priced.home,
        capture_output=True,
        text=True,
        check=True,
    )
    (row,) = json.loads(shown.stdout)
    assert (row["budget"], row["limit"], row["used"], row["remaining"]) == (
        "spend/day",
        0.001,
        0.00135,
        0,
    )


def test_a_model_the_table_does_not_name_costs_its_highest_prices(
    priced: Proxy, names: Callable[[str], str]
) -> None:
    agent, token, _ = _agent(priced, names, "spend=1/day")
    with priced.client(agent, token) as client:
        assert client.post(OPENAI, json=_chat("unlisted-model")).status_code == 200
        assert client.post(OPENAI, json=_chat("cheap")).status_code == 200
    unlisted, cheap = _calls(priced, agent)
    assert unlisted["cost_usd"] == 0.00045  # gpt-test's prices, the table's highest
    assert cheap["cost_usd"] == 0.000018  # 100 * 0.10 + 20 * 0.40 micro-dollars


def test_a_spend_limit_on_a_proxy_without_a_price_table_refuses(
    proxy: Proxy, models: FakeModels, names: Callable[[str], str]
) -> None:
    agent, token, _ = _agent(proxy, names, "spend=5/day")
    sent = len(models.received)
    with proxy.client(agent, token) as client:
        refused = client.post(OPENAI, json=_chat("gpt-test"))
    assert (
        refused.status_code == 429 and refused.headers["x-credproxy-reason"] == "budget-exhausted"
    )
    assert "no price table" in refused.json()["detail"]
    assert len(models.received) == sent
