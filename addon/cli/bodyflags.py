"""`grant add`'s flags for what the request's body may ask (store.rules.bodyrules)."""

from __future__ import annotations

import argparse
from typing import Any

from store.errors import InvalidInput
from store.rules import bodyrules
from store.rules.bodyrules import BodyRule


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "what the body may ask (decided on the request's body; one kind per grant)"
    )
    g.add_argument(
        "--graphql",
        action="append",
        default=[],
        metavar="TYPE[:FIELD,...]",
        help="a GraphQL operation type allowed (query, mutation, subscription), optionally "
        "with its top-level fields only, e.g. mutation:addComment,createIssue (repeatable)",
    )
    g.add_argument(
        "--graphql-introspection",
        action="store_true",
        help="allow __schema and __type queries",
    )
    g.add_argument(
        "--graphql-persisted",
        action="append",
        default=[],
        metavar="SHA256",
        help="a persisted query's hash allowed without its document (repeatable)",
    )
    g.add_argument(
        "--mcp-tool", action="append", default=[], metavar="NAME", help="an MCP tool (repeatable)"
    )
    g.add_argument(
        "--mcp-resource",
        action="append",
        default=[],
        metavar="URI-PREFIX",
        help="MCP resources read under this URI prefix (repeatable)",
    )
    g.add_argument(
        "--mcp-prompt", action="append", default=[], metavar="NAME", help="an MCP prompt"
    )
    g.add_argument(
        "--mcp",
        action="store_true",
        help="an MCP server's lifecycle and listings only (with no --mcp-tool)",
    )
    g.add_argument(
        "--jsonrpc-method",
        action="append",
        default=[],
        metavar="NAME",
        help="a JSON-RPC method allowed (repeatable)",
    )


def rule_from(args: argparse.Namespace) -> BodyRule | None:
    """The body rule the flags describe, or None. Raises InvalidInput."""
    graphql = args.graphql or args.graphql_introspection or args.graphql_persisted
    mcp = args.mcp or args.mcp_tool or args.mcp_resource or args.mcp_prompt
    jsonrpc = args.jsonrpc_method
    given = [kind for kind, on in (("graphql", graphql), ("mcp", mcp), ("jsonrpc", jsonrpc)) if on]
    if len(given) > 1:
        raise InvalidInput(
            f"a grant decides one kind of body: give the flags of {' or '.join(given)}, not both"
        )
    if not given:
        return None
    spec: dict[str, Any]
    if graphql:
        spec = {}
        for item in args.graphql:
            kind, colon, fields = item.partition(":")
            if kind in spec:
                raise InvalidInput(f"--graphql {kind} is given twice: list its fields once")
            spec[kind] = [f for f in fields.split(",") if f] if colon else "*"
            if colon and not spec[kind]:
                raise InvalidInput(f"--graphql {item}: name fields after ':', or drop the ':'")
        if args.graphql_introspection:
            spec["introspection"] = True
        if args.graphql_persisted:
            spec["persisted"] = [h.lower() for h in args.graphql_persisted]
        for key in spec:
            if key not in (*bodyrules.OPERATION_TYPES, "introspection", "persisted"):
                raise InvalidInput(
                    f"--graphql {key}: use query, mutation or subscription, optionally "
                    "with :FIELD,FIELD"
                )
        return bodyrules.parse("graphql", spec)
    if mcp:
        spec = {"tools": args.mcp_tool, "resources": args.mcp_resource}
        spec["prompts"] = args.mcp_prompt
        return bodyrules.parse("mcp", spec)
    return bodyrules.parse("jsonrpc", {"methods": jsonrpc})
