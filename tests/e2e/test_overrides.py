"""Headers a backend reads as the request's method or path: a method override is checked
against the grants like the method it names, in every spelling, and a path override never
reaches the upstream. The conftest's `rproxy` and its recording upstream on api.test."""

from __future__ import annotations

from typing import Any

import pytest

from store.crypto import Secret
from tests.e2e.conftest import Proxy
from tests.e2e.echoes import (
    SECRET,
    _get,
    _principal,
)
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e


def _overrides(api: Upstream, method: str) -> list[Any]:
    """The upstream requests that carried a method override naming `method`."""
    names = {"x-http-method-override", "x-http-method", "x-method-override"}
    return [
        r
        for r in api.log.requests
        if any(k.lower().replace("_", "-") in names and v == method for k, v in r.headers)
    ]


# A method override is checked against the grants that allow its method, so a once-grant it
# relies on is burnt by its first use.
@pytest.mark.parametrize(
    "header",
    [
        pytest.param(
            "X-HTTP-Method-Override",
            id="an override that a once-grant allows is used "
            "over a standing GET grant again and again",
        )
    ],
)
def test_override_never_burns_the_once_grant_it_relies_on(
    rproxy: Proxy, api: Upstream, names, header: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/"])
    rproxy.store.add_grant(
        principal, ["DELETE"], credential=cred, hosts=["api.test"], paths=["/v1/"], once=True
    )
    rproxy.wait_reload()
    head = f"GET /v1/items/7 HTTP/1.1\r\nHost: api.test\r\n{header}: DELETE\r\n\r\n"
    statuses = [_get(rproxy, (principal, token), "api.test", head).status for _ in range(3)]
    # A once-grant serves exactly one request: at most one overridden DELETE goes upstream.
    overridden = len(_overrides(api, "DELETE"))
    assert overridden <= 1, statuses


# A method override granted only by a pass-through grant never carries another grant's
# credential: a credential is used only for the methods its grants allow.
@pytest.mark.parametrize(
    "header",
    [
        pytest.param(
            "X-HTTP-Method-Override",
            id="DELETE granted only without the credential "
            "still goes upstream with the GET grant's credential",
        ),
        pytest.param("X-HTTP-Method", id="the same through X-HTTP-Method"),
    ],
)
def test_override_granted_without_a_credential_carries_the_credential(
    rproxy: Proxy, api: Upstream, names, header: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/"])
    rproxy.store.add_grant(principal, ["DELETE"], hosts=["api.test"], paths=["/v1/"])
    rproxy.wait_reload()
    head = f"GET /v1/items/7 HTTP/1.1\r\nHost: api.test\r\n{header}: DELETE\r\n\r\n"
    _get(rproxy, (principal, token), "api.test", head)
    stamped = [
        r
        for r in _overrides(api, "DELETE")
        if any(SECRET.decode() in v for v in r.header("authorization"))
    ]
    count = len(stamped)
    assert count == 0, "the credential went upstream on a DELETE no credential grant allows"


# A method override granted only with another credential never carries the GET grant's
# credential.
@pytest.mark.parametrize(
    "header",
    [
        pytest.param(
            "X-Method-Override",
            id="DELETE granted only with another credential goes upstream with the GET one's",
        ),
    ],
)
def test_override_granted_with_another_credential_carries_this_one(
    rproxy: Proxy, api: Upstream, names, header: str
):
    principal, token, cred = _principal(rproxy, names)
    other = names("rva-other")
    rproxy.store.add_credential(other, "bearer", ["api.test"], Secret(b"sk-other-" + SECRET[6:]))
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/"])
    rproxy.store.add_grant(principal, ["DELETE"], credential=other, paths=["/v1/"])
    rproxy.wait_reload()
    head = f"GET /v1/items/7 HTTP/1.1\r\nHost: api.test\r\n{header}: DELETE\r\n\r\n"
    _get(rproxy, (principal, token), "api.test", head)
    stamped = [
        r
        for r in _overrides(api, "DELETE")
        if any(v == "Bearer " + SECRET.decode() for v in r.header("authorization"))
    ]
    count = len(stamped)
    assert count == 0, "the GET-only credential went upstream on a DELETE"


# CGI/WSGI backends read X_HTTP_Method_Override as X-HTTP-Method-Override: the underscore
# spellings are checked too.
@pytest.mark.parametrize(
    "header",
    [
        pytest.param(
            "X_HTTP_Method_Override",
            id="an override header spelled with underscores names an ungranted method and passes",
        ),
        pytest.param("X_Method_Override", id="X_Method_Override likewise"),
    ],
)
def test_override_spelled_with_underscores_is_checked(
    rproxy: Proxy, api: Upstream, names, header: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/"])
    rproxy.wait_reload()
    head = f"GET /v1/items/7 HTTP/1.1\r\nHost: api.test\r\n{header}: DELETE\r\n\r\n"
    reply = _get(rproxy, (principal, token), "api.test", head)
    overridden = len(_overrides(api, "DELETE"))
    assert overridden == 0, reply.status


# A backend that honours X-Original-URL or X-Rewrite-URL routes by it: neither reaches the
# upstream on a stamped request to a path no grant allows.
@pytest.mark.parametrize(
    "header",
    [
        pytest.param("X-Original-URL", id="X-Original-URL names an ungranted path and passes"),
        pytest.param("X-Rewrite-URL", id="X-Rewrite-URL names an ungranted path and passes"),
    ],
)
def test_path_override_headers_are_checked_like_the_path(
    rproxy: Proxy, api: Upstream, names, header: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(
        principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/public"]
    )
    rproxy.wait_reload()
    head = f"GET /v1/public HTTP/1.1\r\nHost: api.test\r\n{header}: /admin/keys\r\n\r\n"
    _get(rproxy, (principal, token), "api.test", head)
    overridden = len([r for r in api.log.requests if r.header(header)])
    assert overridden == 0


@pytest.mark.parametrize(
    ("header", "value"),
    [
        pytest.param("X-HTTP-Method-Override", "DELETE", id="an ungranted override is refused"),
        pytest.param("x-method-override", "delete", id="a lower-case override value is refused"),
        pytest.param("X-HTTP-Method", "GET, DELETE", id="a list of methods is refused"),
    ],
)
def test_override_to_an_ungranted_method_is_refused(
    rproxy: Proxy, api: Upstream, names, header: str, value: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/"])
    rproxy.wait_reload()
    head = f"GET /v1/items/7 HTTP/1.1\r\nHost: api.test\r\n{header}: {value}\r\n\r\n"
    reply = _get(rproxy, (principal, token), "api.test", head)
    assert reply.status in (400, 403)
    forwarded = len(api.log.requests)
    assert forwarded == 0
