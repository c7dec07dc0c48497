"""MCP through the proxy with the official SDK on both ends: a FastMCP server over streamable
HTTP (uvicorn, TLS on 127.0.0.1) and the SDK's client, configured only with the proxy URL and
the proxy's CA, as an agent's would be.

Nothing is mocked. Both answer shapes are exercised: SSE (the SDK's default) and JSON
(`json_response=True`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
import uvicorn
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from mcp.server.fastmcp import FastMCP
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import McpError

from store.crypto import Secret
from store.rules import bodyrules
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy

pytestmark = [
    pytest.mark.e2e,
    # 1.9, the oldest SDK the test extra allows, has only the old name.
    pytest.mark.filterwarnings("ignore:Use `streamable_http_client`:DeprecationWarning"),
]

SECRET = b"mcp-e2e-bearer-secret"
HOSTS = {"sse": "mcp.test", "json": "mcpjson.test"}


def _server(json_response: bool) -> FastMCP:
    server = FastMCP(
        "e2e",
        json_response=json_response,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )

    @server.tool()
    def search_issues(query: str) -> str:
        return f"found: {query}"

    @server.tool()
    def delete_repository(name: str) -> str:
        return f"deleted {name}"

    @server.tool()
    def list_secrets() -> str:
        return "nothing"

    return server


class _Running:
    def __init__(self, app, ca: trustme.CA, host: str, tmp: Path) -> None:
        cert = ca.issue_cert(host)
        certfile, keyfile = tmp / f"{host}.pem", tmp / f"{host}.key"
        cert.cert_chain_pems[0].write_to_path(str(certfile))
        cert.private_key_pem.write_to_path(str(keyfile))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app, ssl_certfile=str(certfile), ssl_keyfile=str(keyfile), log_level="error"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> _Running:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture(scope="module")
def mcp_proxy(
    tmp_path_factory: pytest.TempPathFactory, upstream_ca: trustme.CA, initialised_home: Path
) -> Iterator[Proxy]:
    tmp = tmp_path_factory.mktemp("mcp")
    sse_app = _server(json_response=False).streamable_http_app()
    json_app = _server(json_response=True).streamable_http_app()
    with (
        _Running(sse_app, upstream_ca, HOSTS["sse"], tmp) as sse,
        _Running(json_app, upstream_ca, HOSTS["json"], tmp) as js,
    ):
        resolve = [f"{HOSTS['sse']}=127.0.0.1:{sse.port}", f"{HOSTS['json']}=127.0.0.1:{js.port}"]
        running = start_proxy(tmp / "home", upstream_ca, resolve, template=initialised_home)
        yield running
        stop_proxy(running)


def _grant(proxy: Proxy, names, host: str, tools: list[str]) -> tuple[str, str]:
    agent, cred = names("mcp"), names("mcpcred")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", [host], Secret(SECRET))
    proxy.store.add_grant(
        agent,
        ["GET", "POST", "DELETE"],
        credential=cred,
        paths=["/mcp"],
        body=bodyrules.parse("mcp", {"tools": tools}),
    )
    proxy.wait_reload()
    return agent, token


async def _session_run(proxy: Proxy, agent: str, token: str, host: str, calls):
    context = ssl.create_default_context(cafile=str(proxy.ca_file))

    def factory(headers=None, timeout=None, auth=None) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            proxy=proxy.url(agent, token),
            verify=context,
            headers=headers,
            timeout=timeout or httpx.Timeout(30),
            auth=auth,
        )

    async with (
        streamablehttp_client(f"https://{host}/mcp", httpx_client_factory=factory) as (r, w, _),
        ClientSession(r, w) as session,
    ):
        await session.initialize()
        return await calls(session)


@pytest.mark.parametrize("shape", ["sse", "json"])
def test_the_sdk_client_sees_and_calls_only_the_granted_tools(mcp_proxy: Proxy, names, shape):
    host = HOSTS[shape]
    agent, token = _grant(mcp_proxy, names, host, ["search_issues"])

    async def calls(session: ClientSession):
        listed = await session.list_tools()
        found = await session.call_tool("search_issues", {"query": "bug"})
        return [t.name for t in listed.tools], found

    async def forbidden(session: ClientSession):
        return await session.call_tool("delete_repository", {"name": "widgets"})

    tools, found = asyncio.run(_session_run(mcp_proxy, agent, token, host, calls))
    assert tools == ["search_issues"]  # delete_repository and list_secrets are not shown
    assert found.content[0].text == "found: bug"
    # The SDK ends the session on the proxy's 403 (an HTTP error, raised from its task group).
    with pytest.raises((McpError, httpx.HTTPStatusError, BaseExceptionGroup)):
        asyncio.run(_session_run(mcp_proxy, agent, token, host, forbidden))
    lines = [line for line in mcp_proxy.requests(agent) if line.get("reason")]
    assert [(line["reason"], line["body"]) for line in lines] == [
        ("tool-not-allowed", {"mcp": [{"method": "tools/call", "tool": "delete_repository"}]})
    ]
    assert SECRET.decode() not in mcp_proxy.output()


def test_a_tools_call_hidden_in_a_batch_is_refused(mcp_proxy: Proxy, names):
    host = HOSTS["json"]
    agent, token = _grant(mcp_proxy, names, host, ["search_issues"])
    batch = [
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "search_issues"}},
        {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "delete_repository"},
        },
    ]
    with mcp_proxy.client(agent, token) as client:
        refused = client.post(
            f"https://{host}/mcp",
            json=batch,
            headers={"accept": "application/json, text/event-stream"},
        )
    assert refused.status_code == 403
    assert refused.headers["x-credproxy-reason"] == "tool-not-allowed"
