"""Raising a spent budget, end to end: a real proxy with a local webhook (`--notify`), a local
model provider, the owner's CLI in a subprocess. A spent budget records a budget request the
owner approves with a new budget; on a grant held for approval, a request over a spent budget
is held, and the owner's approval lets that one request go."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from store.crypto import Secret
from store.rules import budgets, validation
from tests.e2e.conftest import CREDPROXY, Proxy, start_proxy, stop_proxy
from tests.e2e.fakemodels import INPUT, OUTPUT, FakeModels
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

OPENAI = "https://api.openai.test/v1/chat/completions"
PROMPT = "a prompt that must never reach the audit stream or the webhook"
KEY = b"sk-raise-e2e"
ANSWER = INPUT + OUTPUT  # tokens each answer reports


@pytest.fixture(scope="module")
def models(upstream_ca: trustme.CA) -> Iterator[FakeModels]:
    with FakeModels(upstream_ca) as server:
        yield server


@pytest.fixture(scope="module")
def hook(upstream_ca: trustme.CA) -> Iterator[Upstream]:
    with Upstream(upstream_ca, ["hooks.test"]) as server:
        yield server


@pytest.fixture(scope="module")
def proxy(
    tmp_path_factory: pytest.TempPathFactory,
    models: FakeModels,
    hook: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    resolve = [f"api.openai.test=127.0.0.1:{models.port}", f"hooks.test=127.0.0.1:{hook.port}"]
    extra = ["--notify", "https://hooks.test/hook"]
    running = start_proxy(
        tmp_path_factory.mktemp("raise"), upstream_ca, resolve, extra, template=initialised_home
    )
    yield running
    stop_proxy(running)


def cli(proxy: Proxy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CREDPROXY, *args], env=proxy.env, cwd=proxy.home, capture_output=True, text=True
    )


def _agent(
    proxy: Proxy, names: Callable[[str], str], budget: str, **held: str
) -> tuple[str, str, int]:
    agent, cred = names("agent"), names("llm")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", ["api.openai.test"], Secret(KEY))
    limits = validation.limits(None, None, budget=(budget,), **held)
    grant_id = proxy.store.add_grant(
        agent, ["POST"], credential=cred, paths=["/v1/*"], limits=limits
    )
    proxy.wait_reload()
    return agent, token, grant_id


def _chat() -> dict[str, Any]:
    return {"model": "gpt-test", "messages": [{"role": "user", "content": PROMPT}]}


def _post(proxy: Proxy, agent: str, token: str) -> httpx.Response:
    with proxy.client(agent, token, timeout=60) as client:
        return client.post(OPENAI, json=_chat())


def _send(proxy: Proxy, agent: str, token: str) -> Future[httpx.Response]:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(_post, proxy, agent, token)
    pool.shutdown(wait=False)
    return future


def _used(proxy: Proxy, grant_id: int) -> int:
    key = budgets.window_key("day", datetime.now(UTC))
    usage = proxy.store.budget_used(grant_id, [key])[key]
    return usage.input_tokens + usage.output_tokens


def _lines(proxy: Proxy, event: str, agent: str, count: int = 1) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [
            line
            for line in proxy.audit()
            if line.get("event") == event and line.get("principal") == agent
        ]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {event} line of {agent}")


def _posted(hook: Upstream, agent: str, event: str, spent: bool = True) -> list[dict[str, Any]]:
    """The webhook's events of `agent`, once one is there (with `spent`: one over a budget)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [json.loads(r.body) for r in hook.log.requests]
        mine = [e for e in found if e.get("principal") == agent and e.get("event") == event]
        mine = [e for e in mine if "spent" in e] if spent else mine
        if mine:
            return mine
        time.sleep(0.05)
    raise AssertionError(f"the webhook got no {event} of {agent}")


def test_a_spent_budget_records_a_request_the_owner_raises_it_with(
    proxy: Proxy, hook: Upstream, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=250/day")
    assert [_post(proxy, agent, token).status_code for _ in range(3)] == [200, 200, 200]
    refused = [_post(proxy, agent, token) for _ in range(2)]
    assert [r.status_code for r in refused] == [429, 429]
    first, again = (r.json() for r in refused)
    assert first["reason"] == "budget-exhausted" and "retry-after" in refused[0].headers
    asked = first["access_request"]
    assert asked["state"] == "pending" and again["access_request"] == asked  # one request
    (recorded,) = _lines(proxy, "budget_request.recorded", agent)
    assert (recorded["id"], recorded["grant_id"], recorded["spent"]) == (
        asked["id"],
        grant_id,
        "total=250/day",
    )
    (posted,) = _posted(hook, agent, "budget_request.recorded")
    assert f"credproxy request approve {asked['id']} --budget" in posted["text"]
    assert (posted["grant_id"], posted["spent"]) == (grant_id, "total=250/day")
    listed = json.loads(cli(proxy, "request", "list", "--state", "pending", "--json").stdout)
    (row,) = [r for r in listed if r["id"] == asked["id"]]
    assert (row["kind"], row["grant_id"], row["budget_spent"]) == (
        "budget",
        grant_id,
        "total=250/day",
    )
    plain = cli(proxy, "request", "approve", str(asked["id"]))
    assert (plain.returncode, plain.stdout) == (2, "")
    assert "approve it with --budget" in plain.stderr and "Traceback" not in plain.stderr
    raised = cli(proxy, "request", "approve", str(asked["id"]), "--budget", "total=400/day")
    assert raised.returncode == 0, raised.stderr
    assert "grant" in raised.stdout and "total=400/day" in raised.stdout
    proxy.wait_reload()
    # What was charged still counts: 360 of 400, so one more goes and the next is refused.
    assert _post(proxy, agent, token).status_code == 200
    assert _post(proxy, agent, token).status_code == 429
    assert _used(proxy, grant_id) == 4 * ANSWER
    (decided,) = _lines(proxy, "access_request.approved", agent)
    assert decided["id"] == asked["id"] and decided["grant_id"] == grant_id
    assert (decided["kind"], decided["budget_was"], decided["budget"]) == (
        "budget",
        "total=250/day",
        "total=400/day",
    )
    assert decided["operator"].startswith("cli")
    for text in [proxy.output(), *(r.body.decode() for r in hook.log.requests)]:
        assert PROMPT not in text and KEY.decode() not in text


def test_over_a_spent_budget_a_held_grant_asks_and_one_approval_lets_one_go(
    proxy: Proxy, hook: Upstream, models: FakeModels, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=100/day", approval="first", hold="30s")
    first = _send(proxy, agent, token)
    (held,) = _lines(proxy, "approval.pending", agent)
    assert "spent" not in held  # the budget has tokens left: an ordinary hold
    assert cli(proxy, "request", "approve", str(held["id"])).returncode == 0
    assert first.result(timeout=15).status_code == 200
    # Spent now (120 of 100): the kind the approval covers is held again, over the budget.
    sent = len(models.received)
    over = _send(proxy, agent, token)
    _, overheld = _lines(proxy, "approval.pending", agent, 2)
    assert (overheld["grant_id"], overheld["spent"]) == (grant_id, "total=100/day")
    (posted,) = _posted(hook, agent, "approval.pending")
    assert posted["spent"] == "total=100/day" and "lets this one request go" in posted["text"]
    assert not over.done() and len(models.received) == sent
    refused = cli(proxy, "request", "approve", str(overheld["id"]), "--next", "5")
    assert refused.returncode == 2 and "over its budget" in refused.stderr
    assert cli(proxy, "request", "approve", str(overheld["id"])).returncode == 0
    assert over.result(timeout=15).status_code == 200
    assert _used(proxy, grant_id) == 2 * ANSWER  # let go, and charged
    # That approval covered no other: the next is held again, and a denial answers 429.
    third = _send(proxy, agent, token)
    *_, again = _lines(proxy, "approval.pending", agent, 3)
    assert again["id"] != overheld["id"] and again["spent"] == "total=100/day"
    assert cli(proxy, "request", "deny", str(again["id"])).returncode == 0
    answer = third.result(timeout=15)
    assert answer.status_code == 429
    problem = answer.json()
    assert problem["reason"] == "budget-exhausted" and "denied going over" in problem["detail"]
    assert problem["access_request"] == {"id": again["id"], "state": "denied"}
    assert int(answer.headers["retry-after"]) > 0
    assert len(models.received) == sent + 1 and _used(proxy, grant_id) == 2 * ANSWER
    decided = _lines(proxy, "access_request.approved", agent, 2)
    assert decided[-1]["id"] == overheld["id"] and decided[-1]["spent"] == "total=100/day"


def test_a_request_held_over_its_budget_that_no_one_decides_gets_429(
    proxy: Proxy, models: FakeModels, names: Callable[[str], str]
) -> None:
    agent, token, grant_id = _agent(proxy, names, "total=1/day", approval="each", hold="2s")
    proxy.store.charge_budget(grant_id, [budgets.window_key("day", datetime.now(UTC))], 1, 0, False)
    sent = len(models.received)
    answer = _post(proxy, agent, token)
    assert answer.status_code == 429
    problem = answer.json()
    assert "no owner let this request go over it" in problem["detail"]
    assert problem["access_request"]["state"] == "expired"
    assert len(models.received) == sent
