"""Usage control end to end: grant and principal rates, use counts, through a real proxy."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from store.crypto import Secret
from store.rules import validation
from tests.e2e.conftest import Proxy
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SECRET = b"sk-usage-e2e-secret"


def _granted(proxy: Proxy, names, limits: validation.Limits, principal_limits=None, tag=""):
    agent, cred = names(f"agent{tag}"), names(f"cred{tag}")
    token = proxy.store.add_principal(agent, principal_limits or validation.NO_LIMITS)
    proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    grant_id = proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"], limits=limits)
    proxy.wait_reload()
    return agent, token, grant_id


def test_over_a_grants_rate_the_agent_gets_429_with_retry_after_and_nothing_goes_up(
    proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, grant_id = _granted(proxy, names, validation.limits("3/h", None))
    with proxy.client(agent, token) as client:
        statuses = [client.get("https://api.test/v1/x") for _ in range(5)]
    assert [r.status_code for r in statuses] == [200, 200, 200, 429, 429]
    refused = statuses[-1]
    assert refused.headers["x-credproxy-reason"] == "rate-limited"
    assert 1 <= int(refused.headers["retry-after"]) <= 1200
    assert len(upstream.log.requests) == 3
    denials = [r for r in proxy.requests(agent) if r["decision"] == "deny"]
    assert {(d["reason"], d["detail"]) for d in denials} == {
        ("rate-limited", f"over the rate 3/h of grant {grant_id}")
    }


def test_a_use_counted_grant_lets_exactly_its_uses_through(
    proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, _ = _granted(proxy, names, validation.limits(None, None, 3))
    barrier = threading.Barrier(12)

    def one(_: int) -> int:
        with proxy.client(agent, token) as client:
            barrier.wait()
            return client.get("https://api.test/v1/counted").status_code

    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(one, range(12)))
    assert statuses.count(200) == 3
    assert statuses.count(403) == 9
    assert len(upstream.log.requests) == 3
    reasons = {r.get("reason") for r in proxy.requests(agent) if r["decision"] == "deny"}
    assert reasons == {"grant-consumed"}


def test_a_denied_request_never_spends_a_use(proxy: Proxy, upstream: Upstream, names) -> None:
    agent, token, grant_id = _granted(proxy, names, validation.limits(None, None, 2))
    with proxy.client(agent, token) as client:
        assert client.get("https://api.test/v2/not-granted").status_code == 403
        assert client.post("https://api.test/v1/x").status_code == 403
    (entry,) = [g for g in proxy.store.list_grants() if g.id == grant_id]
    assert entry.uses == 0


def test_a_flooding_principal_is_limited_while_another_is_served(
    proxy: Proxy, upstream: Upstream, names
) -> None:
    flooder, flood_token, _ = _granted(
        proxy, names, validation.NO_LIMITS, principal_limits=validation.limits("5/m", None)
    )
    calm, calm_token, _ = _granted(proxy, names, validation.NO_LIMITS, tag="calm")
    stop = threading.Event()
    flood_statuses: list[int] = []

    def flood() -> None:
        with proxy.client(flooder, flood_token) as client:
            while not stop.is_set() and len(flood_statuses) < 200:
                flood_statuses.append(client.get("https://api.test/v2/anything").status_code)

    flooding = threading.Thread(target=flood)
    flooding.start()
    try:
        with proxy.client(calm, calm_token) as client:
            calm_statuses = [client.get("https://api.test/v1/calm").status_code for _ in range(20)]
    finally:
        stop.set()
        flooding.join()
    assert calm_statuses == [200] * 20
    # Its first five requests are judged (and denied: /v2 is not granted); the rest are
    # turned away at the door, before the grant lookup or an access request.
    assert flood_statuses[:5] == [403] * 5
    assert set(flood_statuses[5:]) == {429}
    assert len(flood_statuses) > 5


def test_a_rate_limited_answer_carries_no_secret(proxy: Proxy, names) -> None:
    agent, token, _ = _granted(proxy, names, validation.limits("1/h", None))
    with proxy.client(agent, token) as client:
        client.get("https://api.test/v1/x")
        refused = client.get("https://api.test/v1/x")
    assert refused.status_code == 429
    assert SECRET not in refused.content and SECRET.decode() not in str(refused.headers)
    assert SECRET.decode() not in proxy.output()


def test_a_request_refused_by_a_grants_rate_spends_nothing_of_the_principals(
    proxy: Proxy, upstream: Upstream, names
) -> None:
    agent, token, _ = _granted(
        proxy,
        names,
        validation.limits("1/h", None),
        principal_limits=validation.limits("3/h", None),
    )
    cred = names("cred")
    proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/v2/"])
    proxy.wait_reload()
    with proxy.client(agent, token) as client:
        statuses = [client.get(f"https://api.test/{p}/x").status_code for p in ("v1", "v1", "v1")]
        # Two refusals by the grant's rate spent none of the principal's three tokens.
        statuses += [client.get("https://api.test/v2/x").status_code for _ in range(3)]
    assert statuses == [200, 429, 429, 200, 200, 429]
