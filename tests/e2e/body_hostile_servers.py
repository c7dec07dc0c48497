"""Upstreams for tests/e2e/test_body_hostile.py: a GraphQL server that executes what it gets
(graphql-core) and records the root mutation fields it ran, a small JSON-RPC 2.0 server that
records the methods it ran, a FastMCP server (the official SDK) whose tools, resources and
prompts record their calls, and raw HTTP/1 and HTTP/2 clients through a proxy tunnel."""

from __future__ import annotations

import json
import ssl
import threading
from typing import Any
from urllib.parse import parse_qs, urlsplit

from graphql import build_schema, graphql_sync
from mcp.server.fastmcp import FastMCP
from mcp.server.transport_security import TransportSecuritySettings

from tests.e2e import raw
from tests.e2e.upstream import Answer, Received

# -- GraphQL ---------------------------------------------------------------------------------

SCHEMA = build_schema(
    """
    type Query { viewer: String, issues: [String], secretNotes: String }
    type Mutation {
      addComment(body: String): CommentPayload
      deleteRepository(name: String): String
    }
    # Relay's pattern: a mutation payload can lead back to the query root.
    type CommentPayload { body: String, query: Query }
    """
)


class Executed:
    """What the upstream really ran: root mutation fields, JSON-RPC methods, MCP calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[str] = []

    def add(self, name: str) -> None:
        with self.lock:
            self.items.append(name)

    def clear(self) -> None:
        with self.lock:
            self.items.clear()

    def __contains__(self, name: object) -> bool:
        with self.lock:
            return name in self.items

    def snapshot(self) -> list[str]:
        with self.lock:
            return list(self.items)


EXECUTED = Executed()


def _root() -> dict[str, Any]:
    root: dict[str, Any] = {"viewer": "octocat", "issues": ["#1"], "secretNotes": "notes"}

    def add_comment(info: Any, **kw: Any) -> dict[str, Any]:
        EXECUTED.add("addComment")
        return {"body": kw.get("body"), "query": root}

    def delete_repository(info: Any, **kw: Any) -> str:
        EXECUTED.add("deleteRepository")
        return "deleted"

    root["addComment"] = add_comment
    root["deleteRepository"] = delete_repository
    return root


ROOT = _root()


def _graphql_requests(received: Received) -> tuple[list[dict[str, Any]], bool] | None:
    query = urlsplit(received.target).query
    if received.method == "GET" or (received.method == "POST" and "query=" in query):
        params = {k: v[0] for k, v in parse_qs(query).items()}
        if "variables" in params:
            params["variables"] = json.loads(params["variables"])
        return [params], False
    ctype = next(iter(received.header("content-type")), "")
    if ctype.startswith("application/graphql"):
        return [{"query": received.body.decode()}], False
    found = json.loads(received.body)
    return (found, True) if isinstance(found, list) else ([found], False)


def graphql_app(received: Received) -> Answer | None:
    """Executes the documents it receives, as a GraphQL server would."""
    if received.target.startswith("/rpc"):
        return jsonrpc_app(received)
    if not received.target.startswith("/graphql"):
        return None
    try:
        parsed = _graphql_requests(received)
    except (ValueError, KeyError):
        return 400, [], b"bad request"
    assert parsed is not None
    requests, batched = parsed
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
    body = json.dumps(results if batched else results[0]).encode()
    return 200, [("content-type", "application/json")], body


# -- JSON-RPC --------------------------------------------------------------------------------

RPC_METHODS = {
    "eth_call": lambda params: "0x",
    "eth_getBalance": lambda params: "0x10",
    "admin_addPeer": lambda params: True,
}


def _rpc_one(message: Any) -> dict[str, Any] | None:
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        return {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "invalid"}}
    method = message.get("method")
    if method not in RPC_METHODS:
        return {"jsonrpc": "2.0", "id": message.get("id"), "error": {"code": -32601}}
    EXECUTED.add(f"rpc:{method}")
    result = RPC_METHODS[method](message.get("params"))
    if "id" not in message:
        return None
    return {"jsonrpc": "2.0", "id": message["id"], "result": result}


def jsonrpc_app(received: Received) -> Answer:
    try:
        found = json.loads(received.body)
    except ValueError:
        return 400, [], b"bad request"
    if isinstance(found, list):
        answers = [a for a in (_rpc_one(m) for m in found) if a is not None]
        body = json.dumps(answers).encode()
    else:
        answer = _rpc_one(found)
        body = json.dumps(answer).encode() if answer is not None else b""
    return 200, [("content-type", "application/json")], body


# -- MCP -------------------------------------------------------------------------------------


def mcp_server(json_response: bool) -> FastMCP:
    server = FastMCP(
        "hostile",
        json_response=json_response,
        stateless_http=True,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )

    @server.tool()
    def search_issues(query: str) -> str:
        EXECUTED.add("mcp:search_issues")
        return f"found: {query}"

    @server.tool()
    def delete_repository(name: str) -> str:
        EXECUTED.add("mcp:delete_repository")
        return f"deleted {name}"

    @server.resource("repo://acme/{name}")
    def acme(name: str) -> str:
        EXECUTED.add(f"mcp:repo://acme/{name}")
        return f"acme {name}"

    @server.resource("repo://acmecorp/{name}")
    def acmecorp(name: str) -> str:
        EXECUTED.add(f"mcp:repo://acmecorp/{name}")
        return f"acmecorp {name}"

    @server.resource("secret://vault/{name}")
    def vault(name: str) -> str:
        EXECUTED.add(f"mcp:secret://vault/{name}")
        return f"vault {name}"

    @server.prompt()
    def triage(issue: str) -> str:
        EXECUTED.add("mcp:prompt:triage")
        return f"triage {issue}"

    @server.prompt()
    def exfiltrate(target: str) -> str:
        EXECUTED.add("mcp:prompt:exfiltrate")
        return f"exfiltrate {target}"

    return server


# -- clients ---------------------------------------------------------------------------------


def raw_exchange(proxy: Any, who: tuple[str, str], host: str, data: bytes) -> raw.Reply:
    """One raw HTTP/1.1 request (bytes as given) through a fresh CONNECT tunnel."""
    tls = raw.tunnel(proxy.port, f"{host}:443", raw.proxy_auth(*who), host, proxy.ca_file)
    with tls:
        tls.settimeout(20)
        return raw.exchange(tls, data)


def h2_request(
    proxy: Any,
    who: tuple[str, str],
    host: str,
    fields: list[tuple[str, str]],
    body: bytes,
    chunk: int = 16384,
) -> raw.Answer:
    """One HTTP/2 request with a body, sent in DATA frames of `chunk` bytes; read to its end."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    answer = raw.Answer("HTTP/2", None, {}, b"")
    with raw.h2_tunnel(proxy, raw.proxy_auth(*who), host) as tls:
        tls.settimeout(20)
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(validate_outbound_headers=False)
        )
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**24})
        conn.send_headers(1, fields, end_stream=not body)
        tls.sendall(conn.data_to_send())
        pending = body
        while True:
            while pending and conn.local_flow_control_window(1) > 0:
                size = min(chunk, len(pending), conn.local_flow_control_window(1))
                size = min(size, conn.max_outbound_frame_size)
                part, pending = pending[:size], pending[size:]
                conn.send_data(1, part, end_stream=not pending)
            tls.sendall(conn.data_to_send())
            try:
                data = tls.recv(65536)
            except (ssl.SSLError, OSError):
                answer.broken = True
                return answer
            if not data:
                answer.broken = True
                return answer
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    answer.headers = {k.decode(): v.decode() for k, v in event.headers}
                    answer.status = int(answer.headers[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    answer.body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id == 1:
                    return answer
                elif isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                    answer.broken = answer.status is None
                    return answer
