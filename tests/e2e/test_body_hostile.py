"""A hostile review of grants decided on the body (graphql, mcp, jsonrpc), end to end.

The agent is the attacker. Every test runs the real proxy against real upstreams
(tests/e2e/body_hostile_servers.py): a GraphQL server that executes documents with
graphql-core, a JSON-RPC 2.0 server, and FastMCP servers from the official SDK. Each test
asserts a promise; a test marked xfail(strict=True) is a break the review found.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from starlette.middleware.gzip import GZipMiddleware

from store.crypto import Secret
from store.rules import bodyrules, validation
from tests.e2e import raw
from tests.e2e.body_hostile_servers import (
    EXECUTED,
    graphql_app,
    h2_request,
    mcp_server,
    raw_exchange,
)
from tests.e2e.conftest import NAMES, Proxy, start_proxy, stop_proxy
from tests.e2e.test_mcp import _Running
from tests.e2e.upstream import Upstream

# Out of the default run (about two minutes): its two breaks have fast regression tests in
# tests/core/test_bodies.py; `pytest -m slow` runs the whole review.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Use `streamable_http_client`:DeprecationWarning"),
]

SECRET = b"ghp-hostile-body-secret-A"
OTHER_SECRET = b"ghp-hostile-body-secret-B"
MARKER = "argument-value-never-logged-7f3a"
MCP_SSE, MCP_JSON = "mcp.test", "mcpjson.test"
MCP_ACCEPT = {"accept": "application/json, text/event-stream"}
DELETE = 'mutation { deleteRepository(name: "x") }'


@pytest.fixture(scope="module")
def shared_upstream(upstream_ca: trustme.CA) -> Iterator[Upstream]:
    with Upstream(upstream_ca, NAMES, app=graphql_app) as server:
        yield server


@pytest.fixture(scope="module")
def proxy(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    """One proxy: api.test (GraphQL at /graphql, JSON-RPC at /rpc) and two MCP servers, one
    answering SSE and one JSON behind gzip (as a compressing front would)."""
    tmp = tmp_path_factory.mktemp("hostile")
    sse_app = mcp_server(json_response=False).streamable_http_app()
    json_app = GZipMiddleware(mcp_server(json_response=True).streamable_http_app(), 1)
    with (
        _Running(sse_app, upstream_ca, MCP_SSE, tmp) as sse,
        _Running(json_app, upstream_ca, MCP_JSON, tmp) as js,
    ):
        resolve = [f"{n}=127.0.0.1:{shared_upstream.port}" for n in NAMES if n != "localhost"]
        resolve += [f"{MCP_SSE}=127.0.0.1:{sse.port}", f"{MCP_JSON}=127.0.0.1:{js.port}"]
        running = start_proxy(tmp / "home", upstream_ca, resolve, template=initialised_home)
        yield running
        stop_proxy(running)


@pytest.fixture
def executed(upstream: Upstream):
    EXECUTED.clear()
    return EXECUTED


def _grant(
    proxy: Proxy,
    names,
    kind: str,
    spec: dict,
    *,
    host: str = "api.test",
    paths=("/graphql",),
    methods=("POST",),
    limits=None,
    secret: bytes = SECRET,
) -> tuple[str, str]:
    agent, cred = names("agent"), names("cred")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", [host], Secret(secret))
    proxy.store.add_grant(
        agent,
        list(methods),
        credential=cred,
        paths=list(paths),
        limits=limits or validation.NO_LIMITS,
        body=bodyrules.parse(kind, spec),
    )
    proxy.wait_reload()
    return agent, token


def _gql(proxy: Proxy, names, spec: dict, **kw) -> tuple[str, str]:
    return _grant(proxy, names, "graphql", spec, **kw)


def _post(client: httpx.Client, payload: Any, path: str = "/graphql", **kw) -> httpx.Response:
    return client.post(f"https://api.test{path}", json=payload, **kw)


def _raw_post(target: str, body: bytes, *fields: str, host: str = "api.test") -> bytes:
    head = [f"POST {target} HTTP/1.1", f"Host: {host}", *fields]
    if not any(f.lower().startswith(("content-length:", "transfer-encoding:")) for f in fields):
        head.append(f"Content-Length: {len(body)}")
    head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


READ_AND_COMMENT = {"query": "*", "mutation": ["addComment"]}


# -- Promise 1 and 4: GraphQL ---------------------------------------------------------------

NESTED_INTROSPECTION = {
    "__schema": 'mutation { addComment(body: "x") { query { __schema { types { name } } } } }',
    "__type": 'mutation { addComment(body: "x") { query { __type(name: "Mutation") '
    "{ fields { name } } } } }",
}


# Found by this review: introspection reached the upstream below a top-level field that returns
# the Query type (Relay's payload { query: Query }). __schema/__type are refused at any depth.
@pytest.mark.parametrize("document", NESTED_INTROSPECTION.values(), ids=NESTED_INTROSPECTION)
def test_introspection_is_refused_when_not_granted_even_below_a_granted_field(
    proxy: Proxy, upstream: Upstream, executed, names, document
):
    agent, token = _gql(proxy, names, {"mutation": ["addComment"]})
    with proxy.client(agent, token) as client:
        top = _post(client, {"query": "{ __schema { types { name } } }"})
        nested = _post(client, {"query": document})
    assert top.status_code == 403  # the top-level form is refused
    assert nested.status_code == 403, nested.text  # the promise: introspection only if granted
    assert "Mutation" not in nested.text


@pytest.mark.xfail(
    strict=True,
    reason="LIMITATION, documented in docs/grants.md: field lists bound top-level fields only; a "
    "granted mutation whose payload returns the Query type reads query fields below it",
)
def test_a_query_field_outside_the_list_is_not_read_through_a_mutation_payload(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, {"query": ["viewer"], "mutation": ["addComment"]})
    with proxy.client(agent, token) as client:
        direct = _post(client, {"query": "{ secretNotes }"})
        nested = _post(
            client, {"query": 'mutation { addComment(body: "x") { query { secretNotes } } }'}
        )
    assert direct.status_code == 403
    assert "notes" not in nested.text, nested.text


def test_unicode_escaped_json_keys_are_read_as_the_server_reads_them(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    escaped = b'{"qu\\u0065ry": "mutation { deleteRepository(name: \\"x\\") }"}'
    twice = b'{"query": "{ viewer }", "qu\\u0065ry": "mutation { deleteRepository }"}'
    cased = b'{"query": "{ viewer }", "Query": "mutation { deleteRepository }"}'
    named = (
        b'{"query": "query Fine { viewer } mutation Bad { deleteRepository }",'
        b' "operationN\\u0061me": "Fine"}'
    )
    headers = {"content-type": "application/json"}
    with proxy.client(agent, token) as client:
        answers = [
            client.post("https://api.test/graphql", content=body, headers=headers)
            for body in (escaped, twice, cased, named)
        ]
    assert [(a.status_code, a.headers.get("x-credproxy-reason")) for a in answers] == [
        (403, "operation-not-allowed"),
        (400, "body-undecidable"),
        (400, "body-undecidable"),
        (403, "operation-not-allowed"),
    ]
    assert upstream.log.requests == [] and "deleteRepository" not in executed


HIDDEN = {
    "alias of a granted name": 'mutation { addComment: deleteRepository(name: "x") }',
    "nested inline fragments": "mutation { ... { ... on Mutation { ... @include(if: true) "
    '{ deleteRepository(name: "x") } } } }',
    "fragment chain": "mutation { ...A } fragment A on Mutation { ...B } fragment B on Mutation "
    '{ addComment(body: "ok") { body } deleteRepository(name: "x") }',
    "fragment defined before the operation": "fragment F on Mutation "
    '{ deleteRepository(name: "x") } mutation { ...F }',
    "granted first, ungranted second": 'mutation { addComment(body: "a") { body } '
    'deleteRepository(name: "x") }',
    "anonymous query beside a named mutation": "{ viewer } "
    'mutation M { deleteRepository(name: "x") }',
    "subscription type": "subscription { viewer }",
    "block string comment trick": '"""\n""" mutation { deleteRepository(name: "x") }',
    "comment hides nothing": '# { viewer }\nmutation { deleteRepository(name: "x") }',
    "unicode BOM inside the document": '\ufeffmutation { deleteRepository(name: "x") }',
}


@pytest.mark.parametrize("document", HIDDEN.values(), ids=HIDDEN)
def test_a_mutation_outside_the_grant_never_executes_whatever_its_disguise(
    proxy: Proxy, upstream: Upstream, executed, names, document
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    with proxy.client(agent, token) as client:
        refused = _post(client, {"query": document})
    assert refused.status_code in (400, 403), refused.text
    assert "deleteRepository" not in executed
    assert upstream.log.requests == []


def test_an_operation_name_selecting_the_harmless_operation_does_not_pass_a_bad_one(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    doc = 'query Fine { viewer } mutation Bad { deleteRepository(name: "x") }'
    with proxy.client(agent, token) as client:
        cases = [
            {"query": doc, "operationName": "Fine"},
            {"query": doc, "operationName": ""},
            {"query": doc, "operationName": None},
            {"query": doc, "operationName": "Missing"},
            {"query": "query Fine { viewer }", "operationName": "fine"},
        ]
        answers = [_post(client, c) for c in cases]
    assert [a.status_code for a in answers] == [403, 400, 400, 400, 400]
    assert upstream.log.requests == []


TYPED_WRONG = {
    "query is a list": {"query": ["mutation { deleteRepository }"]},
    "query is an object": {"query": {"query": "mutation { deleteRepository }"}},
    "operationName a number": {"query": "{ viewer }", "operationName": 1},
    "extensions a list": {"query": "{ viewer }", "extensions": []},
    "unknown member documentId": {"documentId": "abc"},
    "unknown member id": {"query": "{ viewer }", "id": "deleteRepo"},
    "nested batch": [[{"query": DELETE}]],
    "empty batch": [],
    "a string": "mutation { deleteRepository }",
    "batch of 101": [{"query": "{ viewer }"}] * 101,
}


@pytest.mark.parametrize("payload", TYPED_WRONG.values(), ids=TYPED_WRONG)
def test_a_json_body_of_the_wrong_shape_is_undecidable(
    proxy: Proxy, upstream: Upstream, executed, names, payload
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    with proxy.client(agent, token) as client:
        refused = _post(client, payload)
    assert refused.status_code == 400
    assert refused.headers["x-credproxy-reason"] == "body-undecidable"
    assert upstream.log.requests == []


def test_a_batch_is_decided_element_by_element_and_a_clean_batch_passes(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    clean = [{"query": "{ viewer }"}] * 50 + [
        {"query": 'mutation { addComment(body: "a") { body } }'}
    ]
    dirty = [{"query": "{ viewer }"}] * 60 + [{"query": DELETE}] + [{"query": "{ issues }"}] * 30
    with proxy.client(agent, token) as client:
        ok = _post(client, clean)
        refused = _post(client, dirty)
    assert ok.status_code == 200 and len(ok.json()) == 51
    assert refused.status_code == 403
    assert executed.snapshot() == ["addComment"]


PERSISTED = "ab" * 32


def test_persisted_queries_pass_only_when_listed_and_a_document_must_match_its_hash(
    proxy: Proxy, upstream: Upstream, executed, names
):
    import hashlib

    agent, token = _gql(proxy, names, {"query": "*", "persisted": [PERSISTED]})
    doc = "{ viewer }"
    good_hash = hashlib.sha256(doc.encode()).hexdigest()
    ext = lambda h: {"persistedQuery": {"version": 1, "sha256Hash": h}}  # noqa: E731
    with proxy.client(agent, token) as client:
        listed = _post(client, {"extensions": ext(PERSISTED)})
        unlisted = _post(client, {"extensions": ext("cd" * 32)})
        upper = _post(client, {"extensions": ext(PERSISTED.upper())})
        mismatched = _post(client, {"query": DELETE, "extensions": ext(PERSISTED)})
        matching = _post(client, {"query": doc, "extensions": ext(good_hash)})
        get_unlisted = client.get(
            "https://api.test/graphql", params={"extensions": json.dumps(ext("cd" * 32))}
        )
    assert listed.status_code == 200
    assert [unlisted.status_code, upper.status_code] == [403, 403]
    assert mismatched.status_code == 400
    assert matching.status_code == 200
    assert get_unlisted.status_code == 403  # GET is not granted here: refused either way
    assert "deleteRepository" not in executed


# -- GraphQL: GET, the query string, content types, encodings -------------------------------

QUERY_STRING_ON_POST = {
    "query": "/graphql?query=" + "mutation%7BdeleteRepository%7D",
    "upper-case": "/graphql?QUERY=mutation%7BdeleteRepository%7D",
    "percent-encoded name": "/graphql?qu%65ry=mutation%7BdeleteRepository%7D",
    "after a semicolon": "/graphql?x=1;query=mutation%7BdeleteRepository%7D",
    "plus in the name": "/graphql?query+=mutation%7BdeleteRepository%7D",
    "operationName": "/graphql?operationName=Bad",
    "variables": "/graphql?variables=%7B%7D",
    "extensions": "/graphql?extensions=%7B%7D",
}


@pytest.mark.parametrize("target", QUERY_STRING_ON_POST.values(), ids=QUERY_STRING_ON_POST)
def test_graphql_parameters_in_a_posts_query_string_are_undecidable(
    proxy: Proxy, upstream: Upstream, executed, names, target
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    with proxy.client(agent, token) as client:
        refused = _post(
            client,
            {
                "query": 'query Fine { viewer } mutation Bad { addComment(body: "x") { body } }',
                "operationName": "Fine",
            },
            path=target,
        )
    assert refused.status_code == 400, refused.text
    assert refused.headers["x-credproxy-reason"] == "body-undecidable"
    assert upstream.log.requests == [] and executed.snapshot() == []


GET_REFUSED = {
    "mutation": ("/graphql?query=mutation%7BdeleteRepository%7D", 403),
    "mutation with plus for spaces": ("/graphql?query=mutation+%7B+deleteRepository+%7D", 403),
    "two query parameters": (
        "/graphql?query=%7Bviewer%7D&query=mutation%7BdeleteRepository%7D",
        400,
    ),
    "query twice, once encoded": (
        "/graphql?query=%7Bviewer%7D&qu%65ry=mutation%7BdeleteRepository%7D",
        400,
    ),
    "a semicolon": ("/graphql?query=%7Bviewer%7D;query=mutation%7BdeleteRepository%7D", 400),
    "an unknown parameter": (
        "/graphql?query=%7Bviewer%7D&Query=mutation%7BdeleteRepository%7D",
        400,
    ),
    "a malformed escape": ("/graphql?query=%7Bviewer%7D&x=%zz", 400),
    "no document": ("/graphql", 400),
    "operationName picks the query of two": (
        "/graphql?query=query+A%7Bviewer%7D+mutation+B%7BdeleteRepository%7D&operationName=A",
        403,
    ),
}


@pytest.mark.parametrize("case", GET_REFUSED.values(), ids=GET_REFUSED)
def test_a_graphql_get_is_decided_on_its_query_string(
    proxy: Proxy, upstream: Upstream, executed, names, case
):
    target, status = case
    agent, token = _gql(proxy, names, {"query": "*"}, methods=("GET", "POST"))
    reply = raw_exchange(
        proxy,
        (agent, token),
        "api.test",
        f"GET {target} HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n".encode(),
    )
    assert reply.status == status, reply.body
    assert upstream.log.requests == [] and "deleteRepository" not in executed


def test_a_graphql_get_with_a_body_or_as_head_is_refused(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, {"query": "*"}, methods=("GET", "POST"))
    body = json.dumps({"query": DELETE}).encode()
    with_body = raw_exchange(
        proxy,
        (agent, token),
        "api.test",
        b"GET /graphql?query=%7Bviewer%7D HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body,
    )
    with proxy.client(agent, token) as client:
        ok = client.get("https://api.test/graphql", params={"query": "{ viewer }"})
        head = client.head("https://api.test/graphql", params={"query": "{ viewer }"})
    assert with_body.status == 400
    assert ok.status_code == 200 and ok.json()["data"] == {"viewer": "octocat"}
    assert head.status_code == 400  # HEAD is not decided as a GraphQL GET: refused
    assert "deleteRepository" not in executed


CONTENT_TRICKS = {
    "two Content-Type fields": (
        ["Content-Type: application/graphql", "Content-Type: application/json"],
        json.dumps({"query": "{ viewer }"}).encode(),
        400,
    ),
    "charset=utf-16 on ASCII JSON": (
        ["Content-Type: application/json; charset=utf-16"],
        json.dumps({"query": "{ viewer }"}).encode(),
        400,
    ),
    "UTF-16 with a BOM": (
        ["Content-Type: application/json"],
        json.dumps({"query": DELETE}).encode("utf-16"),
        400,
    ),
    "UTF-8 BOM": (
        ["Content-Type: application/json"],
        b"\xef\xbb\xbf" + b'{"query":"{viewer}"}',
        400,
    ),
    "charset twice": (
        ["Content-Type: application/json; charset=utf-8; charset=latin-1"],
        b'{"query":"{viewer}"}',
        400,
    ),
    "a list of types": (["Content-Type: application/json, application/graphql"], b"{viewer}", 400),
    "form encoded": (
        ["Content-Type: application/x-www-form-urlencoded"],
        b"query=mutation%7BdeleteRepository%7D",
        400,
    ),
    "multipart": (
        ["Content-Type: multipart/form-data; boundary=b"],
        b'--b\r\nContent-Disposition: form-data; name="operations"\r\n\r\n'
        b'{"query":"mutation{deleteRepository}"}\r\n--b--\r\n',
        400,
    ),
    "no Content-Type": ([], json.dumps({"query": DELETE}).encode(), 400),
    "text/plain": (["Content-Type: text/plain"], json.dumps({"query": DELETE}).encode(), 400),
    "gzip": (["Content-Encoding: gzip", "Content-Type: application/json"], b"\x1f\x8b", 400),
    "identity, gzip": (
        ["Content-Encoding: identity, gzip", "Content-Type: application/json"],
        b"\x1f\x8b",
        400,
    ),
    "identity then gzip fields": (
        ["Content-Encoding: identity", "Content-Encoding: gzip", "Content-Type: application/json"],
        b"\x1f\x8b",
        400,
    ),
    "application/graphql with odd parameters": (
        ['Content-Type: application/graphql; charset="UTF-8"; version=1'],
        DELETE.encode(),
        403,
    ),
    "application/graphql upper-case": (["Content-Type: APPLICATION/GRAPHQL"], DELETE.encode(), 403),
    "application/json+graphql suffix": (
        ["Content-Type: application/graphql+json"],
        json.dumps({"query": DELETE}).encode(),
        400,
    ),
    "invalid UTF-8": (["Content-Type: application/json"], b'{"query":"{viewer}\xff"}', 400),
    "NaN": (["Content-Type: application/json"], b'{"query":"{viewer}","variables":{"a":NaN}}', 400),
    "huge number": (
        ["Content-Type: application/json"],
        b'{"query":"{viewer}","variables":{"a":1e999}}',
        400,
    ),
}


@pytest.mark.parametrize("case", CONTENT_TRICKS.values(), ids=CONTENT_TRICKS)
def test_content_type_and_encoding_tricks_are_refused(
    proxy: Proxy, upstream: Upstream, executed, names, case
):
    fields, body, status = case
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    reply = raw_exchange(proxy, (agent, token), "api.test", _raw_post("/graphql", body, *fields))
    assert reply.status == status, reply.body
    assert upstream.log.requests == [] and "deleteRepository" not in executed


def test_application_graphql_with_parameters_passes_a_query(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    reply = raw_exchange(
        proxy,
        (agent, token),
        "api.test",
        _raw_post("/graphql", b"{ viewer }", 'Content-Type: application/graphql; charset="utf-8"'),
    )
    assert reply.status == 200 and json.loads(reply.body)["data"] == {"viewer": "octocat"}


def test_a_method_override_does_not_change_what_was_decided(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)  # POST only
    with proxy.client(agent, token) as client:
        answers = [
            _post(client, {"query": "{ viewer }"}, headers={name: "GET"})
            for name in ("X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override")
        ]
    assert [a.status_code for a in answers] == [403] * 3
    assert {a.headers["x-credproxy-reason"] for a in answers} == {"method-not-allowed"}
    assert upstream.log.requests == []


# -- HTTP framing: chunked, trailers, Expect, HTTP/2 ----------------------------------------


def _chunked(body: bytes, size: int = 7, trailer: str = "") -> bytes:
    out = b""
    for i in range(0, len(body), size):
        part = body[i : i + size]
        out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    return out + b"0\r\n" + trailer.encode() + b"\r\n"


def test_a_chunked_body_is_decided_whole(proxy: Proxy, upstream: Upstream, executed, names):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    fields = ["Content-Type: application/json", "Transfer-Encoding: chunked"]
    bad = _chunked(json.dumps({"query": DELETE}).encode())
    good = _chunked(json.dumps({"query": "{ viewer }"}).encode())
    refused = raw_exchange(proxy, (agent, token), "api.test", _raw_post("/graphql", bad, *fields))
    allowed = raw_exchange(proxy, (agent, token), "api.test", _raw_post("/graphql", good, *fields))
    assert refused.status == 403
    assert allowed.status == 200, allowed.body
    assert [r.body for r in upstream.log.requests] == [json.dumps({"query": "{ viewer }"}).encode()]
    assert "deleteRepository" not in executed


def test_request_trailers_are_refused(proxy: Proxy, upstream: Upstream, executed, names):
    """A trailer could name a Content-Type the decision never saw: refused whole."""
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    fields = [
        "Content-Type: application/json",
        "Transfer-Encoding: chunked",
        "Trailer: Content-Type",
    ]
    good = _chunked(
        json.dumps({"query": "{ viewer }"}).encode(),
        trailer="Content-Type: application/graphql\r\n",
    )
    reply = raw_exchange(proxy, (agent, token), "api.test", _raw_post("/graphql", good, *fields))
    assert reply.status == 400
    assert upstream.log.requests == []


def test_expect_100_continue_is_decided_before_the_upstream_sees_it(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    auth = raw.proxy_auth(agent, token)
    results = []
    for payload in ({"query": DELETE}, {"query": "{ viewer }"}):
        body = json.dumps(payload).encode()
        head = _raw_post(
            "/graphql",
            b"",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Expect: 100-continue",
        )
        with raw.tunnel(proxy.port, "api.test:443", auth, "api.test", proxy.ca_file) as tls:
            tls.settimeout(10)
            tls.sendall(head)
            first = tls.recv(65536)
            if first.startswith(b"HTTP/1.1 100"):
                tls.sendall(body)
                results.append(raw.read_reply(tls).status)
            else:
                # Answered before the body was read: fine for a refusal only.
                results.append(int(first.split()[1]))
    assert results == [403, 200]
    assert "deleteRepository" not in executed and len(upstream.log.requests) == 1


def test_over_http2_a_mutation_is_refused_and_a_query_passes(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    fields = [
        (":method", "POST"),
        (":scheme", "https"),
        (":authority", "api.test"),
        (":path", "/graphql"),
        ("content-type", "application/json"),
    ]
    refused = h2_request(
        proxy, (agent, token), "api.test", fields, json.dumps({"query": DELETE}).encode(), chunk=5
    )
    twice = h2_request(
        proxy,
        (agent, token),
        "api.test",
        fields + [("content-type", "application/graphql")],
        json.dumps({"query": "{ viewer }"}).encode(),
    )
    allowed = h2_request(
        proxy,
        (agent, token),
        "api.test",
        fields,
        json.dumps({"query": "{ viewer }"}).encode(),
        chunk=3,
    )
    assert refused.status == 403
    assert twice.status == 400
    assert allowed.status == 200 and json.loads(allowed.body)["data"] == {"viewer": "octocat"}
    assert "deleteRepository" not in executed and len(upstream.log.requests) == 1


def test_over_http2_a_body_without_length_past_1_mib_is_refused(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    fields = [
        (":method", "POST"),
        (":scheme", "https"),
        (":authority", "api.test"),
        (":path", "/graphql"),
        ("content-type", "application/json"),
    ]
    body = json.dumps({"query": "{ viewer }" + " " * (1024 * 1024)}).encode()
    answer = h2_request(proxy, (agent, token), "api.test", fields, body)
    assert answer.status == 413 or answer.broken
    assert upstream.log.requests == []


def test_the_size_bound_is_exactly_one_mib(proxy: Proxy, upstream: Upstream, executed, names):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    base = json.dumps({"query": "{ viewer }"}).encode()
    at = base[:-2] + b" " * (1024 * 1024 - len(base)) + base[-2:]
    over = base[:-2] + b" " * (1024 * 1024 - len(base) + 1) + base[-2:]
    headers = {"content-type": "application/json"}
    with proxy.client(agent, token, timeout=30) as client:
        ok = client.post("https://api.test/graphql", content=at, headers=headers)
    with proxy.client(agent, token, timeout=30) as client:
        big = client.post("https://api.test/graphql", content=over, headers=headers)
    assert len(at) == 1024 * 1024 and ok.status_code == 200
    assert big.status_code == 413 and big.headers["x-credproxy-reason"] == "body-too-large"
    assert len(upstream.log.requests) == 1


# -- Promise 2: nothing spent on a refused body ---------------------------------------------


def test_no_use_is_spent_on_a_body_that_is_refused_undecidable_or_too_large(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT, limits=validation.limits(None, None, 1))
    headers = {"content-type": "application/json"}
    with proxy.client(agent, token) as client:
        answers = [
            _post(client, {"query": DELETE}).status_code,
            client.post(
                "https://api.test/graphql", content=b'{"query":"{"}', headers=headers
            ).status_code,
            client.post(
                "https://api.test/graphql", content=b" " * (1024 * 1024 + 1), headers=headers
            ).status_code,
            _post(client, {"query": "{ viewer }"}, path="/graphql?query=x").status_code,
        ]
    with proxy.client(agent, token) as client:
        used = _post(client, {"query": "{ viewer }"})
        spent = _post(client, {"query": "{ viewer }"})
    assert answers == [403, 400, 413, 400]
    assert (used.status_code, spent.status_code) == (200, 403)
    assert spent.headers["x-credproxy-reason"] == "grant-consumed"
    assert len(upstream.log.requests) == 1


# -- Promise 7: several grants --------------------------------------------------------------


def test_the_chosen_grants_credential_is_the_one_stamped(
    proxy: Proxy, upstream: Upstream, executed, names
):
    """A body-ruled grant (credential A, /graphql) before a plain one (credential B, /): the
    body the rule allows goes with A, the rest with B."""
    agent, token = _gql(proxy, names, {"query": "*"})
    cred_b = names("credb")
    proxy.store.add_credential(cred_b, "bearer", ["api.test"], Secret(OTHER_SECRET))
    proxy.store.add_grant(agent, ["POST"], credential=cred_b, paths=["/"])
    proxy.wait_reload()
    with proxy.client(agent, token) as client:
        read = _post(client, {"query": "{ viewer }"})
        wrote = _post(client, {"query": 'mutation { addComment(body: "x") { body } }'})
    assert (read.status_code, wrote.status_code) == (200, 200)
    assert [r.header("authorization") for r in upstream.log.requests] == [
        [f"Bearer {SECRET.decode()}"],
        [f"Bearer {OTHER_SECRET.decode()}"],
    ]


def test_between_two_body_rules_the_one_that_allows_stamps(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, {"query": "*"})
    cred_b = names("credb")
    proxy.store.add_credential(cred_b, "bearer", ["api.test"], Secret(OTHER_SECRET))
    proxy.store.add_grant(
        agent,
        ["POST"],
        credential=cred_b,
        paths=["/graphql"],
        body=bodyrules.parse("graphql", {"mutation": ["addComment"]}),
    )
    proxy.wait_reload()
    with proxy.client(agent, token) as client:
        read = _post(client, {"query": "{ viewer }"})
        wrote = _post(client, {"query": 'mutation { addComment(body: "x") { body } }'})
        mixed = _post(
            client,
            {
                "query": '{ viewer } mutation M { addComment(body: "x") { body } }',
                "operationName": "M",
            },
        )
        bad = _post(client, {"query": DELETE})
    assert [a.status_code for a in (read, wrote, mixed, bad)] == [200, 200, 403, 403]
    assert [r.header("authorization") for r in upstream.log.requests] == [
        [f"Bearer {SECRET.decode()}"],
        [f"Bearer {OTHER_SECRET.decode()}"],
    ]
    assert executed.snapshot() == ["addComment"]


# -- Promise 6: names in the audit, never values --------------------------------------------


def test_arguments_variables_and_the_secret_never_reach_the_audit_or_the_agent(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT, methods=("GET", "POST"))
    with proxy.client(agent, token) as client:
        answers = [
            _post(client, {"query": f'mutation {{ addComment(body: "{MARKER}") {{ body }} }}'}),
            _post(client, {"query": f'mutation {{ deleteRepository(name: "{MARKER}") }}'}),
            _post(
                client,
                {
                    "query": "mutation($v: String) { deleteRepository(name: $v) }",
                    "variables": {"v": MARKER},
                },
            ),
            _post(
                client,
                {"query": "{ viewer }", "variables": {MARKER: MARKER}, "extensions": {MARKER: 1}},
            ),
            client.get(
                "https://api.test/graphql",
                params={"query": "{ viewer }", "variables": json.dumps({"v": MARKER})},
            ),
            _post(client, {"query": "{ viewer }", "variables": {"v": MARKER}, "bad": MARKER}),
            _post(client, {"query": "{ viewer", "variables": {"v": MARKER}}),
        ]
    refusals = [a.text for a in answers if a.status_code >= 400]
    assert len(refusals) == 4
    assert not any(MARKER in text for text in refusals)
    out = proxy.output()
    assert MARKER not in out
    assert SECRET.decode() not in out
    assert not any(SECRET.decode() in a.text for a in answers)


# -- Availability: the decision itself ------------------------------------------------------


def test_many_aliases_and_deep_nesting_are_decided_and_the_proxy_stays_up(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _gql(proxy, names, READ_AND_COMMENT)
    aliases = "{ " + " ".join(f"a{i}: viewer" for i in range(15000)) + " }"
    too_many = "{ " + " ".join(["viewer"] * 60000) + " }"
    deep = "{ " + "viewer { " * 4000 + "x" + " }" * 4000 + " }"
    deep_json = b'{"query": "{ viewer }", "variables": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    with proxy.client(agent, token, timeout=60) as client:
        many = _post(client, {"query": aliases})
        tokens = _post(client, {"query": too_many})
        nested = _post(client, {"query": deep})
        nested_json = client.post(
            "https://api.test/graphql",
            content=deep_json,
            headers={"content-type": "application/json"},
        )
        after = _post(client, {"query": "{ viewer }"})
    assert many.status_code == 200
    assert (tokens.status_code, nested.status_code, nested_json.status_code) == (400, 400, 400)
    assert after.status_code == 200


# Found by this review: one ~260 KB GraphQL body (4000 operations each spreading a 25000-field
# fragment) blocked the event loop for seconds. Now: at most 32 operations, each fragment's
# fields found once, and a large body decided in a thread.
def test_one_agents_body_does_not_stall_another_agents_request(
    proxy: Proxy, upstream: Upstream, executed, names
):
    attacker = _gql(proxy, names, READ_AND_COMMENT)
    victim_agent, victim_cred = names("victim"), names("victimcred")
    victim_token = proxy.store.add_principal(victim_agent)
    proxy.store.add_credential(victim_cred, "bearer", ["other.test"], Secret(b"victim-secret"))
    proxy.store.add_grant(victim_agent, ["GET"], credential=victim_cred, paths=["/"])
    proxy.wait_reload()
    fragment = "fragment F on Query { " + " ".join(["viewer"] * 25000) + " }"
    operations = " ".join(f"query Q{i} {{ ...F }}" for i in range(4000))
    document = operations + " mutation Z { deleteRepository } " + fragment
    body = json.dumps({"query": document, "operationName": "Q0"}).encode()
    assert len(body) < 1024 * 1024
    hostile: dict[str, Any] = {}

    def attack() -> None:
        with proxy.client(*attacker, timeout=120) as client:
            started = time.monotonic()
            hostile["status"] = client.post(
                "https://api.test/graphql",
                content=body,
                headers={"content-type": "application/json"},
            ).status_code
            hostile["took"] = time.monotonic() - started

    thread = threading.Thread(target=attack)
    with proxy.client(victim_agent, victim_token, timeout=120) as client:
        assert client.get("https://other.test/warm").status_code == 200
        thread.start()
        time.sleep(1.0)  # the body is sent and being decided
        started = time.monotonic()
        victim = client.get("https://other.test/ping")
        waited = time.monotonic() - started
    thread.join(120)
    assert hostile.get("status") in (400, 403) and victim.status_code == 200
    assert waited < 2.0, f"the victim waited {waited:.1f} s (the attacker's took {hostile})"


# -- JSON-RPC -------------------------------------------------------------------------------

RPC = {"methods": ["eth_call", "eth_getBalance"]}
RPC_REFUSED = {
    "plain": (b'{"jsonrpc":"2.0","id":1,"method":"admin_addPeer","params":[]}', 403),
    "notification": (b'{"jsonrpc":"2.0","method":"admin_addPeer","params":["x"]}', 403),
    "escaped method value": (b'{"jsonrpc":"2.0","id":1,"method":"admin_\\u0061ddPeer"}', 403),
    "escaped method key": (b'{"jsonrpc":"2.0","id":1,"m\\u0065thod":"admin_addPeer"}', 403),
    "Method beside method": (
        b'{"jsonrpc":"2.0","id":1,"method":"eth_call","Method":"admin_addPeer"}',
        400,
    ),
    "method twice": (
        b'{"jsonrpc":"2.0","id":1,"method":"eth_call","method":"admin_addPeer"}',
        400,
    ),
    "hidden in a batch": (
        b'[{"jsonrpc":"2.0","id":1,"method":"eth_call"},'
        b'{"jsonrpc":"2.0","id":2,"method":"admin_addPeer"}]',
        403,
    ),
    "a response-shaped message": (b'{"jsonrpc":"2.0","id":1,"result":"admin_addPeer"}', 400),
    "id true": (b'{"jsonrpc":"2.0","id":true,"method":"eth_call"}', 400),
    "jsonrpc 1.0": (b'{"jsonrpc":"1.0","id":1,"method":"eth_call"}', 400),
    "method not a string": (b'{"jsonrpc":"2.0","id":1,"method":["admin_addPeer"]}', 400),
    "trailing whitespace in the name": (
        b'{"jsonrpc":"2.0","id":1,"method":"eth_call "}',
        403,
    ),
    "an unknown member": (b'{"jsonrpc":"2.0","id":1,"method":"eth_call","meth":"x"}', 400),
}


@pytest.mark.parametrize("case", RPC_REFUSED.values(), ids=RPC_REFUSED)
def test_jsonrpc_methods_outside_the_list_never_run(
    proxy: Proxy, upstream: Upstream, executed, names, case
):
    body, status = case
    agent, token = _grant(proxy, names, "jsonrpc", RPC, paths=("/rpc",))
    with proxy.client(agent, token) as client:
        refused = client.post(
            "https://api.test/rpc", content=body, headers={"content-type": "application/json"}
        )
    assert refused.status_code == status, refused.text
    assert upstream.log.requests == [] and "rpc:admin_addPeer" not in executed


def test_jsonrpc_granted_methods_pass_and_their_params_are_not_audited(
    proxy: Proxy, upstream: Upstream, executed, names
):
    agent, token = _grant(proxy, names, "jsonrpc", RPC, paths=("/rpc",))
    batch = [
        {"jsonrpc": "2.0", "id": 1, "method": "eth_call", "params": [{"data": MARKER}]},
        {"jsonrpc": "2.0", "id": "b", "method": "eth_getBalance", "params": {"a": MARKER}},
    ]
    with proxy.client(agent, token) as client:
        ok = client.post("https://api.test/rpc", json=batch)
        get = client.get("https://api.test/rpc")
    assert ok.status_code == 200 and [a["result"] for a in ok.json()] == ["0x", "0x10"]
    assert get.status_code == 403  # the grant names POST only
    assert executed.snapshot() == ["rpc:eth_call", "rpc:eth_getBalance"]
    lines = [line for line in proxy.requests(agent) if line.get("body")]
    assert lines[0]["body"] == {"jsonrpc": ["eth_call", "eth_getBalance"]}
    assert MARKER not in proxy.output()


# -- MCP ------------------------------------------------------------------------------------

MCP_RULE = {"tools": ["search_issues"], "resources": ["repo://acme/"], "prompts": ["triage"]}


def _mcp(proxy: Proxy, names, host: str = MCP_JSON, **kw) -> tuple[str, str]:
    return _grant(
        proxy,
        names,
        "mcp",
        MCP_RULE,
        host=host,
        paths=("/mcp",),
        methods=("GET", "POST", "DELETE"),
        **kw,
    )


def _rpc(method: str, params: dict | None = None, id_: Any = 1) -> dict:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if id_ is not None:
        message["id"] = id_
    if params is not None:
        message["params"] = params
    return message


def _mcp_post(client: httpx.Client, payload: Any, host: str = MCP_JSON, **kw) -> httpx.Response:
    headers = {**MCP_ACCEPT, **kw.pop("headers", {})}
    if isinstance(payload, bytes):
        return client.post(
            f"https://{host}/mcp",
            content=payload,
            headers={**headers, "content-type": "application/json"},
            **kw,
        )
    return client.post(f"https://{host}/mcp", json=payload, headers=headers, **kw)


MCP_REFUSED = {
    "tools/call": _rpc("tools/call", {"name": "delete_repository", "arguments": {"name": "w"}}),
    "tools/call as a notification": _rpc(
        "tools/call", {"name": "delete_repository", "arguments": {"name": "w"}}, id_=None
    ),
    "escaped tool name": json.dumps(
        _rpc("tools/call", {"name": "delete_repository", "arguments": {"name": "w"}})
    )
    .replace("delete_repository", "delete_r\\u0065pository")
    .encode(),
    "escaped method": json.dumps(
        _rpc("tools/call", {"name": "delete_repository", "arguments": {"name": "w"}})
    )
    .replace("tools/call", "tools\\/call")
    .encode(),
    "Name beside name": b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":'
    b'{"name":"search_issues","Name":"delete_repository","arguments":{"name":"w"}}}',
    "batch": [
        _rpc("tools/call", {"name": "search_issues", "arguments": {"query": "q"}}),
        _rpc("tools/call", {"name": "delete_repository", "arguments": {"name": "w"}}, id_=2),
    ],
    "resource outside the prefix": _rpc("resources/read", {"uri": "repo://acmecorp/x"}),
    "resource in another scheme": _rpc("resources/read", {"uri": "secret://vault/key"}),
    "resource climbing out": _rpc("resources/read", {"uri": "repo://acme/../../secret://vault/k"}),
    "resource percent-encoded": _rpc("resources/read", {"uri": "repo://acme/%2e%2e/x"}),
    "resource upper-case scheme": _rpc("resources/read", {"uri": "REPO://acmecorp/x"}),
    "resource subscribe": _rpc("resources/subscribe", {"uri": "secret://vault/key"}),
    "prompt": _rpc("prompts/get", {"name": "exfiltrate", "arguments": {"target": "t"}}),
    "unknown method": _rpc("tasks/get", {"taskId": "x"}),
    "sampling from the client": _rpc("sampling/createMessage", {"messages": []}),
    "params as a list": _rpc("tools/call", None) | {"params": ["delete_repository"]},
}


@pytest.mark.parametrize("shape", [MCP_JSON, MCP_SSE])
@pytest.mark.parametrize("payload", MCP_REFUSED.values(), ids=MCP_REFUSED)
def test_mcp_calls_outside_the_grant_never_run(
    proxy: Proxy, upstream: Upstream, executed, names, payload, shape
):
    agent, token = _mcp(proxy, names, host=shape)
    with proxy.client(agent, token) as client:
        refused = _mcp_post(client, payload, host=shape)
    assert refused.status_code in (400, 403), refused.text
    assert not [e for e in executed.snapshot() if e != "mcp:search_issues"]


@pytest.mark.parametrize("shape", [MCP_JSON, MCP_SSE])
def test_mcp_granted_calls_run_and_tools_list_shows_only_the_granted_tools(
    proxy: Proxy, upstream: Upstream, executed, names, shape
):
    agent, token = _mcp(proxy, names, host=shape)
    init = _rpc(
        "initialize",
        {
            "protocolVersion": "2025-03-26",
            "capabilities": {},
            "clientInfo": {"name": "x", "version": "1"},
        },
    )
    with proxy.client(agent, token) as client:
        answers = {
            "init": _mcp_post(client, init, host=shape),
            "list": _mcp_post(client, _rpc("tools/list", {}), host=shape),
            "list gzip": _mcp_post(
                client, _rpc("tools/list", {}), host=shape, headers={"accept-encoding": "gzip"}
            ),
            "call": _mcp_post(
                client,
                _rpc("tools/call", {"name": "search_issues", "arguments": {"query": MARKER}}),
                host=shape,
            ),
            "read": _mcp_post(
                client, _rpc("resources/read", {"uri": "repo://acme/widgets"}), host=shape
            ),
            "prompt": _mcp_post(
                client,
                _rpc("prompts/get", {"name": "triage", "arguments": {"issue": "7"}}),
                host=shape,
            ),
        }
    assert {k: a.status_code for k, a in answers.items()} == dict.fromkeys(answers, 200)
    for key in ("list", "list gzip"):
        assert "search_issues" in answers[key].text, answers[key].text
        assert "delete_repository" not in answers[key].text
    assert executed.snapshot() == [
        "mcp:search_issues",
        "mcp:repo://acme/widgets",
        "mcp:prompt:triage",
    ]
    assert MARKER not in proxy.output()


@pytest.mark.parametrize("shape", [MCP_JSON, MCP_SSE])
def test_a_refused_mcp_call_spends_no_use(proxy: Proxy, upstream: Upstream, executed, names, shape):
    agent, token = _mcp(proxy, names, host=shape, limits=validation.limits(None, None, 1))
    bad = _rpc("tools/call", {"name": "delete_repository", "arguments": {"name": "w"}})
    good = _rpc("tools/call", {"name": "search_issues", "arguments": {"query": "q"}})
    with proxy.client(agent, token) as client:
        statuses = [_mcp_post(client, p, host=shape).status_code for p in (bad, good, good)]
    assert statuses == [403, 200, 403]
    assert executed.snapshot() == ["mcp:search_issues"]
