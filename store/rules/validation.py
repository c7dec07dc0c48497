"""What the store checks before it writes: one place, messages that name no CLI flag.

A message names the operator's inputs as {placeholders} of InvalidInput (host, method,
credential, path, header, param, scheme), which the CLI words as its own flags.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from store.crypto import Secret
from store.errors import InvalidInput
from store.records import REQUEST_STATES, utcnow
from store.rules import aws, budgets, mintspec
from store.rules.bodyrules import BodyRule
from store.rules.grammar import (
    HostPattern,
    has_star,
    parse_host,
    parse_rate,
    validate_header_name,
    validate_method,
    validate_param_name,
    validate_path_pattern,
)

SCHEMES = ("bearer", "header", "basic", "query", "sigv4", "path", *mintspec.MINTED, "mtls")
MAX_REQUEST_PATH = 2048
MAX_REQUEST_TEXT = 1000


def hosts(patterns: Sequence[str]) -> list[HostPattern]:
    return sorted({parse_host(h) for h in patterns}, key=lambda p: (p.host, p.port or 0))


def credential_hosts(patterns: Sequence[str]) -> list[HostPattern]:
    parsed = hosts(patterns)
    if not parsed:
        raise InvalidInput("a credential needs at least one {host}", host="host")
    return parsed


def scheme_options(
    scheme: str, header_name: str | None, param_name: str | None
) -> tuple[str | None, str | None]:
    if scheme not in SCHEMES:
        raise InvalidInput(f"invalid scheme {scheme!r}: use one of {', '.join(SCHEMES)}")
    if (scheme == "header") != (header_name is not None) and scheme not in mintspec.MINTED:
        raise InvalidInput(
            "{header} goes with {scheme} header or a minted-token scheme, and only with them",
            header="a header name",
            scheme="scheme",
        )
    if (scheme == "query") != (param_name is not None):
        raise InvalidInput(
            "{param} goes with {scheme} query, and only with it",
            param="a parameter name",
            scheme="scheme",
        )
    if header_name is not None:
        validate_header_name(header_name)
    if param_name is not None:
        validate_param_name(param_name)
    return header_name, param_name


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_LAUNCHER_NAMES = frozenset(
    {
        "NODE_USE_ENV_PROXY",
        "NODE_EXTRA_CA_CERTS",
        "JAVA_TOOL_OPTIONS",
        "PIP_CERT",
        "GIT_SSL_CAINFO",
        "NPM_CONFIG_CAFILE",
        "SSL_CERT_DIR",
        "DENO_CERT",
        "CARGO_HTTP_CAINFO",
        "UV_SYSTEM_CERTS",
    }
)


def env_name(name: str) -> str:
    """A variable name for a placeholder: letters, digits and `_`, not starting with a digit."""
    if not _ENV_NAME.fullmatch(name):
        raise InvalidInput(
            "invalid {placeholder_env} {name!r}", placeholder_env="variable name", name=name
        )
    upper = name.upper()
    if upper in _LAUNCHER_NAMES or upper.endswith(("_PROXY", "_CA_BUNDLE", "_CERT_FILE")):
        # exec sets these itself: a placeholder over one would send clients around the proxy.
        raise InvalidInput(
            "{placeholder_env} {name!r} is one exec sets for the proxy itself",
            placeholder_env="variable name",
            name=name,
        )
    return name


def secret(scheme: str, value: Secret) -> None:
    plain = value.reveal()
    if not plain:
        raise InvalidInput("the secret is empty")
    # A CR or LF in a header value would let the secret split the request.
    if any(b < 0x20 or b == 0x7F for b in plain):
        raise InvalidInput("the secret contains control characters")
    if scheme in ("bearer", "header") and not plain.isascii():
        raise InvalidInput("a header secret must be ASCII")
    if scheme == "basic" and b":" not in plain:
        raise InvalidInput("a basic secret must be user:password")


@dataclass(frozen=True)
class GrantSpec:
    methods: list[str]
    paths: list[str]
    hosts: list[HostPattern]
    expires_at: datetime | None
    encoded_slash: bool = False


MAX_BURST = 1_000_000_000


@dataclass(frozen=True)
class Limits:
    """A rate (as written) with its burst, and a use count; each None when not set."""

    rate: str | None = None
    burst: int | None = None
    max_uses: int | None = None
    approval: str | None = None  # each or first: requests wait for an owner's decision
    hold: int | None = None  # seconds a request waits for it (with approval)
    budget: str | None = None  # token budgets and their cap, canonical JSON (store.rules.budgets)


NO_LIMITS = Limits()
APPROVALS = ("each", "first")
DEFAULT_HOLD = 120
MAX_HOLD = 600  # below mitmproxy's 10-minute inactivity timeout of a connection


def limits(
    rate: str | None,
    burst: int | None,
    max_uses: int | None = None,
    once: bool = False,
    approval: str | None = None,
    hold: str | None = None,
    budget: Sequence[str] = (),
    cap_max_tokens: bool = False,
) -> Limits:
    if rate is not None:
        parse_rate(rate)
    if burst is not None:
        if rate is None:
            raise InvalidInput("{burst} goes with {rate}", burst="a burst", rate="a rate")
        if not 1 <= burst <= MAX_BURST:
            raise InvalidInput(f"invalid {{burst}} {burst}: 1 to {MAX_BURST}", burst="burst")
    if max_uses is not None:
        if once:
            raise InvalidInput(
                "{once} is {max_uses} 1: give one of them", once="once", max_uses="max-uses"
            )
        if not 1 <= max_uses <= MAX_BURST:
            raise InvalidInput(
                f"invalid {{max_uses}} {max_uses}: 1 to {MAX_BURST}", max_uses="max-uses"
            )
    held = None
    if approval is not None:
        if approval not in APPROVALS:
            raise InvalidInput(
                f"invalid {{approval}} {approval!r}: use each or first", approval="approval"
            )
        held = hold_seconds(hold) if hold is not None else DEFAULT_HOLD
    elif hold is not None:
        raise InvalidInput("{hold} goes with {approval}", hold="a hold", approval="an approval")
    return Limits(rate, burst, max_uses, approval, held, budgets.canonical(budget, cap_max_tokens))


def hold_seconds(text: str) -> int:
    """`120`, `120s`, `2m`: whole seconds from 1 to MAX_HOLD."""
    m = re.fullmatch(r"([0-9]{1,4})([sm]?)", text)
    seconds = int(m.group(1)) * (60 if m.group(2) == "m" else 1) if m else 0
    if not 1 <= seconds <= MAX_HOLD:
        raise InvalidInput(
            f"invalid {{hold}} {text!r}: 1s to {MAX_HOLD}s, as 90s or 2m", hold="hold"
        )
    return seconds


def grant_spec(
    methods: Sequence[str],
    host_patterns: Sequence[str],
    paths: Sequence[str],
    expires_at: datetime | None,
    encoded_slash: bool = False,
) -> GrantSpec:
    if not methods:
        raise InvalidInput("a grant needs at least one {method} (or '*')", method="method")
    method_list = sorted({validate_method(m) for m in methods})
    if "*" in method_list and len(method_list) > 1:
        raise InvalidInput("{method} '*' already allows every method", method="method")
    path_list = sorted({validate_path_pattern(p) for p in paths}) or ["/"]
    if encoded_slash and not any(map(has_star, path_list)):
        raise InvalidInput(
            "{encoded_slash} only changes what a '*' segment matches, and no {path} has one",
            encoded_slash="encoded_slash",
            path="path",
        )
    patterns = hosts(host_patterns)
    if expires_at is not None and expires_at <= utcnow():
        raise InvalidInput("the grant's expiry is in the past")
    return GrantSpec(method_list, path_list, patterns, expires_at, encoded_slash)


def grant_shape(*, websocket: bool, body: BodyRule | None) -> None:
    """What a grant's settings cannot say together."""
    if body is not None and websocket:
        raise InvalidInput(
            f"{'an' if body.kind == 'mcp' else 'a'} {body.kind} rule decides a request's body, "
            "not WebSocket messages: "
            "give the grant one or the other"
        )


def grant_columns(
    spec: GrantSpec,
    *,
    once: bool,
    websocket: bool,
    purpose: str | None,
    limits: Limits,
    body: BodyRule | None,
) -> dict[str, Any]:
    """Every column a grant's definition sets, by name, checked together.

    The one place that turns a grant as asked into a row, whichever path writes it: the ORM
    (store.tables.grants.insert), the sqlite3 quick path (store.db.lite) and a policy file's apply.
    """
    grant_shape(websocket=websocket, body=body)
    return {
        "hosts": [str(p) for p in spec.hosts] or None,
        "methods": list(spec.methods),
        "paths": list(spec.paths),
        "once": once,
        "websocket": websocket,
        "expires_at": spec.expires_at,
        "purpose": purpose,
        "encoded_slash": spec.encoded_slash,
        "rate": limits.rate,
        "burst": limits.burst,
        "max_uses": limits.max_uses,
        "approval": limits.approval,
        "hold": limits.hold,
        "body": None if body is None else body.to_json(),
        "budget": limits.budget,
    }


def within_credential(spec: GrantSpec, credential: str | None, its_hosts: Sequence[str]) -> None:
    """A grant's hosts must lie within its credential's; without one it must name some."""
    if credential is None:
        if not spec.hosts:
            raise InvalidInput(
                "a grant without {credential} needs at least one {host}",
                credential="a credential",
                host="host",
            )
        return
    allowed = [parse_host(h) for h in its_hosts]
    for pattern in spec.hosts:
        if not any(a.covers(pattern) for a in allowed):
            raise InvalidInput(
                f"host {pattern} is outside credential {credential!r}'s hosts "
                f"({', '.join(its_hosts)})"
            )


def request(
    host: str, port: int, method: str, path: str, purpose: str | None, explicit: bool
) -> None:
    """An access request as the proxy passes it on from an agent."""
    if validate_method(method) == "*":
        raise InvalidInput("an access request names one method, not '*'")
    if not 0 < port < 65536:
        raise InvalidInput(f"invalid port {port}")
    # The path and purpose come from the agent and end up on the owner's terminal.
    if (
        not path.startswith("/")
        or len(path) > MAX_REQUEST_PATH
        or not (path.isascii() and path.isprintable())
        or " " in path
    ):
        raise InvalidInput(
            f"invalid path: must start with '/', be printable ASCII without spaces, "
            f"and be at most {MAX_REQUEST_PATH} characters"
        )
    if purpose is not None:
        text("purpose", purpose)
    if explicit:
        # The proxy has already normalised the host of a denied request; an asked-for one
        # is the agent's own text.
        pattern = parse_host(f"[{host}]" if ":" in host else host)
        if pattern.wildcard or pattern.port is not None or pattern.host != host:
            raise InvalidInput(f"invalid host {host!r}: name one host, without port or wildcard")


def approvable_path(request_id: int, path: str) -> None:
    """A requested path approved as it stands must not widen into a pattern."""
    if "*" in path.split("/"):
        raise InvalidInput(
            "request {id}'s path {requested} has a '*' segment, which a grant reads as any "
            "segment: approve it with {path}",
            id=str(request_id),
            requested=path,
            path="a path pattern",
        )


def request_state(state: str) -> str:
    if state not in REQUEST_STATES:
        raise InvalidInput(f"invalid state {state!r}: use one of {', '.join(REQUEST_STATES)}")
    return state


def text(what: str, value: str) -> None:
    if len(value) > MAX_REQUEST_TEXT or not value.isprintable():
        raise InvalidInput(
            f"invalid {what}: one line of printable text, at most {MAX_REQUEST_TEXT} characters"
        )


# -- schemes with settings of their own: sigv4 and path --------------------------------------

SIGV4_FIELDS = ("access_key_id", "secret_access_key", "session_token")
_ACCESS_KEY_ID = re.compile(r"[A-Z0-9]{16,128}")
# Printable ASCII without spaces: what a header value can carry unchanged.
_AWS_VALUE = re.compile(r"[\x21-\x7e]{1,8192}")
_PLACEHOLDER = re.compile(r"[A-Za-z0-9_-]{8,64}")
# A path secret goes into a path segment as it is: pchar without '%' (no escapes to misread).
_PCHARS = r"[A-Za-z0-9._~:@!$&'()*+,=-]"  # pchar that canonicalisation keeps, less `;` and `%`
_PATH_SECRET = re.compile(_PCHARS + "{1,4096}")
_POSITION = re.compile(f"(?:/{_PCHARS}+)*/{_PCHARS}*\\{{\\}}{_PCHARS}*")
_ROLE_ARN = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,512}")
_EXTERNAL_ID = re.compile(r"[\w+=,.@:/-]{2,1224}")
MAX_SESSION_POLICY = 2048  # STS's limit for an inline session policy
OPTION_INPUTS = {
    "assume_role": "assume_role",
    "external_id": "external_id",
    "session_policy": "session_policy",
    "region": "region",
    "service": "service",
    "placeholder": "placeholder",
    "position": "position",
    "token_url": "token_url",
    "scope": "scope",
    "audience": "audience",
    "client_auth": "client_auth",
    "token_prefix": "token_prefix",
    "subject": "subject",
    "installation": "installation",
    "repository": "repository",
    "permission": "permission",
    "api_url": "api_url",
}


def aws_keys(value: Secret) -> dict[str, str]:
    """The JSON secret of a sigv4 credential, checked; messages never quote it."""
    shape = "JSON {access_key_id, secret_access_key[, session_token]}"
    data = mintspec.json_object(value, shape)
    if set(data) - set(SIGV4_FIELDS):
        raise InvalidInput(f"the secret has a field other than {', '.join(SIGV4_FIELDS)}")
    for name in SIGV4_FIELDS[:2]:
        if name not in data:
            raise InvalidInput(f"the secret lacks {name}: it must be {shape}")
    for name, text in data.items():
        if not isinstance(text, str) or not _AWS_VALUE.fullmatch(text):
            raise InvalidInput(
                f"the secret's {name} must be a string of printable ASCII without spaces"
            )
    if not _ACCESS_KEY_ID.fullmatch(data["access_key_id"]):
        raise InvalidInput(
            "the secret's access_key_id must be 16 to 128 upper-case letters or digits"
        )
    return {name: data[name] for name in SIGV4_FIELDS if name in data}


def scheme_secret(scheme: str, value: Secret, options: Mapping[str, Any]) -> Secret:
    """`secret()`, after a scheme's own checks; a sigv4 secret comes back as compact JSON, an
    mtls one as its chain and key in PEM (lines, which `secret()` would refuse)."""
    if scheme == "mtls":
        # On first use: clientcert brings cryptography.x509, which the store's light commands
        # (principal add, grant add/list) never need (tests/test_cli_imports.py).
        from store.rules import clientcert

        return clientcert.secret(value)
    if scheme == "sigv4":
        value = Secret(json.dumps(aws_keys(value), separators=(",", ":")).encode())
    elif scheme in mintspec.MINTED:
        value = mintspec.secret(scheme, value, options)
    secret(scheme, value)
    if scheme == "path":
        plain = value.reveal().decode("ascii", "replace")
        if not _PATH_SECRET.fullmatch(plain):
            raise InvalidInput(
                "a path secret must be letters, digits and -._~:@!$&'()*+,= (it goes into a "
                "path segment as it is)"
            )
        placeholder = options["placeholder"]
        if placeholder in plain or plain in placeholder:
            raise InvalidInput(
                "the secret and the {placeholder} must not contain each other",
                placeholder="placeholder",
            )
    return value


def secret_hint(scheme: str, value: Secret) -> dict[str, str]:
    """What `credential list` may show of a secret: a sigv4 access key id's last four, a
    service account's e-mail and token endpoint, a GitHub App's id."""
    if scheme == "sigv4":
        return {"access_key_id": "…" + json.loads(value.reveal())["access_key_id"][-4:]}
    if scheme in mintspec.MINTED:
        return mintspec.hint(scheme, json.loads(value.reveal()))
    if scheme == "mtls":
        from store.rules import clientcert  # on first use, as in scheme_secret

        cert = clientcert.parse(value)
        return clientcert.identity(cert.chain[0]).hint()
    return {}


def credential_options(
    scheme: str, options: Mapping[str, Any], patterns: Sequence[HostPattern]
) -> dict[str, Any]:
    """A scheme's settings, checked against its hosts; what goes into credentials.options."""
    given = {name: v for name, v in options.items() if v not in (None, [], ())}
    # Any scheme may name a variable for `credproxy exec` to set to a placeholder.
    placeholder_env = given.pop("placeholder_env", None)
    common = {"placeholder_env": env_name(placeholder_env)} if placeholder_env else {}
    allowed = {
        "sigv4": ("region", "service", "assume_role", "external_id", "session_policy"),
        "path": ("placeholder", "position"),
        **mintspec.OPTIONS,
    }.get(scheme, ())
    for name in given:
        if name not in allowed:
            raise InvalidInput(
                f"{{{name}}} does not go with {{scheme}} {scheme}",
                **{name: OPTION_INPUTS.get(name, name), "scheme": "scheme"},
            )
    if scheme == "sigv4":
        return _sigv4_options(given, patterns) | common
    if scheme == "path":
        return _path_options(given) | common
    if scheme in mintspec.MINTED:
        return mintspec.options(scheme, given) | common
    return common


def _sigv4_options(given: Mapping[str, Any], patterns: Sequence[HostPattern]) -> dict[str, Any]:
    region, service = given.get("region"), given.get("service")
    if region is not None and not aws.is_region(region):
        raise InvalidInput(
            f"invalid {{region}} {_literal(region)}: e.g. us-east-1", region="region"
        )
    if service is not None and not aws.SERVICE_NAME.fullmatch(service):
        raise InvalidInput(
            f"invalid {{service}} {_literal(service)}: the signing name, e.g. bedrock or s3",
            service="service",
        )
    for pattern in patterns:
        if aws.scope_of(aws.representative(str(pattern)), service, region) is None:
            raise InvalidInput(
                f"cannot tell the service and region of {pattern}: give {{service}} and {{region}}",
                service="service",
                region="region",
            )
    return {"region": region, "service": service, **_role_options(given)}


def _role_options(given: Mapping[str, Any]) -> dict[str, Any]:
    arn = given.get("assume_role")
    external_id, policy = given.get("external_id"), given.get("session_policy")
    if arn is None:
        if external_id is not None or policy is not None:
            raise InvalidInput(
                "{external_id} and {session_policy} go with {assume_role}",
                external_id="external_id",
                session_policy="session_policy",
                assume_role="assume_role",
            )
        return {}
    if not _ROLE_ARN.fullmatch(arn):
        raise InvalidInput(
            "invalid {assume_role}: a role ARN, arn:aws:iam::ACCOUNT:role/NAME",
            assume_role="assume_role",
        )
    if external_id is not None and not _EXTERNAL_ID.fullmatch(external_id):
        raise InvalidInput(
            "invalid {external_id}: 2 to 1224 letters, digits or +=,.@:/-",
            external_id="external_id",
        )
    options: dict[str, Any] = {"assume_role": arn, "external_id": external_id}
    if policy is not None:
        try:
            parsed = json.loads(policy)
        except ValueError:
            raise InvalidInput(
                "the {session_policy} is not valid JSON", session_policy="session_policy"
            ) from None
        compact = json.dumps(parsed, separators=(",", ":"))
        if not isinstance(parsed, dict) or len(compact) > MAX_SESSION_POLICY:
            raise InvalidInput(
                f"the {{session_policy}} must be a JSON policy of at most {MAX_SESSION_POLICY} "
                "characters",
                session_policy="session_policy",
            )
        options["session_policy"] = compact
    return options


def _path_options(given: Mapping[str, Any]) -> dict[str, Any]:
    placeholder = given.get("placeholder")
    positions = list(given.get("position") or ())
    if placeholder is None or not positions:
        raise InvalidInput(
            "{scheme} path needs a {placeholder} and at least one {position}",
            scheme="scheme",
            placeholder="placeholder",
            position="position",
        )
    if not _PLACEHOLDER.fullmatch(placeholder):
        raise InvalidInput(
            "invalid {placeholder}: 8 to 64 letters, digits, '_' or '-'",
            placeholder="placeholder",
        )
    for position in positions:
        if position.count("{}") != 1 or not _POSITION.fullmatch(position):
            raise InvalidInput(
                f"invalid {{position}} {_literal(position)}: a path prefix of whole segments "
                "with {{}} once, where the placeholder goes, e.g. /bot{{}}",
                position="position",
            )
        if placeholder in position:
            raise InvalidInput(
                "a {position} must not contain the placeholder itself", position="position"
            )
    return {"placeholder": placeholder, "positions": sorted(set(positions))}


def _literal(text: str) -> str:
    """An operator's input quoted inside a message template (its braces kept as braces)."""
    return repr(text).replace("{", "{{").replace("}", "}}")
