"""Grants decided on the body, end to end: a real GraphQL server (graphql-core) behind the proxy,
real clients, and the hostile shapes a mutation hides in.

Nothing is mocked: the upstream executes the documents it receives with graphql-core.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import trustme
from graphql import build_schema, graphql_sync

from store.crypto import Secret
from store.rules import bodyrules, validation
from tests.e2e.conftest import NAMES, Proxy
from tests.e2e.raw import exchange, proxy_auth, tunnel
from tests.e2e.upstream import Answer, Received, Upstream

pytestmark = pytest.mark.e2e

SECRET = b"ghp-body-rules-e2e-secret"
SCHEMA = build_schema(
    """
    type Query { viewer: String, issues: [String] }
    type Mutation {
      addComment(body: String): String
      deleteRepository(name: String): String
      createIssue: String
    }
    """
)
ROOT = {
    "viewer": "octocat",
    "issues": ["#1"],
    "addComment": lambda info, **kw: "commented",
    "deleteRepository": lambda info, **kw: "deleted",
    "createIssue": lambda info, **kw: "created",
}


def _graphql(received: Received) -> Answer | None:
    """The upstream: executes what it is sent, as a GraphQL server would."""
    if not received.target.startswith("/graphql"):
        return None
    try:
        if received.method == "GET":
            params = parse_qs(urlsplit(received.target).query)
            request = {"query": params["query"][0]}
        else:
            request = json.loads(received.body)
    except (ValueError, KeyError):
        return 400, [], b"bad request"
    requests = request if isinstance(request, list) else [request]
    results = []
    for one in requests:
        result = graphql_sync(
            SCHEMA,
            one.get("query") or "",
            root_value=ROOT,
            variable_values=one.get("variables"),
            operation_name=one.get("operationName"),
        )
        results.append(
            {"data": result.data, "errors": [str(e) for e in result.errors or []] or None}
        )
    body = json.dumps(results if isinstance(request, list) else results[0]).encode()
    return 200, [("content-type", "application/json")], body


@pytest.fixture(scope="module")
def shared_upstream(upstream_ca: trustme.CA) -> Iterator[Upstream]:
    with Upstream(upstream_ca, NAMES, app=_graphql) as server:
        yield server


def _granted(proxy: Proxy, names, graphql: dict, methods=("POST",), limits=None):
    agent, cred = names("gql"), names("ghcred")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    proxy.store.add_grant(
        agent,
        list(methods),
        credential=cred,
        paths=["/graphql"],
        limits=limits or validation.NO_LIMITS,
        body=bodyrules.parse("graphql", graphql),
    )
    proxy.wait_reload()
    return agent, token


READ_AND_COMMENT = {"query": "*", "mutation": ["addComment"]}


def _post(client: httpx.Client, payload, **kwargs) -> httpx.Response:
    return client.post("https://api.test/graphql", json=payload, **kwargs)


def test_a_query_and_a_granted_mutation_pass_stamped(proxy: Proxy, upstream: Upstream, names):
    agent, token = _granted(proxy, names, READ_AND_COMMENT)
    with proxy.client(agent, token) as client:
        read = _post(client, {"query": "query Who { viewer issues }"})
        wrote = _post(client, {"query": 'mutation { addComment(body: "hi") }'})
    assert read.status_code == 200 and read.json()["data"] == {
        "viewer": "octocat",
        "issues": ["#1"],
    }
    assert wrote.status_code == 200 and wrote.json()["data"] == {"addComment": "commented"}
    assert [r.header("authorization") for r in upstream.log.requests] == [
        [f"Bearer {SECRET.decode()}"]
    ] * 2
    lines = proxy.requests(agent)
    assert [line["body"] for line in lines] == [
        {"graphql": [{"type": "query", "name": "Who", "fields": ["viewer", "issues"]}]},
        {"graphql": [{"type": "mutation", "name": None, "fields": ["addComment"]}]},
    ]


HIDDEN_MUTATIONS = {
    "plain": {"query": 'mutation { deleteRepository(name: "x") }'},
    "an alias": {"query": 'mutation { addComment: deleteRepository(name: "x") }'},
    "a fragment spread": {
        "query": 'mutation { ...F } fragment F on Mutation { deleteRepository(name: "x") }'
    },
    "an inline fragment": {"query": 'mutation { ... on Mutation { deleteRepository(name: "x") } }'},
    "a second operation named away": {
        "query": 'query Fine { viewer } mutation Bad { deleteRepository(name: "x") }',
        "operationName": "Fine",
    },
    "a batch": [
        {"query": "{ viewer }"},
        {"query": 'mutation { deleteRepository(name: "x") }'},
    ],
    "a persisted hash": {
        "extensions": {"persistedQuery": {"version": 1, "sha256Hash": "ab" * 32}},
    },
}


@pytest.mark.parametrize("payload", HIDDEN_MUTATIONS.values(), ids=HIDDEN_MUTATIONS.keys())
def test_a_mutation_outside_the_grant_is_refused_wherever_it_hides(
    proxy: Proxy, upstream: Upstream, names, payload
):
    agent, token = _granted(proxy, names, READ_AND_COMMENT)
    with proxy.client(agent, token) as client:
        refused = _post(client, payload)
    assert refused.status_code == 403
    assert refused.headers["x-credproxy-reason"] == "operation-not-allowed"
    assert upstream.log.requests == []
    assert SECRET.decode() not in refused.text
    # No access request: approving one would grant the path with any body (access-requests.md).
    assert "access_request" not in refused.json()
    assert [r for r in proxy.store.list_access_requests(None) if r.principal == agent] == []


def test_a_mutation_in_a_get_query_string_is_refused(proxy: Proxy, upstream: Upstream, names):
    agent, token = _granted(proxy, names, {"query": "*"}, methods=("GET", "POST"))
    with proxy.client(agent, token) as client:
        read = client.get("https://api.test/graphql", params={"query": "{ viewer }"})
        refused = client.get(
            "https://api.test/graphql", params={"query": 'mutation { deleteRepository(name: "x") }'}
        )
    assert read.status_code == 200  # decided on the query string; the server got it
    assert refused.status_code == 403
    assert refused.headers["x-credproxy-reason"] == "operation-not-allowed"
    assert len(upstream.log.requests) == 1


UNDECIDABLE = {
    "duplicate keys": (
        b'{"query": "{ viewer }", "query": "mutation { deleteRepository }"}',
        {"content-type": "application/json"},
    ),
    "utf-16": ('{"query": "{ viewer }"}'.encode("utf-16"), {"content-type": "application/json"}),
    "gzip": (
        gzip.compress(b'{"query": "{ viewer }"}'),
        {"content-type": "application/json", "content-encoding": "gzip"},
    ),
    "a form": (b"query=%7B+viewer+%7D", {"content-type": "application/x-www-form-urlencoded"}),
    "no parse": (b'{"query": "{ viewer "}', {"content-type": "application/json"}),
}


@pytest.mark.parametrize("case", UNDECIDABLE.values(), ids=UNDECIDABLE.keys())
def test_a_body_that_cannot_be_read_with_certainty_is_refused(
    proxy: Proxy, upstream: Upstream, names, case
):
    body, headers = case
    agent, token = _granted(proxy, names, {"query": "*"})
    with proxy.client(agent, token) as client:
        refused = client.post("https://api.test/graphql", content=body, headers=headers)
    assert refused.status_code in (400, 415)
    assert refused.headers["x-credproxy-reason"] == "body-undecidable"
    assert upstream.log.requests == []


# Two fields would let the proxy decide on one and the upstream read the other: a plain
# JSON query to credproxy, a form or a gzip body to a server that reads the last field.
DUPLICATE_FIELDS = {
    "two Content-Type fields": [
        ("content-type", "application/json"),
        ("content-type", "application/x-www-form-urlencoded"),
    ],
    "two Content-Encoding fields": [
        ("content-type", "application/json"),
        ("content-encoding", "identity"),
        ("content-encoding", "gzip"),
    ],
}


@pytest.mark.parametrize("fields", DUPLICATE_FIELDS.values(), ids=DUPLICATE_FIELDS.keys())
def test_a_body_with_two_type_or_coding_fields_is_refused(
    proxy: Proxy, upstream: Upstream, names, fields
):
    agent, token = _granted(proxy, names, {"query": "*"})
    with proxy.client(agent, token) as client:
        refused = client.post(
            "https://api.test/graphql", content=b'{"query": "{ viewer }"}', headers=fields
        )
    assert refused.status_code == 400
    assert refused.headers["x-credproxy-reason"] == "body-undecidable"
    assert upstream.log.requests == []


def test_a_declared_over_long_body_is_refused_before_a_byte_of_it_is_read(
    proxy: Proxy, upstream: Upstream, names
):
    """Content-Length over the bound: 413 at once, while the client has sent none of it."""
    agent, token = _granted(proxy, names, {"query": "*"})
    head = (
        "POST /graphql HTTP/1.1\r\nHost: api.test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {2 * 1024 * 1024}\r\n\r\n"
    ).encode()
    started = time.monotonic()
    with tunnel(
        proxy.port, "api.test:443", proxy_auth(agent, token), "api.test", proxy.ca_file
    ) as tls:
        tls.settimeout(5)
        reply = exchange(tls, head)
    assert time.monotonic() - started < 4
    assert reply.status == 413
    assert reply.headers.get("x-credproxy-reason") == "body-too-large"
    assert upstream.log.requests == []


def test_an_over_long_body_is_refused_before_it_is_held_whole(
    proxy: Proxy, upstream: Upstream, names
):
    agent, token = _granted(proxy, names, {"query": "*"})
    padding = " " * (1024 * 1024)
    payload = json.dumps({"query": "{ viewer }" + padding}).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused as it grows past the bound
        for start in range(0, len(payload), 65536):
            yield payload[start : start + 65536]

    with proxy.client(agent, token) as client:
        declared = client.post(
            "https://api.test/graphql",
            content=payload,
            headers={"content-type": "application/json"},
        )
    with proxy.client(agent, token) as client:
        try:
            streamed = client.post(
                "https://api.test/graphql",
                content=chunks(),
                headers={"content-type": "application/json"},
            )
            status, reason = streamed.status_code, streamed.headers.get("x-credproxy-reason")
        except httpx.HTTPError:  # the proxy may close while the client still sends
            status, reason = 413, "body-too-large"
    assert declared.status_code == 413
    assert declared.headers["x-credproxy-reason"] == "body-too-large"
    assert (status, reason) == (413, "body-too-large")
    assert upstream.log.requests == []
    assert [line["reason"] for line in proxy.requests(agent)] == ["body-too-large"] * 2


def test_a_refused_body_spends_no_use_of_a_once_grant(proxy: Proxy, upstream: Upstream, names):
    agent, token = _granted(proxy, names, READ_AND_COMMENT, limits=validation.limits(None, None, 1))
    with proxy.client(agent, token) as client:
        refused = _post(client, {"query": 'mutation { deleteRepository(name: "x") }'})
        used = _post(client, {"query": "{ viewer }"})
        spent = _post(client, {"query": "{ viewer }"})
    assert [refused.status_code, used.status_code, spent.status_code] == [403, 200, 403]
    assert spent.headers["x-credproxy-reason"] == "grant-consumed"
    assert len(upstream.log.requests) == 1


def test_variables_never_reach_the_audit(proxy: Proxy, upstream: Upstream, names):
    agent, token = _granted(proxy, names, READ_AND_COMMENT)
    marker = "variable-value-never-logged"
    with proxy.client(agent, token) as client:
        ok = _post(
            client,
            {
                "query": "mutation M($b: String) { addComment(body: $b) }",
                "variables": {"b": marker},
            },
        )
        refused = _post(
            client,
            {
                "query": "mutation M($b: String) { deleteRepository(name: $b) }",
                "variables": {"b": marker},
            },
        )
    assert (ok.status_code, refused.status_code) == (200, 403)
    assert marker not in proxy.output()
    assert marker not in refused.text


def test_a_grant_without_a_body_rule_still_allows_what_the_body_rule_refuses(
    proxy: Proxy, upstream: Upstream, names
):
    """Two grants on one path: the body-ruled one is tried first; the other allows any body."""
    agent, token = _granted(proxy, names, {"query": "*"})
    [cred] = {g.credential for g in proxy.store.list_grants(agent)}
    proxy.store.add_grant(
        agent,
        ["POST"],
        credential=cred,
        paths=["/graphql"],
        limits=validation.limits(None, None, 1),
    )
    proxy.wait_reload()
    with proxy.client(agent, token) as client:
        read = _post(client, {"query": "{ viewer }"})
        wrote = _post(client, {"query": 'mutation { deleteRepository(name: "x") }'})
        proxy.wait_reload()  # the use is spent: the grant is gone from the proxy's policy
        again = _post(client, {"query": 'mutation { deleteRepository(name: "x") }'})
    assert [read.status_code, wrote.status_code, again.status_code] == [200, 200, 403]
    assert again.headers["x-credproxy-reason"] == "operation-not-allowed"


# -- held for approval: the owner sees what the body asks ------------------------------------


def _pending_events(proxy: Proxy, agent: str, count: int) -> list[dict]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        found = [
            line
            for line in proxy.audit()
            if line.get("event") == "approval.pending" and line.get("principal") == agent
        ]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError("no approval.pending event")


def test_a_held_body_ruled_request_names_its_operation_and_a_first_approval_covers_only_it(
    proxy: Proxy, upstream: Upstream, names
):
    limits = validation.limits(None, None, approval="first", hold="30s")
    agent, token = _granted(
        proxy, names, {"mutation": ["addComment", "createIssue"]}, limits=limits
    )
    comment = {"query": 'mutation { addComment(body: "hi") }'}
    create = {"query": "mutation { createIssue }"}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(lambda: _post(proxy.client(agent, token, timeout=60), comment))
        [event] = _pending_events(proxy, agent, 1)
        assert event["operation"] == "mutation addComment"
        assert upstream.log.requests == []  # held: nothing sent yet
        proxy.store.approve_access_request(event["id"])
        assert first.result(timeout=20).status_code == 200
        proxy.wait_reload()
        # The same operation again: covered by the approval, not held.
        with proxy.client(agent, token) as client:
            assert _post(client, comment).status_code == 200
        # Another operation of the grant is another kind: held again, with its own name.
        second = pool.submit(lambda: _post(proxy.client(agent, token, timeout=60), create))
        events = _pending_events(proxy, agent, 2)
        assert events[-1]["operation"] == "mutation createIssue"
        proxy.store.deny_access_request(events[-1]["id"])
        assert second.result(timeout=20).status_code == 403


def test_json_rpc_methods_outside_the_list_never_reach_the_upstream(
    proxy: Proxy, upstream: Upstream, names
):
    agent, cred = names("rpc"), names("rpccred")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET))
    proxy.store.add_grant(
        agent,
        ["POST"],
        credential=cred,
        paths=["/rpc"],
        body=bodyrules.parse("jsonrpc", {"methods": ["eth_call", "eth_getBalance"]}),
    )
    proxy.wait_reload()
    call = {"jsonrpc": "2.0", "id": 1, "method": "eth_call", "params": []}
    send = {"jsonrpc": "2.0", "id": 2, "method": "eth_sendTransaction", "params": []}
    with proxy.client(agent, token) as client:
        allowed = client.post("https://api.test/rpc", json=call)
        refused = client.post("https://api.test/rpc", json=send)
        batched = client.post("https://api.test/rpc", json=[call, send])
    assert allowed.status_code == 200
    assert [refused.status_code, batched.status_code] == [403, 403]
    assert {refused.headers["x-credproxy-reason"], batched.headers["x-credproxy-reason"]} == {
        "rpc-method-not-allowed"
    }
    assert [r.target for r in upstream.log.requests] == ["/rpc"]
    assert [line["body"] for line in proxy.requests(agent)][0] == {"jsonrpc": ["eth_call"]}
