"""A grant's body rule decided on the exact bytes: the hostile table, without a proxy."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any
from urllib.parse import quote, quote_plus

import pytest

import addon.core.bodies as bodies
from addon.core.bodies import MAX_BATCH, MAX_DECIDED_BODY, BodyDecision, decide
from addon.core.reasons import STATUS, Reason
from store.rules.bodyrules import BodyRule, parse

GQL = parse("graphql", {"query": "*", "mutation": ["addComment"]})
READ_ONLY = parse("graphql", {"query": ["viewer", "repository"]})
INTROSPECTION = parse("graphql", {"mutation": ["addComment"], "introspection": True})
INTROSPECTION_ONLY = parse("graphql", {"introspection": True})
HASH = hashlib.sha256(b"{ viewer { login } }").hexdigest()
PERSISTED = parse("graphql", {"query": ["viewer"], "persisted": [HASH]})
MCP = parse("mcp", {"tools": ["search"], "resources": ["repo://acme/"], "prompts": ["triage"]})
RPC = parse("jsonrpc", {"methods": ["eth_call", "eth_getBalance"]})

ALLOWED = None
UNDECIDABLE = Reason.BODY_UNDECIDABLE
OPERATION = Reason.OPERATION_NOT_ALLOWED
TOOL = Reason.TOOL_NOT_ALLOWED
METHOD = Reason.RPC_METHOD_NOT_ALLOWED
SECRET = "s3cr3t-value-never-shown"


def j(value: Any) -> bytes:
    return json.dumps(value).encode()


def gql(
    body: Any,
    *,
    rule: BodyRule = GQL,
    target: bytes = b"/graphql",
    content_type: str | None = "application/json",
    encoding: str | None = None,
) -> BodyDecision:
    raw = body if isinstance(body, bytes) else j(body)
    return decide(rule, "POST", target, content_type, encoding, raw)


def get(query: str, rule: BodyRule = GQL, body: bytes = b"") -> BodyDecision:
    return decide(rule, "GET", b"/graphql?" + query.encode(), None, None, body)


def mcp(body: Any, rule: BodyRule = MCP, method: str = "POST") -> BodyDecision:
    raw = body if isinstance(body, bytes) else j(body)
    return decide(rule, method, b"/mcp", "application/json", None, raw)


def rpc(body: Any, rule: BodyRule = RPC) -> BodyDecision:
    raw = body if isinstance(body, bytes) else j(body)
    return decide(rule, "POST", b"/rpc", "application/json", None, raw)


def call(method: str, params: Any = None, **extra: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": method, **extra}
    if params is not None:
        message["params"] = params
    return message


def tool(name: Any) -> dict[str, Any]:
    return call("tools/call", {"name": name, "arguments": {"q": SECRET}})


def read(uri: str) -> dict[str, Any]:
    return call("resources/read", {"uri": uri})


MUTATION = "mutation Drop { deleteRepository(id: 1) { id } }"


# GraphQL: the document decides, through aliases, fragments, batches and operation names.


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(gql({"query": "{ viewer { login } }"}), ALLOWED, id="allow a shorthand query"),
        pytest.param(
            gql({"query": "mutation { addComment(body: 1) { id } }"}),
            ALLOWED,
            id="allow a granted mutation field",
        ),
        pytest.param(gql({"query": MUTATION}), OPERATION, id="deny a mutation field not listed"),
        pytest.param(
            gql({"query": "mutation { x: deleteRepository(id: 1) { id } }"}),
            OPERATION,
            id="deny a mutation behind an alias",
        ),
        pytest.param(
            gql({"query": "mutation { addComment: deleteRepository(id: 1) { id } }"}),
            OPERATION,
            id="deny a mutation aliased as a granted field",
        ),
        pytest.param(
            gql(
                {
                    "query": "mutation { ...F } fragment F on Mutation "
                    "{ deleteRepository(id: 1) { id } }"
                }
            ),
            OPERATION,
            id="deny a mutation field in a fragment spread",
        ),
        pytest.param(
            gql(
                {
                    "query": "mutation { ...F } fragment F on Mutation { ...G } "
                    "fragment G on Mutation { deleteRepository(id: 1) { id } }"
                }
            ),
            OPERATION,
            id="deny a mutation field in a fragment of a fragment",
        ),
        pytest.param(
            gql({"query": "mutation { ... on Mutation { deleteRepository(id: 1) { id } } }"}),
            OPERATION,
            id="deny a mutation field in an inline fragment",
        ),
        pytest.param(
            gql({"query": "mutation { ...F ...F } fragment F on Mutation { addComment { id } }"}),
            ALLOWED,
            id="allow a fragment spread twice",
        ),
        pytest.param(
            gql({"query": f"query Read {{ viewer {{ id }} }} {MUTATION}", "operationName": "Read"}),
            OPERATION,
            id="deny a mutation in a second operation operationName does not select",
        ),
        pytest.param(
            gql({"query": "query Read { viewer { id } } query Other { viewer { id } }"}),
            UNDECIDABLE,
            id="deny several operations without operationName",
        ),
        pytest.param(
            gql({"query": "query Read { viewer { id } }", "operationName": "Other"}),
            UNDECIDABLE,
            id="deny an operationName that names no operation",
        ),
        pytest.param(
            gql({"query": "query Read { viewer { id } }", "operationName": None}),
            ALLOWED,
            id="allow a null operationName with one operation",
        ),
        pytest.param(
            gql(
                {
                    "query": "query A { viewer { id } } query A { viewer { id } }",
                    "operationName": "A",
                }
            ),
            UNDECIDABLE,
            id="deny two operations of one name",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } } { viewer { id } }", "operationName": None}),
            UNDECIDABLE,
            id="deny two anonymous operations",
        ),
        pytest.param(
            gql({"query": "fragment F on Query { viewer { id } }"}),
            UNDECIDABLE,
            id="deny a document without an operation",
        ),
        pytest.param(
            gql({"query": "type Query { x: Int } { viewer { id } }"}),
            UNDECIDABLE,
            id="deny a document with type-system definitions",
        ),
        pytest.param(
            gql({"query": "mutation { deleteRepository(id: 1 }"}),
            UNDECIDABLE,
            id="deny a document that does not parse",
        ),
        pytest.param(
            gql({"query": "{ ...Missing }"}),
            UNDECIDABLE,
            id="deny a spread of an undefined fragment",
        ),
        pytest.param(
            gql({"query": "{ viewer { ...Missing } }"}),
            UNDECIDABLE,
            id="deny a nested spread of an undefined fragment",
        ),
        pytest.param(
            gql({"query": "{ ...A } fragment A on Query { ...B } fragment B on Query { ...A }"}),
            UNDECIDABLE,
            id="deny a fragment cycle",
        ),
        pytest.param(
            gql(
                {
                    "query": "{ viewer { id } } fragment A on User { f { ...B } } "
                    "fragment B on User { g { ...A } }"
                }
            ),
            UNDECIDABLE,
            id="deny a fragment cycle below the top level",
        ),
        pytest.param(
            gql(
                {
                    "query": "{ ...A } fragment A on Query { viewer { id } } fragment A on Query "
                    "{ x }"
                }
            ),
            UNDECIDABLE,
            id="deny a fragment defined twice",
        ),
        pytest.param(
            gql({"query": "subscription { onIssue { id } }"}),
            OPERATION,
            id="deny an operation type the grant does not name",
        ),
        pytest.param(
            gql({"query": "{ repository { id } viewer { id } }"}, rule=READ_ONLY),
            ALLOWED,
            id="allow listed query fields",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } organization { id } }"}, rule=READ_ONLY),
            OPERATION,
            id="deny a query field not listed",
        ),
        pytest.param(
            gql({"query": "mutation { addComment { id } }"}, rule=READ_ONLY),
            OPERATION,
            id="deny a mutation to a read-only grant",
        ),
    ],
)
def test_graphql_documents(decision: BodyDecision, expected: Reason | None) -> None:
    assert decision.reason is expected
    assert decision.allowed is (expected is None)


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(
            gql({"query": "{ __typename viewer { id } }"}, rule=READ_ONLY),
            ALLOWED,
            id="allow __typename at the top level",
        ),
        pytest.param(
            gql({"query": "{ __schema { types { name } } }"}),
            OPERATION,
            id="deny __schema without introspection",
        ),
        pytest.param(
            gql({"query": '{ t: __type(name: "X") { name } }'}),
            OPERATION,
            id="deny __type behind an alias without introspection",
        ),
        pytest.param(
            gql({"query": "{ ...I } fragment I on Query { __schema { types { name } } }"}),
            OPERATION,
            id="deny __schema in a fragment without introspection",
        ),
        pytest.param(
            gql({"query": "{ __directive }"}),
            OPERATION,
            id="deny any double-underscore field without introspection",
        ),
        pytest.param(
            gql({"query": "{ __schema { types { name } } }"}, rule=INTROSPECTION),
            ALLOWED,
            id="allow __schema with introspection and no query type granted",
        ),
        pytest.param(
            gql({"query": "{ __schema { types { name } } viewer { id } }"}, rule=INTROSPECTION),
            OPERATION,
            id="deny a query field beside introspection when queries are not granted",
        ),
        pytest.param(
            gql({"query": '{ __typename __type(name: "X") { name } }'}, rule=INTROSPECTION_ONLY),
            ALLOWED,
            id="allow introspection to a grant of introspection alone",
        ),
        pytest.param(
            gql({"query": "mutation { __schema { types { name } } }"}, rule=INTROSPECTION),
            OPERATION,
            id="deny introspection in a mutation",
        ),
        pytest.param(
            gql({"query": "{ __typename }"}, rule=PERSISTED),
            ALLOWED,
            id="allow __typename alone in a granted query type",
        ),
    ],
)
def test_graphql_introspection(decision: BodyDecision, expected: Reason | None) -> None:
    assert decision.reason is expected


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(
            gql([{"query": "{ viewer { id } }"}, {"query": "mutation { addComment { id } }"}]),
            ALLOWED,
            id="allow a batch of granted operations",
        ),
        pytest.param(
            gql([{"query": "{ viewer { id } }"}, {"query": MUTATION}]),
            OPERATION,
            id="deny a mutation hidden in a batch",
        ),
        pytest.param(gql([]), UNDECIDABLE, id="deny an empty batch"),
        pytest.param(
            gql([{"query": "{ viewer { id } }"}] * (MAX_BATCH + 1)),
            UNDECIDABLE,
            id="deny a batch over the cap",
        ),
        pytest.param(
            gql([{"query": "{ viewer { id } }"}, "mutation { x }"]),
            UNDECIDABLE,
            id="deny a batch element that is not an object",
        ),
        pytest.param(gql("{ viewer { id } }"), UNDECIDABLE, id="deny a JSON string body"),
        pytest.param(
            gql({"query": "{ viewer { id } }", "documentId": "abc"}),
            UNDECIDABLE,
            id="deny an unknown member a server may run instead",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }", "Query": MUTATION}),
            UNDECIDABLE,
            id="deny a member that differs in case only",
        ),
        pytest.param(
            gql({"query": ["{ viewer { id } }"]}), UNDECIDABLE, id="deny a query that is no string"
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }", "operationName": 1}),
            UNDECIDABLE,
            id="deny an operationName that is no string",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }", "extensions": "x"}),
            UNDECIDABLE,
            id="deny extensions that are no object",
        ),
        pytest.param(
            gql({"variables": {"id": 1}}), UNDECIDABLE, id="deny a request without a document"
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }", "variables": {"x": SECRET}}),
            ALLOWED,
            id="allow variables, unread",
        ),
    ],
)
def test_graphql_requests(decision: BodyDecision, expected: Reason | None) -> None:
    assert decision.reason is expected


def persisted(digest: Any, query: str | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"extensions": {"persistedQuery": {"version": 1, "sha256Hash": digest}}}
    if query is not None:
        found["query"] = query
    return found


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(
            gql(persisted(HASH), rule=PERSISTED), ALLOWED, id="allow a listed persisted hash"
        ),
        pytest.param(
            gql(persisted("0" * 64), rule=PERSISTED),
            OPERATION,
            id="deny a persisted hash not listed",
        ),
        pytest.param(
            gql(persisted(HASH.upper()), rule=PERSISTED),
            OPERATION,
            id="deny a listed hash in upper case",
        ),
        pytest.param(
            gql(persisted(HASH)), OPERATION, id="deny a persisted hash to a grant without any"
        ),
        pytest.param(
            gql(persisted(HASH, "{ viewer { login } }"), rule=PERSISTED),
            ALLOWED,
            id="allow a document with its own hash",
        ),
        pytest.param(
            gql(persisted(hashlib.sha256(MUTATION.encode()).hexdigest(), MUTATION), rule=PERSISTED),
            OPERATION,
            id="decide the document sent with a hash",
        ),
        pytest.param(
            gql(persisted(HASH, "{ viewer { id } }"), rule=PERSISTED),
            UNDECIDABLE,
            id="deny a document sent with another document's hash",
        ),
        pytest.param(
            gql({"extensions": {"persistedQuery": {"version": 1}}}, rule=PERSISTED),
            UNDECIDABLE,
            id="deny a persisted query without a hash",
        ),
        pytest.param(
            gql(persisted(1), rule=PERSISTED), UNDECIDABLE, id="deny a hash that is no string"
        ),
        pytest.param(
            get(
                "extensions=" + quote_plus(json.dumps({"persistedQuery": {"sha256Hash": HASH}})),
                rule=PERSISTED,
            ),
            ALLOWED,
            id="allow a listed persisted hash in a GET",
        ),
        pytest.param(
            get("extensions=" + quote_plus(json.dumps({"persistedQuery": {"sha256Hash": "0"}}))),
            OPERATION,
            id="deny a persisted hash not listed in a GET",
        ),
    ],
)
def test_graphql_persisted_queries(decision: BodyDecision, expected: Reason | None) -> None:
    assert decision.reason is expected


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(get("query=" + quote("{ viewer { id } }")), ALLOWED, id="allow a GET query"),
        pytest.param(
            get("query=" + quote_plus("query Q { viewer { id } }")),
            ALLOWED,
            id="read + in a GET as a space",
        ),
        pytest.param(
            get("query=" + quote_plus(MUTATION)),
            OPERATION,
            id="deny a mutation in a GET query string",
        ),
        pytest.param(
            get("query=" + quote("{ viewer { id } }") + "&query=" + quote(MUTATION)),
            UNDECIDABLE,
            id="deny two query parameters",
        ),
        pytest.param(
            get("query=" + quote("{ viewer { id } }") + ";query=" + quote(MUTATION)),
            UNDECIDABLE,
            id="deny a semicolon some servers split on",
        ),
        pytest.param(
            get("query=" + quote("{ viewer { id } }") + "&Query=" + quote(MUTATION)),
            UNDECIDABLE,
            id="deny an unknown parameter",
        ),
        pytest.param(
            get("%71uery=" + quote(MUTATION)),
            OPERATION,
            id="decode percent-escapes in a parameter name",
        ),
        pytest.param(
            get("query=" + quote("{ viewer { id } } #") + "%zz"),
            UNDECIDABLE,
            id="deny a malformed percent-escape",
        ),
        pytest.param(
            get("query=" + quote("{ viewer { id } } #") + "%FF"),
            UNDECIDABLE,
            id="deny a percent-escape not UTF-8",
        ),
        pytest.param(
            get("query=" + quote("{ viewer { id } } #") + ";query=" + quote(MUTATION)),
            UNDECIDABLE,
            id="deny a semicolon hidden from us in a comment",
        ),
        pytest.param(
            get("query=" + quote("{ viewer { id } }") + "&extensions=" + quote("[]")),
            UNDECIDABLE,
            id="deny GET extensions no object beside a document",
        ),
        pytest.param(
            get("query=" + quote("query A { viewer { id } }") + "&operationName=A"),
            ALLOWED,
            id="allow a GET operationName",
        ),
        pytest.param(
            get("query=" + quote("{ viewer { id } }"), body=j({"query": MUTATION})),
            UNDECIDABLE,
            id="deny a GET with a body",
        ),
        pytest.param(
            decide(GQL, "GET", b"/graphql?query=%7Bx%7D#frag", None, None, b""),
            UNDECIDABLE,
            id="deny a target with a fragment",
        ),
        pytest.param(get(""), UNDECIDABLE, id="deny a GET without a document"),
        pytest.param(
            get("extensions=" + quote("[]")), UNDECIDABLE, id="deny GET extensions no object"
        ),
    ],
)
def test_graphql_get(decision: BodyDecision, expected: Reason | None) -> None:
    assert decision.reason is expected


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(
            gql(
                {"query": "{ viewer { id } }"}, target=b"/graphql?query=" + quote(MUTATION).encode()
            ),
            UNDECIDABLE,
            id="deny a POST with a query parameter",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }"}, target=b"/graphql?x=1;OperationName=Drop"),
            UNDECIDABLE,
            id="deny a POST with a GraphQL parameter after a semicolon, in any case",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }"}, target=b"/graphql?%71ueryId=1"),
            UNDECIDABLE,
            id="deny a POST with a percent-encoded GraphQL parameter",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }"}, target=b"/graphql?tenant=acme"),
            ALLOWED,
            id="allow a POST with another query parameter",
        ),
        pytest.param(
            gql(b"mutation { addComment { id } }", content_type="application/graphql"),
            ALLOWED,
            id="allow an application/graphql body",
        ),
        pytest.param(
            gql(MUTATION.encode(), content_type="application/graphql; charset=utf-8"),
            OPERATION,
            id="deny a mutation in an application/graphql body",
        ),
        pytest.param(
            gql(
                b"query=" + quote_plus(MUTATION).encode(),
                content_type="application/x-www-form-urlencoded",
            ),
            UNDECIDABLE,
            id="deny a document in a form field",
        ),
        pytest.param(
            gql(j({"query": MUTATION}), content_type="text/plain"),
            UNDECIDABLE,
            id="deny a text/plain body",
        ),
        pytest.param(
            gql(j({"query": MUTATION}), content_type=None), UNDECIDABLE, id="deny no type"
        ),
        pytest.param(
            gql(j({"query": MUTATION}), content_type="application/json, text/plain"),
            UNDECIDABLE,
            id="deny two content types",
        ),
        pytest.param(
            gql(j({"query": "{ viewer { id } }"}), content_type="application/json; charset"),
            UNDECIDABLE,
            id="deny a Content-Type that does not parse",
        ),
        pytest.param(
            gql(b"{ viewer { id } }", content_type="text/plain"),
            UNDECIDABLE,
            id="deny a document as text/plain",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }"}, target=b"/graphql?%zz=1"),
            UNDECIDABLE,
            id="deny a POST whose query string has a malformed percent-escape",
        ),
        pytest.param(
            decide(GQL, "PUT", b"/graphql", "application/json", None, j({"query": "{ x }"})),
            UNDECIDABLE,
            id="deny a GraphQL PUT",
        ),
    ],
)
def test_graphql_transport(decision: BodyDecision, expected: Reason | None) -> None:
    assert decision.reason is expected


# Strict decoding, for every kind.


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(
            gql({"query": "{ viewer { id } }"}, content_type='application/json; charset="UTF-8"'),
            ALLOWED,
            id="allow a quoted UTF-8 charset",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }"}, encoding="identity"),
            ALLOWED,
            id="allow Content-Encoding identity",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }"}, encoding="gzip"),
            UNDECIDABLE,
            id="deny Content-Encoding gzip",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }"}, encoding=""),
            UNDECIDABLE,
            id="deny an empty Content-Encoding",
        ),
        pytest.param(
            gql(json.dumps({"query": MUTATION}).encode("utf-16")),
            UNDECIDABLE,
            id="deny a UTF-16 JSON body",
        ),
        pytest.param(
            gql(json.dumps({"query": "{ viewer { id } }"}).encode("utf-32-le")),
            UNDECIDABLE,
            id="deny a UTF-32 JSON body without BOM",
        ),
        pytest.param(
            gql(b"\xef\xbb\xbf" + j({"query": "{ viewer { id } }"})),
            UNDECIDABLE,
            id="deny a UTF-8 BOM",
        ),
        pytest.param(
            gql(b"\xef\xbb\xbf{ viewer { id } }", content_type="application/graphql"),
            UNDECIDABLE,
            id="deny a UTF-8 BOM before a document",
        ),
        pytest.param(
            gql(b'{"query": "{ viewer { id } }", "variables": {"x": "\xff"}}'),
            UNDECIDABLE,
            id="deny a body not UTF-8",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }"}, content_type="application/json; charset=latin-1"),
            UNDECIDABLE,
            id="deny a charset other than UTF-8",
        ),
        pytest.param(
            gql(
                {"query": "{ viewer { id } }"},
                content_type="application/json; charset=utf-8; charset=utf-16",
            ),
            UNDECIDABLE,
            id="deny two charsets",
        ),
        pytest.param(
            gql(b"{ viewer { id } }", content_type="application/graphql; charset=utf-16"),
            UNDECIDABLE,
            id="deny an application/graphql charset other than UTF-8",
        ),
        pytest.param(
            gql(b'{"query": "{ viewer { id } }", "query": "' + MUTATION.encode() + b'"}'),
            UNDECIDABLE,
            id="deny duplicate keys",
        ),
        pytest.param(
            gql(b'{"query": "{ viewer { id } }", "variables": {"a": 1, "a": 2}}'),
            UNDECIDABLE,
            id="deny duplicate keys nested",
        ),
        pytest.param(
            mcp(
                b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call",'
                b' "params": {"name": "search", "NAME": "drop"}}'
            ),
            UNDECIDABLE,
            id="deny keys equal but for case",
        ),
        pytest.param(
            gql(b'{"query": "{ viewer { id } }", "variables": {"a": NaN}}'),
            UNDECIDABLE,
            id="deny NaN",
        ),
        pytest.param(
            rpc(b'{"jsonrpc": "2.0", "id": Infinity, "method": "eth_call"}'),
            UNDECIDABLE,
            id="deny Infinity",
        ),
        pytest.param(
            gql(
                b'{"query": "{ viewer { id } }", "variables": '
                + b"[" * 100_000
                + b"]" * 100_000
                + b"}"
            ),
            UNDECIDABLE,
            id="deny JSON nested too deeply",
        ),
        pytest.param(
            gql({"query": "{ viewer " + "{ a " * 5_000 + "}" * 5_000 + " }"}),
            UNDECIDABLE,
            id="deny a document nested too deeply",
        ),
        pytest.param(
            gql({"query": "{ viewer { id } }" + " #\n" * (bodies.MAX_TOKENS + 1)}),
            UNDECIDABLE,
            id="deny a document over the token limit",
        ),
        pytest.param(
            gql(b'{"query": "{ viewer { id } }"} trailing'),
            UNDECIDABLE,
            id="deny bytes after the JSON value",
        ),
    ],
)
def test_strict_decoding(decision: BodyDecision, expected: Reason | None) -> None:
    assert decision.reason is expected


def test_a_body_over_the_bound_is_refused() -> None:
    padding = " " * (MAX_DECIDED_BODY - len(j({"query": "{ viewer { id } }"})))
    fits = gql(j({"query": "{ viewer { id } }"}) + padding.encode())
    assert fits.allowed
    found = gql(j({"query": "{ viewer { id } }"}) + padding.encode() + b" ")
    assert found.reason is Reason.BODY_TOO_LARGE


def test_any_exception_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(bodies, "_check_operation", broken)
    found = gql({"query": "{ viewer { id } }"})
    assert (found.allowed, found.reason) == (False, Reason.BODY_UNDECIDABLE)
    assert "boom" not in found.detail


def test_fragments_spread_exponentially_are_expanded_once() -> None:
    levels = 26  # 2**26 paths, walked without the guards
    parts = ["query Q { ...A0 ...B0 }"]
    for i in range(levels):
        parts += [f"fragment {x}{i} on Query {{ ...A{i + 1} ...B{i + 1} }}" for x in "AB"]
    parts += [f"fragment {x}{levels} on Query {{ viewer {{ id }} }}" for x in "AB"]
    started = time.perf_counter()
    found = gql({"query": " ".join(parts)})
    assert found.allowed
    assert time.perf_counter() - started < 2


# MCP


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(mcp(tool("search")), ALLOWED, id="allow a granted tool"),
        pytest.param(mcp(tool("delete_repo")), TOOL, id="deny a tool not granted"),
        pytest.param(
            mcp([call("ping"), tool("search"), tool("delete_repo")]),
            TOOL,
            id="deny a tools/call inside a batch",
        ),
        pytest.param(mcp([]), UNDECIDABLE, id="deny an empty batch"),
        pytest.param(mcp(tool(["search"])), UNDECIDABLE, id="deny a tool name that is no string"),
        pytest.param(mcp(call("tools/call")), UNDECIDABLE, id="deny a tools/call without params"),
        pytest.param(
            mcp(call("tools/call", {"Name": "delete_repo"})),
            UNDECIDABLE,
            id="deny a tool name under another case",
        ),
        pytest.param(
            mcp(call("prompts/get", {"name": "triage"})), ALLOWED, id="allow a granted prompt"
        ),
        pytest.param(
            mcp(call("prompts/get", {"name": "exfiltrate"})), TOOL, id="deny a prompt not granted"
        ),
        pytest.param(mcp(read("repo://acme/readme")), ALLOWED, id="allow a granted resource"),
        pytest.param(
            mcp(call("resources/subscribe", {"uri": "repo://other/x"})),
            TOOL,
            id="deny a resource subscription outside the prefixes",
        ),
        pytest.param(
            mcp(call("resources/unsubscribe", {"uri": "repo://other/x"})),
            TOOL,
            id="deny a resource unsubscription outside the prefixes",
        ),
        pytest.param(mcp(read("repo://acme/../other/x")), TOOL, id="deny a dot-dot segment"),
        pytest.param(mcp(read("repo://acme/..")), TOOL, id="deny a final dot-dot segment"),
        pytest.param(mcp(read("repo://acme/./x")), TOOL, id="deny a dot segment"),
        pytest.param(mcp(read("repo://acme/..;/other")), TOOL, id="deny a dot-dot with a ;"),
        pytest.param(mcp(read("repo://acme/%2e%2e/other")), TOOL, id="deny a percent-escape"),
        pytest.param(mcp(read("repo://acme/..\\other")), TOOL, id="deny a backslash"),
        pytest.param(mcp(read("repo://acme/\uff0e\uff0e/other")), TOOL, id="deny non-ASCII"),
        pytest.param(mcp(read("repo://acme/x\ny")), TOOL, id="deny a control character"),
        pytest.param(mcp(read("repo://acme/..x")), ALLOWED, id="allow a name starting with dots"),
        pytest.param(mcp(read("REPO://acme/x")), TOOL, id="compare the prefix exactly"),
        pytest.param(mcp(read("repo://acme/x"), rule=parse("mcp", {})), TOOL, id="no resources"),
        pytest.param(mcp(call("sampling/createMessage", {})), METHOD, id="deny an unknown method"),
        pytest.param(mcp(call("tasks/get", {})), METHOD, id="deny a method outside the set"),
        pytest.param(mcp(call("Tools/call", {"name": "x"})), METHOD, id="compare methods exactly"),
    ],
)
def test_mcp_calls(decision: BodyDecision, expected: Reason | None) -> None:
    assert decision.reason is expected


@pytest.mark.parametrize(
    "method",
    [
        "initialize",
        "ping",
        "notifications/initialized",
        "notifications/cancelled",
        "tools/list",
        "resources/list",
        "resources/templates/list",
        "prompts/list",
        "logging/setLevel",
        "completion/complete",
    ],
)
def test_mcp_lifecycle_and_listing_pass(method: str) -> None:
    assert mcp(call(method, {})).allowed
    assert mcp(call(method, {}), rule=parse("mcp", {})).allowed


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(
            mcp({"jsonrpc": "2.0", "id": 7, "result": {"roots": []}}),
            ALLOWED,
            id="allow the client's answer to a server request",
        ),
        pytest.param(
            mcp({"jsonrpc": "2.0", "id": 7, "error": {"code": 1, "message": "no"}}),
            ALLOWED,
            id="allow the client's error answer",
        ),
        pytest.param(
            mcp({"jsonrpc": "2.0", "result": {}}), UNDECIDABLE, id="deny an answer without an id"
        ),
        pytest.param(
            mcp({"jsonrpc": "2.0", "id": 1, "result": {}, "error": {}}),
            UNDECIDABLE,
            id="deny an answer with result and error",
        ),
        pytest.param(
            mcp({"jsonrpc": "2.0", "id": 1, "error": "x"}),
            UNDECIDABLE,
            id="deny an error that is no object",
        ),
        pytest.param(
            mcp(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "result": {},
                    "Method": "tools/call",
                    "params": {"name": "delete_repo"},
                }
            ),
            UNDECIDABLE,
            id="deny an answer carrying a method under another case",
        ),
        pytest.param(
            mcp(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "result": {},
                    "method": "tools/call",
                    "params": {"name": "delete_repo"},
                }
            ),
            UNDECIDABLE,
            id="deny a request that also carries a result",
        ),
        pytest.param(
            mcp({"id": 1, "method": "ping"}), UNDECIDABLE, id="deny a message without jsonrpc"
        ),
        pytest.param(
            mcp({"jsonrpc": 2.0, "id": 1, "method": "ping"}),
            UNDECIDABLE,
            id="deny jsonrpc 2.0 as a number",
        ),
        pytest.param(
            mcp({"jsonrpc": "2.0", "id": True, "method": "ping"}),
            UNDECIDABLE,
            id="deny a boolean id",
        ),
        pytest.param(
            mcp({"jsonrpc": "2.0", "id": {}, "method": "ping"}), UNDECIDABLE, id="deny an object id"
        ),
        pytest.param(
            mcp({"jsonrpc": "2.0", "id": 1, "method": ["tools/call"]}),
            UNDECIDABLE,
            id="deny a method that is no string",
        ),
        pytest.param(
            mcp({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": "x"}),
            UNDECIDABLE,
            id="deny params that are no object",
        ),
        pytest.param(mcp(b"", method="GET"), ALLOWED, id="allow GET opening the stream"),
        pytest.param(mcp(b"", method="DELETE"), ALLOWED, id="allow DELETE ending the session"),
        pytest.param(
            mcp(tool("delete_repo"), method="GET"), UNDECIDABLE, id="deny a GET with a body"
        ),
        pytest.param(mcp(tool("search"), method="PUT"), UNDECIDABLE, id="deny an MCP PUT"),
        pytest.param(
            decide(MCP, "POST", b"/mcp", "text/plain", None, j(tool("search"))),
            UNDECIDABLE,
            id="deny an MCP body that is not JSON",
        ),
    ],
)
def test_mcp_messages(decision: BodyDecision, expected: Reason | None) -> None:
    assert decision.reason is expected


# JSON-RPC


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(rpc(call("eth_call", [])), ALLOWED, id="allow a listed method"),
        pytest.param(
            rpc({"jsonrpc": "2.0", "method": "eth_getBalance"}), ALLOWED, id="allow a notification"
        ),
        pytest.param(rpc(call("eth_sendTransaction", [])), METHOD, id="deny a method not listed"),
        pytest.param(
            rpc([call("eth_call"), call("eth_sendRawTransaction")]),
            METHOD,
            id="deny a method hidden in a batch",
        ),
        pytest.param(rpc({"jsonrpc": "2.0", "id": 1}), UNDECIDABLE, id="deny a missing method"),
        pytest.param(
            rpc({"jsonrpc": "2.0", "id": 1, "result": 1}), UNDECIDABLE, id="deny a response"
        ),
        pytest.param(rpc({"id": 1, "method": "eth_call"}), UNDECIDABLE, id="deny no jsonrpc"),
        pytest.param(
            rpc({"jsonrpc": "1.0", "id": 1, "method": "eth_call"}), UNDECIDABLE, id="deny 1.0"
        ),
        pytest.param(
            rpc(call("eth_call", Method="eth_sendTransaction")),
            UNDECIDABLE,
            id="deny a method under another case",
        ),
        pytest.param(rpc(call("eth_call", extra=1)), UNDECIDABLE, id="deny an unknown member"),
        pytest.param(rpc([call("eth_call"), 1]), UNDECIDABLE, id="deny a batch element no object"),
        pytest.param(
            decide(RPC, "GET", b"/rpc", "application/json", None, j(call("eth_call"))),
            UNDECIDABLE,
            id="deny a JSON-RPC GET",
        ),
        pytest.param(
            rpc(b'{"jsonrpc": "2.0", "id": 1e400, "method": "eth_call"}'),
            UNDECIDABLE,
            id="deny a number out of range",
        ),
    ],
)
def test_jsonrpc(decision: BodyDecision, expected: Reason | None) -> None:
    assert decision.reason is expected


# What the decision shows: names, never values.


def test_summaries_name_operations_and_fields() -> None:
    found = gql(
        {"query": "mutation AddIt { x: addComment(body: $b) { id } }", "variables": {"b": SECRET}}
    )
    assert found.summary == {
        "graphql": [{"type": "mutation", "name": "AddIt", "fields": ["addComment"]}]
    }
    assert mcp([tool("search"), call("ping")]).summary == {
        "mcp": [{"method": "tools/call", "tool": "search"}, {"method": "ping"}]
    }
    assert rpc(call("eth_call", [SECRET])).summary == {"jsonrpc": ["eth_call"]}
    assert mcp(read("repo://acme/x?token=" + SECRET)).summary == {
        "mcp": [{"method": "resources/read", "resource": "repo://acme/x"}]
    }
    assert gql(persisted(HASH), rule=PERSISTED).summary == {
        "graphql": [{"type": "persisted", "hash": HASH}]
    }


@pytest.mark.parametrize(
    "decision",
    [
        pytest.param(
            gql({"query": MUTATION, "variables": {"x": SECRET}, "extensions": {"x": SECRET}}),
            id="a refused mutation with variables and extensions",
        ),
        pytest.param(
            gql({"query": f'mutation {{ deleteRepository(id: "{SECRET}") {{ id }} }}'}),
            id="a refused mutation with an argument",
        ),
        pytest.param(
            gql({"query": f'{{ viewer(x: "{SECRET}" }}'}), id="a document that does not parse"
        ),
        pytest.param(
            mcp(call("tools/call", {"name": "delete_repo", "arguments": {"token": SECRET}})),
            id="a refused tool call",
        ),
        pytest.param(
            mcp(call("tools/call", {"name": "search", "arguments": {"token": SECRET}})),
            id="an allowed tool call",
        ),
        pytest.param(rpc(call("eth_sign", [SECRET])), id="a refused JSON-RPC call"),
        pytest.param(
            get("query=" + quote("{ viewer { id } }") + "&variables=" + quote(json.dumps(SECRET))),
            id="GET variables",
        ),
    ],
)
def test_values_never_reach_detail_or_summary(decision: BodyDecision) -> None:
    assert SECRET not in decision.detail
    assert SECRET not in json.dumps(decision.summary)


def test_names_are_capped_and_printable() -> None:
    found = mcp(tool("a\x1b[31m\u202e" + "x" * 10_000))
    assert found.reason is TOOL
    shown = found.summary["mcp"][0]["tool"]
    assert shown.startswith("a[31mx") and len(shown) <= bodies.MAX_NAME + 3
    assert "\x1b" not in found.detail and "\u202e" not in found.detail
    assert len(found.detail) < 200


def test_summary_lists_are_capped() -> None:
    many = gql([{"query": "{ viewer { id } }"}] * 50)
    assert many.allowed
    assert len(many.summary["graphql"]) == bodies.MAX_LISTED
    assert many.summary["omitted"] == 50 - bodies.MAX_LISTED
    fields = (
        " ".join(f"f{i}: viewer" for i in range(5)) + " " + " ".join(f"g{i}" for i in range(40))
    )
    wide = gql({"query": "{ " + fields + " }"})
    assert len(wide.summary["graphql"][0]["fields"]) == bodies.MAX_LISTED


def test_new_reasons_have_their_statuses() -> None:
    assert STATUS[Reason.BODY_UNDECIDABLE] == 400
    for reason in (OPERATION, TOOL, METHOD):
        assert STATUS.get(reason, 403) == 403


@pytest.mark.parametrize(
    ("decision", "detail"),
    [
        pytest.param(
            gql([{"query": "{ viewer { id } }"}, "{ viewer { id } }"]),
            "every GraphQL request must be a JSON object",
            id="a batch element that is no object",
        ),
        pytest.param(
            gql({"query": {"a": "{ viewer { id } }"}}),
            "a GraphQL request member has the wrong type",
            id="a query that is an object",
        ),
        pytest.param(
            gql(persisted(1), rule=PERSISTED),
            "a persisted query without a sha256Hash",
            id="a hash that is a number",
        ),
        pytest.param(
            rpc({"jsonrpc": "2.0", "id": 1, "method": ["eth_call"]}),
            "a JSON-RPC request's method must be a string",
            id="a method that is a list",
        ),
        pytest.param(
            mcp(tool(["search"])), "params.name must be a string", id="a tool name that is a list"
        ),
        pytest.param(
            gql(
                b'{"query": "{ viewer { id } }", "variables": '
                + b"[" * 100_000
                + b"]" * 100_000
                + b"}"
            ),
            "the body is nested too deeply",
            id="nesting beyond the recursion limit",
        ),
    ],
)
def test_undecidable_bodies_say_why(decision: BodyDecision, detail: str) -> None:
    """The wrapper would refuse these anyway; the checks name the reason."""
    assert (decision.reason, decision.detail) == (UNDECIDABLE, detail)


def test_a_kept_analysis_is_decided_again_for_each_grant_and_name() -> None:
    document = "query A { organization { id } } query B { viewer { id } }"
    assert gql({"query": document, "operationName": "A"}).allowed
    assert gql({"query": document, "operationName": "A"}, rule=READ_ONLY).reason is OPERATION
    assert gql({"query": document}).reason is UNDECIDABLE
    assert gql({"query": document, "operationName": "C"}).reason is UNDECIDABLE


# -- found by the hostile review (its end-to-end module runs with -m slow) ---------------------


@pytest.mark.parametrize(
    "document",
    [
        'mutation { addComment(body: "x") { query { __schema { types { name } } } } }',
        'mutation { addComment(body: "x") { ...P } } '
        'fragment P on Payload { query { __type(name: "M") { name } } }',
    ],
    ids=["below a payload", "through a fragment"],
)
def test_introspection_is_refused_at_any_depth_unless_granted(document: str) -> None:
    refused = gql({"query": document}, rule=parse("graphql", {"mutation": ["addComment"]}))
    assert (refused.allowed, refused.reason) == (False, OPERATION)
    granted = gql({"query": document}, rule=INTROSPECTION)
    assert granted.allowed


def test_a_document_of_many_operations_is_refused_before_its_fragments_are_walked() -> None:
    """4,000 operations spreading one 25,000-field fragment held the event loop for seconds."""
    fragment = "fragment F on Query { " + " ".join(["viewer"] * 25000) + " }"
    operations = " ".join(f"query Q{i} {{ ...F }}" for i in range(4000))
    decision = gql({"query": operations + " " + fragment, "operationName": "Q0"})
    assert (decision.allowed, decision.reason) == (False, UNDECIDABLE)
    assert "at most 32 operations" in decision.detail


def test_a_fragment_spread_by_every_operation_is_walked_once() -> None:
    """32 operations spreading a fragment of 10,000 distinct fields: each fragment's fields
    are found once for the document (without it, this walks 320,000 fields)."""
    fields = " ".join(f"f{i}" for i in range(10000))
    operations = " ".join(f"query Q{i} {{ ...F }}" for i in range(32))
    document = f"{operations} fragment F on Query {{ {fields} }}"
    decision = gql({"query": document, "operationName": "Q0"})
    assert decision.allowed
    assert len(decision.summary["graphql"]) == 20  # capped, one entry per operation


# -- the limits table's bounds, each at its edge (docs/configuration.md#limits) ------------


def _operations(n: int) -> dict[str, Any]:
    document = " ".join(f"query Q{i} {{ viewer {{ id }} }}" for i in range(n))
    return {"query": document, "operationName": "Q0"}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(_operations(bodies.MAX_OPERATIONS), ALLOWED, id="32 operations pass"),
        pytest.param(_operations(bodies.MAX_OPERATIONS + 1), UNDECIDABLE, id="33 are refused"),
        pytest.param([{"query": "{ viewer { id } }"}] * MAX_BATCH, ALLOWED, id="a batch of 100"),
        pytest.param(
            [{"query": "{ viewer { id } }"}] * (MAX_BATCH + 1), UNDECIDABLE, id="a batch of 101"
        ),
        pytest.param(
            {"query": "{ viewer { id } }" + " #\n" * (bodies.MAX_TOKENS - 10)},
            ALLOWED,
            id="under 50,000 tokens",
        ),
    ],
)
def test_the_body_bounds_at_their_edges(body: Any, expected: Reason | None) -> None:
    assert (bodies.MAX_OPERATIONS, MAX_BATCH, bodies.MAX_TOKENS) == (32, 100, 50_000)
    assert gql(body).reason is expected


def test_a_rule_list_holds_256_names_of_200_characters() -> None:
    from store.errors import InvalidInput
    from store.rules.bodyrules import MAX_NAME, MAX_NAMES

    assert (MAX_NAMES, MAX_NAME) == (256, 200)
    names = [f"f{i}".ljust(200, "x") for i in range(256)]
    parse("graphql", {"mutation": names})
    parse("mcp", {"tools": names})
    with pytest.raises(InvalidInput):
        parse("graphql", {"mutation": [*names, "one_more"]})
    with pytest.raises(InvalidInput):
        parse("mcp", {"tools": ["t" * 201]})
    with pytest.raises(InvalidInput):
        parse("graphql", {"mutation": ["f" * 201]})
