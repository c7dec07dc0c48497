"""Session tokens through the real proxy: several per principal, revoked and expired ones
refused with 407, also inside a tunnel opened while the token was live."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

import pytest

from store.crypto import Secret
from store.db.models import utcnow
from tests.e2e.conftest import Proxy
from tests.e2e.raw import exchange, get, proxy_auth, tunnel
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SECRET = "sk-session-" + os.urandom(8).hex()


def _granted(proxy: Proxy, names) -> str:
    agent, cred = names("agent"), names("cred")
    proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET.encode()))
    proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"])
    return agent


def test_every_live_token_of_a_principal_is_accepted(proxy: Proxy, upstream: Upstream, names):
    agent = _granted(proxy, names)
    _, first = proxy.store.add_token(agent, None)
    _, second = proxy.store.add_token(agent, utcnow() + timedelta(hours=1))
    proxy.wait_reload()
    assert get(proxy, (agent, first)).status == 200
    assert get(proxy, (agent, second)).status == 200
    assert [r.header("authorization") for r in upstream.log.requests] == [[f"Bearer {SECRET}"]] * 2


def test_a_revoked_session_token_is_refused(proxy: Proxy, upstream: Upstream, names):
    agent = _granted(proxy, names)
    token_id, token = proxy.store.add_token(agent, None)
    _, other = proxy.store.add_token(agent, None)
    proxy.wait_reload()
    assert get(proxy, (agent, token)).status == 200
    proxy.store.revoke_token(token_id)
    proxy.wait_reload()
    reply = get(proxy, (agent, token))
    assert (reply.status, reply.reason) == (407, "auth-required")
    assert get(proxy, (agent, other)).status == 200
    assert len(upstream.log.requests) == 2


def test_an_expired_session_token_is_refused_without_a_store_change(
    proxy: Proxy, upstream: Upstream, names
):
    agent = _granted(proxy, names)
    expires = utcnow() + timedelta(seconds=2)
    _, token = proxy.store.add_token(agent, expires)
    proxy.wait_reload()
    assert get(proxy, (agent, token)).status == 200
    counter = proxy.store.change_counter()
    while datetime.now(UTC) <= expires + timedelta(milliseconds=100):
        time.sleep(0.1)
    assert proxy.store.change_counter() == counter
    reply = get(proxy, (agent, token))
    assert (reply.status, reply.reason) == (407, "auth-required")
    assert len(upstream.log.requests) == 1


def test_a_tunnel_ends_with_the_session_token_that_opened_it(
    proxy: Proxy, upstream: Upstream, names
):
    agent = _granted(proxy, names)
    token_id, token = proxy.store.add_token(agent, None)
    proxy.wait_reload()
    request = b"GET /v1/x HTTP/1.1\r\nHost: api.test\r\n\r\n"
    auth = proxy_auth(agent, token)
    with tunnel(proxy.port, "api.test:443", auth, "api.test", proxy.ca_file) as tls:
        tls.settimeout(10)
        assert exchange(tls, request).status == 200
        proxy.store.revoke_token(token_id)
        proxy.wait_reload()
        reply = exchange(tls, request)
    assert (reply.status, reply.reason) == (407, "auth-required")
    assert len(upstream.log.requests) == 1


def test_a_tunnel_ends_with_the_principal_that_opened_it_though_its_name_returns(
    proxy: Proxy, upstream: Upstream, names
):
    """A principal removed and added again is another principal: a tunnel the old one opened
    with its long-lived token must not go on with the new one's grants."""
    agent = names("agent")
    old = proxy.store.add_principal(agent)
    cred = names("cred")
    proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET.encode()))
    proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"])
    proxy.wait_reload()
    request = b"GET /v1/x HTTP/1.1\r\nHost: api.test\r\n\r\n"
    auth = proxy_auth(agent, old)
    with tunnel(proxy.port, "api.test:443", auth, "api.test", proxy.ca_file) as tls:
        tls.settimeout(10)
        assert exchange(tls, request).status == 200
        proxy.store.remove_principal(agent)
        new = proxy.store.add_principal(agent)
        proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"])
        proxy.wait_reload()
        reply = exchange(tls, request)
    assert (reply.status, reply.reason) == (407, "auth-required")
    assert len(upstream.log.requests) == 1
    assert get(proxy, (agent, new)).status == 200  # the new principal, with its own token
    assert get(proxy, (agent, old)).status == 407
