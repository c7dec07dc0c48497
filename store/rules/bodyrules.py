"""What a grant may ask in the request's body: GraphQL operations, MCP tools, JSON-RPC methods.

A grant with a body rule is decided on the body as well as on host, method and path. The rule
is one of three kinds; the store keeps it as canonical JSON (`to_json`), policy files and the
CLI write it through `parse` (a mapping as in a policy file) so every path validates the same.

    graphql = { query = "*", mutation = ["addComment"], introspection = false,
                persisted = ["<sha256 hex>"] }
    mcp     = { tools = ["search_issues"], resources = ["repo://acme/"], prompts = ["triage"] }
    jsonrpc = { methods = ["eth_call", "eth_getBalance"] }

Pure: the request side (parsing a body, deciding it) is addon.core.bodies.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from store.errors import InvalidInput

KINDS = ("graphql", "mcp", "jsonrpc")
OPERATION_TYPES = ("query", "mutation", "subscription")
ANY = "*"
MAX_NAMES = 256  # per list: a rule is read on every request it decides
MAX_NAME = 200
# A GraphQL field / MCP tool or prompt / JSON-RPC method name: printable ASCII, no spaces.
_NAME = re.compile(r"[!-~]{1,200}")
_GRAPHQL_NAME = re.compile(r"[_A-Za-z][_0-9A-Za-z]{0,199}")  # GraphQL's own Name grammar
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class GraphQLRule:
    """Per operation type, the top-level fields allowed (None: any field); types absent are
    refused. Introspection (__schema, __type) only when `introspection`. A persisted query
    sent as a hash alone passes only if its hash is listed."""

    operations: Mapping[str, frozenset[str] | None]
    introspection: bool = False
    persisted: frozenset[str] = frozenset()


@dataclass(frozen=True)
class McpRule:
    """tools/call by tool name, resources/read (and subscribe) by URI prefix, prompts/get by
    name. The lifecycle and listing methods pass; any other method is refused."""

    tools: frozenset[str] = frozenset()
    resources: tuple[str, ...] = ()
    prompts: frozenset[str] = frozenset()


@dataclass(frozen=True)
class JsonRpcRule:
    methods: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class BodyRule:
    """Exactly one of the three kinds."""

    kind: str
    graphql: GraphQLRule | None = None
    mcp: McpRule | None = None
    jsonrpc: JsonRpcRule | None = None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        """As a policy file writes it: {kind: {...}}."""
        if self.graphql is not None:
            g = self.graphql
            out: dict[str, Any] = {
                t: ANY if fields is None else sorted(fields) for t, fields in g.operations.items()
            }
            if g.introspection:
                out["introspection"] = True
            if g.persisted:
                out["persisted"] = sorted(g.persisted)
            return {"graphql": out}
        if self.mcp is not None:
            m = self.mcp
            mcp: dict[str, Any] = {}
            if m.tools:
                mcp["tools"] = sorted(m.tools)
            if m.resources:
                mcp["resources"] = list(m.resources)
            if m.prompts:
                mcp["prompts"] = sorted(m.prompts)
            return {"mcp": mcp}
        assert self.jsonrpc is not None
        return {"jsonrpc": {"methods": sorted(self.jsonrpc.methods)}}

    def describe(self) -> str:
        """One short line for `grant list` and approvals: what the body may ask."""
        if self.graphql is not None:
            parts = []
            for t, fields in sorted(self.graphql.operations.items()):
                parts.append(t if fields is None else f"{t}({','.join(sorted(fields))})")
            if self.graphql.introspection:
                parts.append("introspection")
            if self.graphql.persisted:
                parts.append(f"{len(self.graphql.persisted)} persisted")
            return "graphql " + " ".join(parts)
        if self.mcp is not None:
            m = self.mcp
            parts = [f"tools({','.join(sorted(m.tools))})"] if m.tools else []
            if m.resources:
                parts.append(f"resources({','.join(m.resources)})")
            if m.prompts:
                parts.append(f"prompts({','.join(sorted(m.prompts))})")
            return "mcp " + (" ".join(parts) or "lifecycle only")
        assert self.jsonrpc is not None
        return "jsonrpc " + ",".join(sorted(self.jsonrpc.methods))


def from_json(text: str | None) -> BodyRule | None:
    """The stored column back to a rule (validated again: a hand-edited row is refused)."""
    if text is None:
        return None
    try:
        found = json.loads(text)
    except ValueError as e:
        raise InvalidInput("a grant's body rule is not valid JSON") from e
    if not isinstance(found, dict) or len(found) != 1:
        raise InvalidInput("a grant's body rule must name one kind")
    [(kind, spec)] = found.items()
    return parse(kind, spec)


def parse(kind: str, spec: Any) -> BodyRule:
    """A body rule from a policy file's (or the CLI's) mapping. Raises InvalidInput."""
    if kind not in KINDS:
        raise InvalidInput(f"unknown body rule {kind!r}: use one of {', '.join(KINDS)}")
    if not isinstance(spec, Mapping):
        raise InvalidInput(f"{kind} must be a table")
    if kind == "graphql":
        return BodyRule(kind, graphql=_graphql(spec))
    if kind == "mcp":
        return BodyRule(kind, mcp=_mcp(spec))
    return BodyRule(kind, jsonrpc=_jsonrpc(spec))


def _graphql(spec: Mapping[str, Any]) -> GraphQLRule:
    unknown = set(spec) - {*OPERATION_TYPES, "introspection", "persisted"}
    if unknown:
        raise InvalidInput(
            f"graphql: unknown key {sorted(unknown)[0]!r}: use query, mutation, subscription, "
            "introspection, persisted"
        )
    operations: dict[str, frozenset[str] | None] = {}
    for t in OPERATION_TYPES:
        if t not in spec:
            continue
        value = spec[t]
        if value == ANY:
            operations[t] = None
        else:
            operations[t] = _names(f"graphql.{t}", value, _GRAPHQL_NAME, "a GraphQL field name")
            if any(name.startswith("__") for name in operations[t] or ()):
                raise InvalidInput(
                    f"graphql.{t}: introspection fields are allowed with introspection = true"
                )
    introspection = spec.get("introspection", False)
    if not isinstance(introspection, bool):
        raise InvalidInput("graphql.introspection must be true or false")
    persisted = _names("graphql.persisted", spec.get("persisted", []), _SHA256, "a SHA-256 hex")
    if not operations and not introspection and not persisted:
        raise InvalidInput(
            "graphql: name at least one operation type (query, mutation, subscription)"
        )
    return GraphQLRule(operations, introspection, persisted)


def _mcp(spec: Mapping[str, Any]) -> McpRule:
    unknown = set(spec) - {"tools", "resources", "prompts"}
    if unknown:
        raise InvalidInput(
            f"mcp: unknown key {sorted(unknown)[0]!r}: use tools, resources, prompts"
        )
    tools = _names("mcp.tools", spec.get("tools", []), _NAME, "a tool name")
    prompts = _names("mcp.prompts", spec.get("prompts", []), _NAME, "a prompt name")
    resources = spec.get("resources", [])
    if not isinstance(resources, list) or len(resources) > MAX_NAMES:
        raise InvalidInput(f"mcp.resources must be a list of at most {MAX_NAMES} URI prefixes")
    for prefix in resources:
        if not isinstance(prefix, str) or not _NAME.fullmatch(prefix) or ":" not in prefix:
            raise InvalidInput(
                f"mcp.resources: {prefix!r} is not a URI prefix (scheme:..., printable, no spaces)"
            )
    return McpRule(tools, tuple(sorted(set(resources))), prompts)


def _jsonrpc(spec: Mapping[str, Any]) -> JsonRpcRule:
    unknown = set(spec) - {"methods"}
    if unknown:
        raise InvalidInput(f"jsonrpc: unknown key {sorted(unknown)[0]!r}: use methods")
    methods = _names("jsonrpc.methods", spec.get("methods", []), _NAME, "a method name")
    if not methods:
        raise InvalidInput("jsonrpc: name at least one method")
    return JsonRpcRule(methods)


def _names(where: str, value: Any, pattern: re.Pattern[str], what: str) -> frozenset[str]:
    if not isinstance(value, list) or len(value) > MAX_NAMES:
        raise InvalidInput(f'{where} must be a list of at most {MAX_NAMES} names (or "*")')
    for name in value:
        if not isinstance(name, str) or not pattern.fullmatch(name):
            raise InvalidInput(f"{where}: {name!r} is not {what}")
    return frozenset(value)


def describe(body: str | None) -> str | None:
    """A stored body rule as `grant list` shows it."""
    if body is None:
        return None
    try:
        found = from_json(body)
    except InvalidInput:
        return "unreadable (the grant is not served)"
    return None if found is None else found.describe()


def describe_for_file(body: str | None) -> str | None:
    """A stored body rule as a policy file's line (`graphql = { ... }`), for `export`."""
    if body is None:
        return None
    rule = from_json(body)
    assert rule is not None
    [(kind, spec)] = rule.to_dict().items()
    return f"{kind} = {_inline(spec)}"


def _inline(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    assert isinstance(value, dict)
    return "{ " + ", ".join(f"{k} = {_inline(v)}" for k, v in value.items()) + " }"
