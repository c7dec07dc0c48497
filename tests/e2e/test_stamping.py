"""The credential's slot on the request the upstream sees: the agent's own value for it is
dropped, whatever separator or spelling it came in. The conftest's `rproxy` and its recording
upstream on api.test."""

from __future__ import annotations

import pytest

from store.crypto import Secret
from tests.e2e.conftest import Proxy
from tests.e2e.echoes import (
    SECRET,
    _get,
)
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e


# The client's value for a query credential's parameter is dropped whether '&' or ';'
# separates it: none reaches the upstream beside the stamped one.
@pytest.mark.parametrize(
    "query",
    [
        pytest.param("a=1;key=agent-value", id="a ';'-separated key parameter is not dropped"),
    ],
)
def test_the_query_slot_is_replaced_whatever_the_separator(
    rproxy: Proxy, api: Upstream, names, query: str
):
    principal, cred = names("rva-q"), names("rva-qcred")
    token = rproxy.store.add_principal(principal)
    rproxy.store.add_credential(cred, "query", ["api.test"], Secret(SECRET), param_name="key")
    rproxy.store.add_grant(principal, ["GET"], credential=cred, paths=["/v1/"])
    rproxy.wait_reload()
    reply = _get(
        rproxy,
        (principal, token),
        "api.test",
        f"GET /v1/x?{query} HTTP/1.1\r\nHost: api.test\r\n\r\n",
    )
    assert reply.status == 200
    [received] = api.log.requests
    pairs = received.target.partition("?")[2].replace(";", "&").split("&")
    keys = sum(1 for pair in pairs if pair.split("=", 1)[0] == "key")
    assert keys == 1, "the upstream sees the agent's value for the credential's parameter"


# A header credential's slot is cleared in every spelling a backend reads as it: CGI/WSGI
# read X_Api_Key as X-Api-Key.
@pytest.mark.parametrize(
    "sent", [pytest.param("X_Api_Key", id="X_Api_Key beside the stamped X-Api-Key")]
)
def test_the_header_slot_is_replaced_whatever_the_spelling(
    rproxy: Proxy, api: Upstream, names, sent: str
):
    principal, cred = names("rva-h"), names("rva-hcred")
    token = rproxy.store.add_principal(principal)
    rproxy.store.add_credential(
        cred, "header", ["api.test"], Secret(SECRET), header_name="X-Api-Key"
    )
    rproxy.store.add_grant(principal, ["GET"], credential=cred, paths=["/v1/"])
    rproxy.wait_reload()
    head = f"GET /v1/x HTTP/1.1\r\nHost: api.test\r\n{sent}: agent-value\r\n\r\n"
    reply = _get(rproxy, (principal, token), "api.test", head)
    assert reply.status == 200
    [received] = api.log.requests
    slots = sum(1 for k, _ in received.headers if k.lower().replace("_", "-") == "x-api-key")
    assert slots == 1, "the upstream sees the agent's value in the credential's slot"
