"""A policy file (TOML): the principals, credentials and grants an operator wants, parsed.

Every problem in the file is collected with its line, so one run names them all. Secrets are
never in the file: a credential names where its secret comes from (`secret_env`, `secret_file`),
and the secret is read only when a plan needs it; or where it is held (`secret_ref`), which the
store keeps and the proxy reads.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from store.crypto import Secret
from store.errors import CredproxyError, InvalidInput
from store.rules import bodyrules, budgets, mintspec, secretref, validation
from store.rules.bodyrules import BodyRule
from store.rules.grammar import (
    check_registered_method,
    parse_host,
    validate_method,
    validate_name,
    validate_path_pattern,
)

MAX_FILE = 4 * 1024 * 1024
MAX_SECRET = 64 * 1024
# How the store's messages name their inputs, as this file's keys.
KEYS = {
    "host": "hosts",
    "method": "methods",
    "credential": "credential",
    "path": "paths",
    "header": "header",
    "param": "param",
    "scheme": "scheme",
    "expires": "expires",
    "extension_method": "extension_methods = true",
}
TOP_KEYS = frozenset({"token_dir", "principal", "credential", "grant"})
PRINCIPAL_KEYS = frozenset({"name", "rate", "burst"})
CREDENTIAL_KEYS = frozenset(
    {"name", "scheme", "hosts", "header", "param", "secret_env", "secret_file", "secret_ref"}
)
# Scheme settings kept in the credential's options, by key; schemes that have settings add
# theirs here.
CREDENTIAL_OPTION_KEYS = frozenset(
    {
        "region",
        "service",
        "assume_role",
        "external_id",
        "session_policy",
        "placeholder",
        "position",
        "placeholder_env",
        *mintspec.OPTION_NAMES,  # the minted-token schemes name theirs once
    }
)
# Options that take a list of strings; the others take one string.
LIST_OPTIONS = frozenset({"position", *mintspec.LIST_OPTION_NAMES})
GRANT_KEYS = frozenset(
    {
        "id",
        "principal",
        "credential",
        "hosts",
        "methods",
        "paths",
        "once",
        "expires",
        "websocket",
        "encoded_slash",
        "extension_methods",
        "purpose",
        *bodyrules.KINDS,
        "rate",
        "burst",
        "max_uses",
        "approval",
        "hold",
        "budget",
        "cap_max_tokens",
    }
)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# A grant made with the CLI has no id; a policy file (and `export`) names it grant-<its id>.
IMPLICIT_KEY = re.compile(r"grant-([1-9][0-9]{0,18})")


class PolicyFileError(InvalidInput):
    """One or more problems in a policy file; `problems` holds one line each."""

    def __init__(self, problems: list[str]) -> None:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(problems[0] + more)
        self.problems = problems


@dataclass(frozen=True)
class SecretSource:
    """Where a credential's secret comes from: read once to be sealed (secret_env,
    secret_file), or held there for good and read by the proxy (secret_ref)."""

    env: str | None = None
    file: Path | None = None
    ref: str | None = None

    def describe(self) -> str:
        if self.ref is not None:
            return f"secret_ref {self.ref}"
        return f"secret_env {self.env}" if self.env is not None else f"secret_file {self.file}"

    def read(self) -> Secret:
        """The secret, one trailing newline stripped. Raises InvalidInput naming the source."""
        if self.env is not None:
            value = os.environ.get(self.env)
            if value is None:
                # The name is not echoed: it may be a secret pasted in the wrong place.
                raise InvalidInput("the variable secret_env names is not set")
            raw = os.fsencode(value)
        else:
            assert self.file is not None
            try:
                with self.file.open("rb") as f:
                    raw = f.read(MAX_SECRET + 3)
            except OSError as e:
                # The path is not echoed: it may be a secret pasted in the wrong place.
                raise InvalidInput(f"secret_file cannot be read: {e.strerror}") from e
        if raw.endswith(b"\r\n"):
            raw = raw[:-2]
        elif raw.endswith(b"\n"):
            raw = raw[:-1]
        if len(raw) > MAX_SECRET:
            raise InvalidInput(f"{self.describe()}: the secret is longer than 64 KiB")
        if not raw:
            raise InvalidInput(f"{self.describe()}: the secret is empty")
        return Secret(raw)


@dataclass(frozen=True)
class PrincipalSpec:
    name: str
    line: int
    limits: validation.Limits = validation.NO_LIMITS


@dataclass(frozen=True)
class CredentialSpec:
    name: str
    scheme: str
    hosts: tuple[str, ...]
    header: str | None
    param: str | None
    options: dict[str, Any]
    source: SecretSource | None
    line: int
    source_line: int  # where the secret's source is named


@dataclass(frozen=True)
class GrantSpec:
    key: str
    principal: str
    credential: str | None
    hosts: tuple[str, ...]  # normalised; () means the credential's
    methods: tuple[str, ...]
    paths: tuple[str, ...]
    once: bool
    websocket: bool
    encoded_slash: bool
    expires_at: datetime | None
    purpose: str | None
    line: int
    limits: validation.Limits = validation.NO_LIMITS
    body: BodyRule | None = None

    @property
    def implicit_id(self) -> int | None:
        """The id of the CLI-made grant this key stands for (grant-<id>), if it does."""
        m = IMPLICIT_KEY.fullmatch(self.key)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class PolicyFile:
    """The file's valid tables, and its problems so far: a plan adds its own to them."""

    path: Path
    token_dir: Path | None
    principals: tuple[PrincipalSpec, ...]
    credentials: tuple[CredentialSpec, ...]
    grants: tuple[GrantSpec, ...]
    problems: tuple[str, ...] = ()
    # Names declared by tables with a problem: what refers to them is not reported again.
    broken: frozenset[str] = frozenset()

    def where(self, line: int) -> str:
        return f"{self.path}:{line}"


def raise_problems(problems: list[str]) -> None:
    """Raise PolicyFileError with every problem, in the order of their lines."""
    if problems:
        raise PolicyFileError(sorted(problems, key=_line_of))


def _line_of(problem: str) -> int:
    m = re.match(r".*?:(\d+): ", problem)
    return int(m.group(1)) if m else 0


@dataclass
class _Lines:
    """Where each table and key of the file stands, which tomllib does not say."""

    headers: dict[str, list[int]] = field(default_factory=dict)
    keys: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)
    top: dict[str, int] = field(default_factory=dict)

    @classmethod
    def index(cls, text: str) -> _Lines:
        lines = cls()
        current: tuple[str, int] | None = None
        for number, raw in enumerate(text.splitlines(), 1):
            stripped = raw.strip()
            header = re.fullmatch(r"\[\[\s*([A-Za-z0-9_-]+)\s*\]\]\s*(#.*)?", stripped)
            if header:
                name = header.group(1)
                lines.headers.setdefault(name, []).append(number)
                current = (name, len(lines.headers[name]) - 1)
                lines.keys[current] = {}
                continue
            if stripped.startswith("["):
                current = None
                continue
            key = re.match(r"([A-Za-z0-9_-]+|\"[^\"]*\")\s*=", stripped)
            if key:
                name = key.group(1).strip('"')
                target = lines.keys[current] if current is not None else lines.top
                target.setdefault(name, number)
        return lines

    def of(self, table: str, index: int, key: str | None = None) -> int:
        header = self.headers.get(table, [])
        start = header[index] if index < len(header) else 1
        if key is None:
            return start
        return self.keys.get((table, index), {}).get(key, start)


class _Problems:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.found: list[str] = []

    def add(self, line: int, what: str, message: str) -> None:
        self.found.append(
            f"{self.path}:{line}: {what}: {message}" if what else f"{self.path}:{line}: {message}"
        )

    @contextmanager
    def catching(self, line: int, what: str) -> Iterator[None]:
        try:
            yield
        except InvalidInput as e:
            self.add(line, what, e.worded(KEYS))
        except CredproxyError as e:
            self.add(line, what, str(e))


def load(path: Path) -> PolicyFile:
    """Read and check a policy file. Raises PolicyFileError naming every problem."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE + 1)
    except OSError as e:
        raise PolicyFileError([f"{path}: cannot read the policy file: {e.strerror}"]) from e
    if len(raw) > MAX_FILE:
        raise PolicyFileError([f"{path}: the policy file is larger than 4 MiB"])
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except UnicodeDecodeError as e:
        raise PolicyFileError([f"{path}: the policy file is not UTF-8"]) from e
    except RecursionError as e:
        raise PolicyFileError([f"{path}: the policy file nests too deeply"]) from e
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column \d+\)", str(e))
        message = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
        line = m.group(1) if m else "1"
        raise PolicyFileError([f"{path}:{line}: invalid TOML: {message}"]) from e
    return parse(path, data, _Lines.index(text))


def parse(path: Path, data: Mapping[str, Any], lines: _Lines) -> PolicyFile:
    problems = _Problems(path)
    for key in data:
        if key not in TOP_KEYS:
            problems.add(lines.top.get(key, 1), "", _unknown(key, TOP_KEYS))
    token_dir = None
    if "token_dir" in data:
        value = data["token_dir"]
        if isinstance(value, str) and value:
            token_dir = path.parent / value
        else:
            problems.add(lines.top.get("token_dir", 1), "token_dir", "must be a path (a string)")
    principals = _tables(data, "principal", lines, problems, _principal)
    credentials = _tables(data, "credential", lines, problems, _credential)
    grants = _tables(data, "grant", lines, problems, _grant)
    for kind, specs in (("principal", principals), ("credential", credentials)):
        _unique(problems, kind, [(s.name, s.line) for s in specs])  # type: ignore[attr-defined]
    _unique(problems, "grant", [(g.key, g.line) for g in grants])
    broken = frozenset(
        f"{kind}:{t.get('name')}"
        for kind in ("principal", "credential")
        for t in data.get(kind, [])
        if isinstance(t, dict)
        and t.get("name")
        not in {s.name for s in (principals if kind == "principal" else credentials)}
    )
    return PolicyFile(
        path,
        token_dir,
        principals,  # type: ignore[arg-type]
        credentials,  # type: ignore[arg-type]
        grants,  # type: ignore[arg-type]
        tuple(problems.found),
        broken,
    )


def _unique(problems: _Problems, kind: str, names: list[tuple[str, int]]) -> None:
    seen: dict[str, int] = {}
    for name, line in names:
        if name in seen:
            problems.add(line, f'{kind} "{name}"', f"declared twice (first at line {seen[name]})")
        seen.setdefault(name, line)


def _tables(
    data: Mapping[str, Any],
    kind: str,
    lines: _Lines,
    problems: _Problems,
    build: Callable[[_Table], Any],
) -> tuple[Any, ...]:
    tables = data.get(kind, [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        problems.add(lines.top.get(kind, 1), kind, f"write each one as [[{kind}]]")
        return ()
    specs = []
    for index, values in enumerate(tables):
        table = _Table(kind, index, values, lines, problems)
        spec = build(table)
        if spec is not None and not table.failed:
            specs.append(spec)
    return tuple(specs)


class _Table:
    """One [[kind]] table: typed reads of its keys, each problem recorded with its line."""

    def __init__(
        self, kind: str, index: int, values: dict[str, Any], lines: _Lines, problems: _Problems
    ) -> None:
        self.kind = kind
        self.index = index
        self.values = values
        self.lines = lines
        self.problems = problems
        self.line = lines.of(kind, index)
        self.failed = False
        name_key = "id" if kind == "grant" else "name"
        name = values.get(name_key)
        self.what = f'{kind} "{name}"' if isinstance(name, str) else f"{kind} #{index + 1}"

    def at(self, key: str | None = None) -> int:
        return self.lines.of(self.kind, self.index, key)

    def problem(self, key: str | None, message: str) -> None:
        self.failed = True
        self.problems.add(self.at(key), self.what, message)

    def known(self, allowed: frozenset[str]) -> None:
        for key in self.values:
            if key not in allowed:
                self.problem(key, _unknown(key, allowed))

    def text(self, key: str, *, required: bool = False) -> str | None:
        value = self.values.get(key)
        if value is None:
            if required:
                self.problem(None, f"{key} is required")
            return None
        if not isinstance(value, str):
            self.problem(key, f"{key} must be a string")
            return None
        return value

    def texts(self, key: str) -> tuple[str, ...]:
        value = self.values.get(key, [])
        if isinstance(value, str):
            self.problem(key, f'{key} must be a list, e.g. {key} = ["{value}"]')
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.problem(key, f"{key} must be a list of strings")
            return ()
        return tuple(value)

    def flag(self, key: str) -> bool:
        value = self.values.get(key, False)
        if not isinstance(value, bool):
            self.problem(key, f"{key} must be true or false")
            return False
        return value

    @contextmanager
    def checking(self, key: str | None) -> Iterator[None]:
        before = len(self.problems.found)
        with self.problems.catching(self.at(key), self.what):
            yield
        if len(self.problems.found) > before:
            self.failed = True


def _principal(t: _Table) -> PrincipalSpec | None:
    t.known(PRINCIPAL_KEYS)
    name = t.text("name", required=True)
    if name is not None:
        with t.checking("name"):
            validate_name("principal", name)
    limits = _limits(t)
    return PrincipalSpec(name, t.line, limits) if name is not None else None


def _limits(t: _Table, *, uses: bool = False) -> validation.Limits:
    rate = t.text("rate")
    burst, max_uses = t.values.get("burst"), t.values.get("max_uses") if uses else None
    bad = [
        key
        for key, value in (("burst", burst), ("max_uses", max_uses))
        if value is not None and (not isinstance(value, int) or isinstance(value, bool))
    ]
    for key in bad:
        t.problem(key, f"{key} must be a whole number")
    burst = None if "burst" in bad else burst
    max_uses = None if "max_uses" in bad else max_uses
    approval, hold = (t.text("approval"), t.values.get("hold")) if uses else (None, None)
    if hold is not None and (isinstance(hold, bool) or not isinstance(hold, int | str)):
        t.problem("hold", 'hold must be seconds or a duration, e.g. hold = "2m"')
        hold = None
    budget: tuple[str, ...] = ()
    if uses and "budget" in t.values:
        with t.checking("budget"):
            budgets.parse(t.texts("budget"))
            budget = t.texts("budget")
    cap = uses and t.flag("cap_max_tokens")
    if cap and (budget or "budget" not in t.values):  # a bad budget is reported once
        try:
            budgets.parse(budget, cap=True)
        except InvalidInput as e:
            t.problem("cap_max_tokens", e.worded(KEYS))
            budget = ()
    cap = cap and bool(budget)
    with t.checking("approval" if approval is not None else "rate"):
        return validation.limits(
            rate,
            burst,
            max_uses,
            bool(t.values.get("once")),
            approval,
            str(hold) if hold is not None else None,
            budget,
            cap,
        )
    return validation.NO_LIMITS


def _credential(t: _Table) -> CredentialSpec | None:
    if "secret" in t.values:
        t.problem("secret", "an inline secret is not allowed: use secret_env or secret_file")
    t.known(CREDENTIAL_KEYS | CREDENTIAL_OPTION_KEYS | {"secret"})
    name = t.text("name", required=True)
    scheme = t.text("scheme", required=True)
    hosts = t.texts("hosts")
    header, param = t.text("header"), t.text("param")
    env, file, ref = t.text("secret_env"), t.text("secret_file"), t.text("secret_ref")
    if name is not None:
        with t.checking("name"):
            validate_name("credential", name)
    with t.checking("hosts"):
        hosts = tuple(str(p) for p in validation.credential_hosts(hosts))
    if scheme is not None:
        with t.checking("scheme"):
            validation.scheme_options(scheme, header, param)
    source = None
    if env is not None and file is not None:
        t.problem("secret_file", "give secret_env or secret_file, not both")
    elif ref is not None and (env is not None or file is not None):
        # A reference is held elsewhere for good; the other two are read once and sealed.
        t.problem("secret_ref", "give secret_ref or a secret to seal (secret_env, secret_file)")
    elif ref is not None:
        with t.checking("secret_ref"):
            source = SecretSource(ref=secretref.for_scheme(scheme or "", ref))
    elif env is not None:
        if not ENV_NAME.fullmatch(env):
            # Not echoed: a value here is more likely a pasted secret than a name.
            t.problem("secret_env", "secret_env must be an environment variable's name")
        elif env.upper().startswith("CREDPROXY_"):
            t.problem("secret_env", "secret_env may not name credproxy's own settings")
        else:
            source = SecretSource(env=env)
    elif file is not None:
        path = Path(file)
        source = SecretSource(file=path if path.is_absolute() else t.problems.path.parent / path)
    placeholder = t.text("placeholder_env")
    if placeholder is not None:
        with t.checking("placeholder_env"):  # here, to name the line
            validation.env_name(placeholder)
    options = {}
    for option in CREDENTIAL_OPTION_KEYS & t.values.keys():
        options[option] = t.texts(option) if option in LIST_OPTIONS else t.text(option)
    if name is None or scheme is None:
        return None
    source_line = t.at(
        "secret_env" if env is not None else "secret_ref" if ref is not None else "secret_file"
    )
    return CredentialSpec(name, scheme, hosts, header, param, options, source, t.line, source_line)


def _grant(t: _Table) -> GrantSpec | None:
    t.known(GRANT_KEYS)
    key = t.text("id", required=True)
    principal = t.text("principal", required=True)
    credential = t.text("credential")
    hosts, methods, paths = t.texts("hosts"), t.texts("methods"), t.texts("paths")
    once, websocket, encoded_slash = t.flag("once"), t.flag("websocket"), t.flag("encoded_slash")
    extension_methods = t.flag("extension_methods")
    purpose = t.text("purpose")
    if key is not None:
        with t.checking("id"):
            validate_name("grant id", key)
    if "methods" not in t.values:
        t.problem(None, 'methods is required, e.g. methods = ["GET"]')
    expires_at = _expiry(t)
    limits = _limits(t, uses=True)
    if purpose is not None:
        with t.checking("purpose"):
            validation.text("purpose", purpose)
    for key_name, values, check in (
        ("methods", methods, validate_method),
        ("paths", paths, validate_path_pattern),
        ("hosts", hosts, parse_host),
    ):
        with t.checking(key_name):
            for value in values:
                check(value)
    if not extension_methods:
        with t.checking("methods"):
            for method in methods:
                check_registered_method(method)
    body = _body(t, websocket)
    spec = None
    if not t.failed:
        with t.checking("methods"):
            # The expiry is checked against the clock only where the grant is written.
            spec = validation.grant_spec(methods, hosts, paths, None, encoded_slash)
    if spec is not None and credential is None and not spec.hosts:
        t.problem(None, "a grant without a credential needs hosts")
    if key is None or principal is None or spec is None:
        return None
    return GrantSpec(
        key=key,
        principal=principal,
        credential=credential,
        hosts=tuple(str(h) for h in spec.hosts),
        methods=tuple(spec.methods),
        paths=tuple(spec.paths),
        once=once,
        websocket=websocket,
        encoded_slash=encoded_slash,
        expires_at=expires_at,
        purpose=purpose,
        line=t.line,
        limits=limits,
        body=body,
    )


def _body(t: _Table, websocket: bool) -> BodyRule | None:
    """The grant's body rule: at most one of graphql, mcp, jsonrpc."""
    kinds = [kind for kind in bodyrules.KINDS if kind in t.values]
    if len(kinds) > 1:
        t.problem(kinds[1], f"give one of {', '.join(bodyrules.KINDS)}, not {' and '.join(kinds)}")
        return None
    if not kinds:
        return None
    [kind] = kinds
    with t.checking(kind):
        rule = bodyrules.parse(kind, t.values[kind])
        validation.grant_shape(websocket=websocket, body=rule)
        return rule
    return None


def _expiry(t: _Table) -> datetime | None:
    value = t.values.get("expires")
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            t.problem(
                "expires",
                f"expires {value!r} must be an instant such as 2027-01-31T00:00:00Z: "
                "a duration would move at every apply",
            )
            return None
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=UTC)
    t.problem("expires", "expires must be a date and time, e.g. 2027-01-31T00:00:00Z")
    return None


def _unknown(key: str, allowed: frozenset[str]) -> str:
    close = difflib.get_close_matches(key, sorted(allowed), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown key {key!r}{hint}"
