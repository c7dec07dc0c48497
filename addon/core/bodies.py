"""A grant's body rule decided on the request's exact bytes: GraphQL operations, MCP calls,
JSON-RPC methods.

Pure: imports neither mitmproxy nor SQLAlchemy. What cannot be read with certainty (an
encoding, a charset, a duplicate key, a document that does not parse, an ambiguous operation)
is refused as body-undecidable, never guessed; any other exception is refused the same way.
Details and summaries name operations, fields, tools and methods, never arguments, variables,
extensions or values.

One module, about 600 lines: the three kinds share strict JSON, the batch and envelope rules
and the refusal wording; split, a check would live apart from the table that tests it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes

from addon.core.reasons import Reason
from store.rules.bodyrules import BodyRule, GraphQLRule, JsonRpcRule, McpRule

if TYPE_CHECKING:
    from graphql import (
        FieldNode,
        FragmentDefinitionNode,
        FragmentSpreadNode,
        GraphQLError,
        InlineFragmentNode,
        OperationDefinitionNode,
        SelectionSetNode,
        parse,
    )

MAX_DECIDED_BODY = 1024 * 1024  # bytes; the caller stops reading past it
MAX_BATCH = 100
# Operations in one document: each is decided, and real clients send one (a few at most).
MAX_OPERATIONS = 32
INTROSPECTION_FIELDS = frozenset({"__schema", "__type"})
MAX_TOKENS = 50_000  # GraphQL tokens and comments: parsing is linear, this bounds it
MAX_CACHED_DOCUMENT = 16 * 1024  # characters: 512 kept documents hold at most 8 MiB
MAX_LISTED = 20  # entries per summary list
MAX_NAME = 100  # characters of a name in a detail or summary

MCP_PASSING = frozenset(
    {
        "initialize",
        "ping",
        "tools/list",
        "resources/list",
        "resources/templates/list",
        "prompts/list",
        "logging/setLevel",
        "completion/complete",
    }
)
MCP_RESOURCE_METHODS = frozenset({"resources/read", "resources/subscribe", "resources/unsubscribe"})
GRAPHQL_PARAMETERS = ("query", "operationName", "variables", "extensions")
_GRAPHQL_KEYS = frozenset(GRAPHQL_PARAMETERS)
_QUERY_STRING_PREFIXES = tuple(p.casefold() for p in GRAPHQL_PARAMETERS)
_REQUEST_KEYS = frozenset({"jsonrpc", "id", "method", "params"})
_RESPONSE_KEYS = frozenset({"jsonrpc", "id", "result", "error"})

_TCHARS = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_PARAMETER_TEXT = rf"[ \t]*;[ \t]*({_TCHARS})=({_TCHARS}|\"(?:[^\"\\]|\\.)*\")"
_MEDIA_TYPE = re.compile(rf"[ \t]*({_TCHARS}/{_TCHARS})((?:{_PARAMETER_TEXT})*)[ \t]*")
_PARAMETER = re.compile(_PARAMETER_TEXT)
_SEPARATORS = re.compile(rb"[&;]")
_BAD_PERCENT = re.compile(rb"%(?![0-9A-Fa-f]{2})")
# What a server may read as `.`/`..`/`/` or map there by normalisation: a resource URI holding
# any of it could leave its granted prefix, so it is refused rather than resolved here.
_URI_UNSAFE = re.compile(r"[^!-~]|%|\\|(?:^|/)\.{1,2}(?:[/;?#]|$)")


@dataclass(frozen=True)
class BodyDecision:
    allowed: bool
    reason: Reason | None  # None when allowed
    detail: str  # one line for the agent: names, never values
    summary: dict[str, Any]  # for the audit line and approvals: names, never values


class _Refused(Exception):
    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _undecidable(detail: str) -> _Refused:
    return _Refused(Reason.BODY_UNDECIDABLE, detail)


def decide(
    rule: BodyRule,
    method: str,
    target: bytes,
    content_type: str | None,
    content_encoding: str | None,
    body: bytes,
) -> BodyDecision:
    """Allowed only if all the body (for a GraphQL GET, the target) asks is granted."""
    found: list[Any] = []
    try:
        if len(body) > MAX_DECIDED_BODY:
            raise _Refused(
                Reason.BODY_TOO_LARGE,
                f"a body its grant decides is limited to {MAX_DECIDED_BODY} bytes",
            )
        if content_encoding is not None and content_encoding.strip().lower() != "identity":
            raise _undecidable("a request body with a Content-Encoding cannot be decided")
        if rule.graphql is not None:
            _graphql(rule.graphql, method, target, content_type, body, found)
        elif rule.mcp is not None:
            _mcp(rule.mcp, method, content_type, body, found)
        elif rule.jsonrpc is not None:
            _jsonrpc(rule.jsonrpc, method, content_type, body, found)
        else:
            raise _undecidable("the grant's body rule names no kind")
    except _Refused as e:
        reason, detail = e.reason, e.detail
    except RecursionError:
        reason, detail = Reason.BODY_UNDECIDABLE, "the body is nested too deeply"
    except Exception:  # noqa: BLE001 - the fail-closed wrapper: whatever breaks is a refusal
        reason, detail = Reason.BODY_UNDECIDABLE, "the body could not be decided"
    else:
        return BodyDecision(True, None, "", _summary(rule.kind, found))
    return BodyDecision(False, reason, detail, _summary(rule.kind, found))


def _summary(kind: str, found: list[Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {kind: found[:MAX_LISTED]}
    if len(found) > MAX_LISTED:
        summary["omitted"] = len(found) - MAX_LISTED
    return summary


def _name(value: str) -> str:
    """A name as shown: printable, at most MAX_NAME characters."""
    shown = "".join(c for c in value[: MAX_NAME + 1] if c.isprintable())
    return shown if len(shown) <= MAX_NAME else shown[:MAX_NAME] + "..."


# Decoding: strict, or refused.


def _media_type(content_type: str | None) -> str:
    """The lower-case type/subtype; any charset but UTF-8 is refused."""
    match = _MEDIA_TYPE.fullmatch(content_type or "")
    if match is None:
        raise _undecidable("the request's Content-Type cannot be read")
    charsets = [
        value.strip('"').lower()
        for name, value in _PARAMETER.findall(match.group(2))
        if name.lower() == "charset"
    ]
    if charsets not in ([], ["utf-8"]):
        raise _undecidable("a body decided by its grant must be UTF-8")
    return match.group(1).lower()


def _utf8(body: bytes) -> str:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise _undecidable("the body is not UTF-8") from None
    if text.startswith("\ufeff"):
        raise _undecidable("the body starts with a byte order mark")
    return text


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    # Equal but for case counts too: Go's encoding/json matches struct fields that way.
    if len(found) != len(pairs) or len({k.casefold() for k in found}) != len(found):
        raise _undecidable("the JSON body has duplicate keys")
    return found


def _constant(name: str) -> Any:
    raise _undecidable(f"the JSON body holds {name}")


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _undecidable("the JSON body holds a number out of range")
    return value


def _json(body: bytes) -> Any:
    # Decoded here: json.loads(bytes) would take UTF-16 and UTF-32 as well.
    text = _utf8(body)
    try:
        return json.loads(
            text, object_pairs_hook=_object, parse_constant=_constant, parse_float=_float
        )
    except ValueError:
        raise _undecidable("the body is not JSON") from None


def strict_json(body: bytes) -> Any:
    """JSON read as decide() reads it. Raises ValueError saying why it cannot be."""
    try:
        return _json(body)
    except _Refused as e:
        raise ValueError(e.detail) from None
    except RecursionError:
        raise ValueError("the body is nested too deeply") from None


def _json_body(content_type: str | None, body: bytes) -> Any:
    if _media_type(content_type) != "application/json":
        raise _undecidable("a body decided by its grant must be application/json")
    return _json(body)


def _batch(found: Any, what: str) -> list[dict[str, Any]]:
    """One object or a non-empty batch of them."""
    items = found if isinstance(found, list) else [found]
    if not items or len(items) > MAX_BATCH:
        raise _undecidable(f"a batch holds 1 to {MAX_BATCH} {what}s")
    if not all(isinstance(item, dict) for item in items):
        raise _undecidable(f"every {what} must be a JSON object")
    return items


def _form_decode(raw: bytes) -> str:
    """application/x-www-form-urlencoded, strictly: `+` is a space, `%` needs two hex digits."""
    if _BAD_PERCENT.search(raw):
        raise _undecidable("the query string has a malformed percent-escape")
    try:
        return unquote_to_bytes(raw.replace(b"+", b" ")).decode("utf-8")
    except UnicodeDecodeError:
        raise _undecidable("the query string is not UTF-8") from None


def _query_string(target: bytes) -> bytes:
    if b"#" in target:
        raise _undecidable("the target holds a fragment")
    return target.partition(b"?")[2]


# GraphQL


def _graphql(
    rule: GraphQLRule,
    method: str,
    target: bytes,
    content_type: str | None,
    body: bytes,
    found: list[Any],
) -> None:
    query = _query_string(target)
    if method == "GET":
        if body:
            raise _undecidable("a GraphQL GET with a body")
        params = _get_parameters(query)
        extensions = params.get("extensions")
        _graphql_request(
            rule,
            params.get("query"),
            params.get("operationName"),
            None if extensions is None else _json(extensions.encode("utf-8")),
            found,
        )
        return
    if method != "POST":
        raise _undecidable(f"a GraphQL grant decides GET and POST, not {_name(method)}")
    # A server may read the document from the query string as well as the body.
    for part in _SEPARATORS.split(query):
        if _form_decode(part.partition(b"=")[0]).casefold().startswith(_QUERY_STRING_PREFIXES):
            raise _undecidable("a GraphQL POST with GraphQL parameters in its query string")
    media_type = _media_type(content_type)
    if media_type == "application/graphql":
        _document(rule, _utf8(body), None, found)
    elif media_type == "application/json":
        for request in _batch(_json(body), "GraphQL request"):
            _graphql_object(rule, request, found)
    else:
        raise _undecidable("a GraphQL POST must be application/json or application/graphql")


def _get_parameters(query: bytes) -> dict[str, str]:
    if b";" in query:
        raise _undecidable("the query string holds `;`, which some servers read as `&`")
    params: dict[str, str] = {}
    for part in query.split(b"&"):
        if not part:
            continue
        raw_name, _, raw_value = part.partition(b"=")
        name = _form_decode(raw_name)
        if name not in _GRAPHQL_KEYS:
            raise _undecidable(f"a GraphQL GET with an unknown parameter {_name(name)!r}")
        if name in params:
            raise _undecidable(f"a GraphQL GET with two {name} parameters")
        params[name] = _form_decode(raw_value)
    return params


def _graphql_object(rule: GraphQLRule, request: dict[str, Any], found: list[Any]) -> None:
    unknown = request.keys() - _GRAPHQL_KEYS
    if unknown:
        raise _undecidable(f"a GraphQL request with an unknown member {_name(min(unknown))!r}")
    query, operation_name = request.get("query"), request.get("operationName")
    extensions = request.get("extensions")
    if not (
        isinstance(query, str | None)
        and isinstance(operation_name, str | None)
        and isinstance(extensions, dict | None)
    ):
        raise _undecidable("a GraphQL request member has the wrong type")
    _graphql_request(rule, query, operation_name, extensions, found)


def _graphql_request(
    rule: GraphQLRule,
    query: str | None,
    operation_name: str | None,
    extensions: Any,
    found: list[Any],
) -> None:
    if not isinstance(extensions, dict | None):
        raise _undecidable("GraphQL extensions must be a JSON object")
    digest = None
    if extensions is not None and "persistedQuery" in extensions:
        persisted = extensions["persistedQuery"]
        if not isinstance(persisted, dict) or not isinstance(persisted.get("sha256Hash"), str):
            raise _undecidable("a persisted query without a sha256Hash")
        digest = persisted["sha256Hash"]
    if query is None:
        if digest is None:
            raise _undecidable("a GraphQL request without a document")
        found.append({"type": "persisted", "hash": _name(digest)})
        if digest not in rule.persisted:
            raise _Refused(
                Reason.OPERATION_NOT_ALLOWED, f"persisted query {_name(digest)} is not granted"
            )
        return
    # A server that runs the stored document for the hash would not run the one decided here.
    if digest is not None and hashlib.sha256(query.encode("utf-8")).hexdigest() != digest:
        raise _undecidable("the persisted-query hash is not the document's")
    _document(rule, query, operation_name, found)


@dataclass(frozen=True, slots=True)
class _Operation:
    kind: str  # from the document: query, mutation or subscription
    name: str | None
    fields: tuple[str, ...]  # top-level, real names, through fragments
    # __schema or __type anywhere in the document, at any depth: a field that returns the
    # query root (a mutation payload's `query`, Relay's pattern) reaches introspection too.
    introspects: bool = False


def _document(rule: GraphQLRule, source: str, operation_name: str | None, found: list[Any]) -> None:
    operations = _analysed(source) if len(source) <= MAX_CACHED_DOCUMENT else _analyse(source)
    names = [op.name for op in operations]
    if operation_name is None and len(operations) > 1:
        raise _undecidable("several GraphQL operations and no operationName")
    if operation_name is not None and operation_name not in names:
        raise _undecidable("operationName names no operation of the document")
    # Every operation, not only the one operationName selects: servers differ.
    for op in operations:
        found.append(
            {
                "type": op.kind,
                "name": None if op.name is None else _name(op.name),
                "fields": [_name(f) for f in op.fields[:MAX_LISTED]],
            }
        )
        _check_operation(rule, op.kind, op.fields)
        if op.introspects and not rule.introspection:
            raise _Refused(Reason.OPERATION_NOT_ALLOWED, "introspection is not granted")


def import_graphql() -> None:
    """graphql-core (150 modules, about 5 MiB resident) is imported by the first GraphQL body
    or the first policy with a GraphQL body rule, not at start; once, as module globals."""
    global FieldNode, FragmentDefinitionNode, FragmentSpreadNode, GraphQLError  # noqa: PLW0603
    global InlineFragmentNode, OperationDefinitionNode, SelectionSetNode, parse  # noqa: PLW0603
    from graphql import (
        FieldNode,
        FragmentDefinitionNode,
        FragmentSpreadNode,
        GraphQLError,
        InlineFragmentNode,
        OperationDefinitionNode,
        SelectionSetNode,
        parse,
    )


def _analyse(source: str) -> tuple[_Operation, ...]:
    """A document's operations, or _Refused when it cannot be read with certainty."""
    if "parse" not in globals():
        import_graphql()
    try:
        document = parse(source, no_location=True, max_tokens=MAX_TOKENS)
    except GraphQLError:
        raise _undecidable("the GraphQL document does not parse") from None
    operations: list[OperationDefinitionNode] = []
    fragments: dict[str, FragmentDefinitionNode] = {}
    for definition in document.definitions:
        if isinstance(definition, OperationDefinitionNode):
            operations.append(definition)
        elif isinstance(definition, FragmentDefinitionNode):
            if definition.name.value in fragments:
                raise _undecidable("the GraphQL document defines a fragment twice")
            fragments[definition.name.value] = definition
        else:
            raise _undecidable("the GraphQL document holds type-system definitions")
    names = [op.name.value if op.name else None for op in operations]
    if not operations:
        raise _undecidable("the GraphQL document has no operation")
    if len(operations) > MAX_OPERATIONS:
        raise _undecidable(f"a GraphQL document holds at most {MAX_OPERATIONS} operations")
    if len(set(names)) != len(names):
        raise _undecidable("the GraphQL document names two operations alike")
    _check_fragments(operations, fragments)
    introspects = _introspects(document.definitions)
    tops: dict[str, tuple[str, ...]] = {}  # each fragment's top-level fields, found once
    return tuple(
        _Operation(
            op.operation.value,
            name,
            tuple(_top_fields(op.selection_set, fragments, tops)),
            introspects,
        )
        for op, name in zip(operations, names, strict=True)
    )


def _introspects(definitions: Any) -> bool:
    """Whether __schema or __type is selected anywhere in the document."""
    stack = [d.selection_set for d in definitions]
    while stack:
        for selection in stack.pop().selections:
            if isinstance(selection, FieldNode) and selection.name.value in INTROSPECTION_FIELDS:
                return True
            if isinstance(selection, FieldNode | InlineFragmentNode):
                if selection.selection_set is not None:
                    stack.append(selection.selection_set)
    return False


# Clients send the same few documents again and again (with other variables): parsing is most
# of the cost, so a document's analysis is kept. Refusals are not cached; small documents only.
_analysed = functools.lru_cache(maxsize=512)(_analyse)


def _spreads(selections: SelectionSetNode) -> set[str]:
    """The fragments spread anywhere below a selection set."""
    spread: set[str] = set()
    stack = [selections]
    while stack:
        for selection in stack.pop().selections:
            if isinstance(selection, FragmentSpreadNode):
                spread.add(selection.name.value)
            elif isinstance(selection, FieldNode | InlineFragmentNode):
                if selection.selection_set is not None:
                    stack.append(selection.selection_set)
    return spread


def _check_fragments(
    operations: list[OperationDefinitionNode], fragments: dict[str, FragmentDefinitionNode]
) -> None:
    graph = {name: _spreads(f.selection_set) for name, f in fragments.items()}
    used = set().union(*graph.values(), *(_spreads(op.selection_set) for op in operations))
    if not used <= fragments.keys():
        raise _undecidable("the GraphQL document spreads an undefined fragment")
    done: set[str] = set()
    for start in graph:
        # Depth-first, iteratively; a fragment met again on the current path is a cycle.
        path, on_path = [(start, iter(graph[start]))], {start}
        while path:
            name, following = path[-1]
            step = next(following, None)
            if step is None:
                path.pop()
                on_path.discard(name)
                done.add(name)
            elif step in on_path:
                raise _undecidable("the GraphQL document's fragments spread each other in a cycle")
            elif step not in done:
                path.append((step, iter(graph[step])))
                on_path.add(step)


def _top_fields(
    selections: SelectionSetNode,
    fragments: dict[str, FragmentDefinitionNode],
    tops: dict[str, tuple[str, ...]],
) -> list[str]:
    """The real names of an operation's top-level fields, through fragments and aliases.

    A fragment's own are found once per document (`tops`) and reused by every operation that
    spreads it: the work is the document's size, not operations times fragment size.
    """
    fields: dict[str, None] = {}
    stack = [selections]
    while stack:
        for selection in stack.pop().selections:
            if isinstance(selection, FieldNode):
                fields[selection.name.value] = None
            elif isinstance(selection, InlineFragmentNode):
                stack.append(selection.selection_set)
            elif isinstance(selection, FragmentSpreadNode):
                name = selection.name.value
                if name not in tops:
                    tops[name] = ()  # no cycles (checked before): a marker while found
                    tops[name] = tuple(_top_fields(fragments[name].selection_set, fragments, tops))
                fields.update(dict.fromkeys(tops[name]))
    return list(fields)


def _check_operation(rule: GraphQLRule, kind: str, fields: tuple[str, ...]) -> None:
    introspection = kind == "query" and rule.introspection

    def meta(field: str) -> bool:
        return field == "__typename" or (introspection and field.startswith("__"))

    if kind not in rule.operations:
        # A grant of introspection alone still lets a query read the schema.
        if not (introspection and fields and all(meta(f) for f in fields)):
            raise _Refused(Reason.OPERATION_NOT_ALLOWED, f"{kind} operations are not granted")
        return
    allowed = rule.operations[kind]
    for field in fields:
        if meta(field):
            continue
        if field.startswith("__"):
            raise _Refused(
                Reason.OPERATION_NOT_ALLOWED, f"introspection ({_name(field)}) is not granted"
            )
        if allowed is not None and field not in allowed:
            raise _Refused(
                Reason.OPERATION_NOT_ALLOWED, f"{kind} field {_name(field)} is not granted"
            )


# JSON-RPC and MCP


def _envelope(message: dict[str, Any], responses: bool) -> str | None:
    """A JSON-RPC 2.0 message's method, or None for a response (when `responses` are read)."""
    if message.get("jsonrpc") != "2.0":
        raise _undecidable('a JSON-RPC message without "jsonrpc": "2.0"')
    identifier = message.get("id")
    if isinstance(identifier, bool) or not isinstance(identifier, str | int | float | None):
        raise _undecidable("a JSON-RPC id must be a string or a number")
    if "method" in message or not responses:
        method = message.get("method")
        if not isinstance(method, str):
            raise _undecidable("a JSON-RPC request's method must be a string")
        if not message.keys() <= _REQUEST_KEYS:
            raise _undecidable("a JSON-RPC request with an unknown member")
        if not isinstance(message.get("params", {}), dict | list):
            raise _undecidable("JSON-RPC params must be an object or an array")
        return method
    if (
        "id" not in message
        or ("result" in message) == ("error" in message)
        or not message.keys() <= _RESPONSE_KEYS
        or not isinstance(message.get("error", {}), dict)
    ):
        raise _undecidable("a JSON-RPC message is neither a request nor a response")
    return None


def _jsonrpc(
    rule: JsonRpcRule, method: str, content_type: str | None, body: bytes, found: list[Any]
) -> None:
    if method != "POST":
        raise _undecidable(f"a JSON-RPC grant decides POST, not {_name(method)}")
    for message in _batch(_json_body(content_type, body), "JSON-RPC message"):
        name = _envelope(message, responses=False)
        assert name is not None
        found.append(_name(name))
        if name not in rule.methods:
            raise _Refused(Reason.RPC_METHOD_NOT_ALLOWED, f"method {_name(name)!r} is not granted")


def _mcp(
    rule: McpRule, method: str, content_type: str | None, body: bytes, found: list[Any]
) -> None:
    if method in ("GET", "DELETE"):
        # GET opens the server's stream, DELETE ends the session: nothing to decide but silence.
        if body:
            raise _undecidable(f"an MCP {method} with a body")
        found.append({"method": method})
        return
    if method != "POST":
        raise _undecidable(f"an MCP grant decides GET, POST and DELETE, not {_name(method)}")
    for message in _batch(_json_body(content_type, body), "JSON-RPC message"):
        _mcp_message(rule, message, found)


def _param(message: dict[str, Any], key: str) -> str:
    params = message.get("params")
    value = params.get(key) if isinstance(params, dict) else None
    if not isinstance(value, str):
        raise _undecidable(f"params.{key} must be a string")
    return value


def _mcp_message(rule: McpRule, message: dict[str, Any], found: list[Any]) -> None:
    method = _envelope(message, responses=True)
    if method is None:
        found.append({"response": True})
        return
    entry = {"method": _name(method)}
    found.append(entry)
    check = _MCP_CHECKS.get(method)
    if check is not None:
        check(rule, message, entry)
    elif method not in MCP_PASSING and not method.startswith("notifications/"):
        raise _Refused(
            Reason.RPC_METHOD_NOT_ALLOWED, f"MCP method {_name(method)!r} is not granted"
        )


_Check = Callable[[McpRule, dict[str, Any], dict[str, str]], None]


def _tool(rule: McpRule, message: dict[str, Any], entry: dict[str, str]) -> None:
    name = _param(message, "name")
    entry["tool"] = _name(name)
    if name not in rule.tools:
        raise _Refused(Reason.TOOL_NOT_ALLOWED, f"tool {_name(name)!r} is not granted")


def _prompt(rule: McpRule, message: dict[str, Any], entry: dict[str, str]) -> None:
    name = _param(message, "name")
    entry["prompt"] = _name(name)
    if name not in rule.prompts:
        raise _Refused(Reason.TOOL_NOT_ALLOWED, f"prompt {_name(name)!r} is not granted")


def _resource(rule: McpRule, message: dict[str, Any], entry: dict[str, str]) -> None:
    uri = _param(message, "uri")
    entry["resource"] = _name(uri.partition("?")[0])
    if _URI_UNSAFE.search(uri):
        raise _Refused(
            Reason.TOOL_NOT_ALLOWED,
            "a resource URI with dot segments, `%`, `\\` or characters outside printable ASCII",
        )
    if not uri.startswith(rule.resources):
        raise _Refused(Reason.TOOL_NOT_ALLOWED, f"resource {entry['resource']!r} is not granted")


_MCP_CHECKS: dict[str, _Check] = {
    "tools/call": _tool,
    "prompts/get": _prompt,
    **dict.fromkeys(MCP_RESOURCE_METHODS, _resource),
}
