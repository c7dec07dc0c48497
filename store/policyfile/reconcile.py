"""A policy file against the store: the plan (what would change), applying it, exporting one.

A plan is computed from one read of the store; `apply` computes it again inside the write
transaction, after taking the change counter's row, so two applies run one after the other
and each sees the other's result. The counter moves once per apply, so a proxy reloads once
and never sees half of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from store.crypto import MasterKey, Secret, hash_token, new_token
from store.db.engine import Database, bump
from store.db.models import AccessRequest, Credential, Grant, Principal, utcnow
from store.errors import Conflict, InvalidInput
from store.policyfile.parse import KEYS, CredentialSpec, GrantSpec, PolicyFile, raise_problems
from store.records import APPROVED, HOLD
from store.rules import bodyrules, budgets, secretref, validation
from store.rules.grammar import REGISTERED_METHODS
from store.tables import credentials, keys, principals

CREATE, UPDATE, REVOKE, REMOVE = "create", "update", "revoke", "remove"


@dataclass(frozen=True)
class Change:
    kind: str  # principal, credential or grant
    name: str  # its name, or the grant's id in the file
    action: str  # create, update, revoke (grants) or remove (principals, credentials)
    fields: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # before, after

    def describe(self) -> str:
        parts = [f"{self.action} {self.kind} {self.name}"]
        for name, (before, after) in self.fields.items():
            if self.action == CREATE:
                parts.append(f"{name}={_show(after)}")
            else:
                parts.append(f"{name}: {_show(before)} -> {_show(after)}")
        return "  ".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "action": self.action,
            "fields": {k: {"before": b, "after": a} for k, (b, a) in self.fields.items()},
        }


@dataclass(frozen=True)
class Plan:
    changes: tuple[Change, ...]
    untouched: tuple[str, ...]  # what the store has and the file does not name (no --prune)

    @property
    def empty(self) -> bool:
        return not self.changes


@dataclass(frozen=True)
class Applied:
    plan: Plan
    tokens: dict[str, str]  # new principal -> its token


@dataclass
class _State:
    principals: dict[str, Principal]
    credentials: dict[str, Credential]
    grants: dict[str, tuple[Grant, str, str | None]]  # key -> (row, principal, credential)


def _read(session: Session) -> _State:
    live_principals = {
        p.name: p for p in session.scalars(select(Principal).where(Principal.disabled_at.is_(None)))
    }
    live_credentials = {
        c.name: c
        for c in session.scalars(select(Credential).where(Credential.removed_at.is_(None)))
    }
    names = {p.id: p.name for p in session.scalars(select(Principal))}
    cred_names = {c.id: c.name for c in session.scalars(select(Credential))}
    grants = {}
    for g in session.scalars(select(Grant).where(Grant.revoked_at.is_(None)).order_by(Grant.id)):
        if names.get(g.principal_id) not in live_principals:
            continue
        key = g.key or f"grant-{g.id}"
        cred = cred_names.get(g.credential_id) if g.credential_id is not None else None
        grants[key] = (g, names[g.principal_id], cred)
    return _State(live_principals, live_credentials, grants)


def _grant_state(g: Grant, now: datetime) -> str:
    if g.consumed_at is not None:
        return "consumed"
    if g.expires_at is not None and g.expires_at <= now:
        return "expired"
    return "active"


class _Planner:
    def __init__(self, policy: PolicyFile, key: MasterKey, prune: bool) -> None:
        self.policy = policy
        self.key = key
        self.prune = prune
        self.problems: list[str] = list(policy.problems)
        self.secrets: dict[str, Secret] = {}
        # Each credential's scheme settings, as the store keeps them.
        self.settings: dict[str, dict[str, Any]] = {}

    def problem(self, line: int, what: str, message: str) -> None:
        self.problems.append(f"{self.policy.where(line)}: {what}: {message}")

    def plan(self, state: _State) -> Plan:
        changes: list[Change] = []
        untouched: list[str] = []
        now = utcnow()
        wanted_principals = {p.name for p in self.policy.principals}
        for p in self.policy.principals:
            wanted = {"rate": p.limits.rate, "burst": p.limits.burst}
            existing = state.principals.get(p.name)
            if existing is None:
                created = {k: (None, v) for k, v in wanted.items() if v is not None}
                changes.append(Change("principal", p.name, CREATE, created))
                continue
            have = {"rate": existing.rate, "burst": existing.burst}
            fields = {k: (have[k], v) for k, v in wanted.items() if have[k] != v}
            if fields:
                changes.append(Change("principal", p.name, UPDATE, fields))
        for name in sorted(state.principals):
            if name not in wanted_principals:
                if self.prune:
                    changes.append(Change("principal", name, REMOVE))
                else:
                    untouched.append(f"principal {name}")
        live_principals = wanted_principals | (set() if self.prune else set(state.principals))

        wanted_creds = {c.name: c for c in self.policy.credentials}
        for c in self.policy.credentials:
            change = self._credential(c, state.credentials.get(c.name))
            if change is not None:
                changes.append(change)
        for name in sorted(state.credentials):
            if name not in wanted_creds:
                if self.prune:
                    changes.append(Change("credential", name, REMOVE))
                else:
                    untouched.append(f"credential {name}")
        cred_hosts = {
            name: list(c.hosts) for name, c in state.credentials.items() if not self.prune
        }
        cred_hosts.update({name: list(c.hosts) for name, c in wanted_creds.items()})

        wanted_grants = {g.key for g in self.policy.grants}
        for g in self.policy.grants:
            where = f'grant "{g.key}"'
            if f"principal:{g.principal}" in self.policy.broken or (
                g.credential is not None and f"credential:{g.credential}" in self.policy.broken
            ):
                continue  # its principal or credential has a problem of its own
            if g.principal not in live_principals:
                self.problem(g.line, where, f"principal {g.principal!r} is not declared")
                continue
            if g.credential is not None and g.credential not in cred_hosts:
                self.problem(g.line, where, f"credential {g.credential!r} is not declared")
                continue
            current = state.grants.get(g.key)
            if current is None and g.implicit_id is not None:
                self.problem(
                    g.line, where, "ids of the form grant-<number> name grants made by the CLI"
                )
                continue
            try:
                spec = validation.grant_spec(g.methods, g.hosts, g.paths, None, g.encoded_slash)
                validation.within_credential(
                    spec, g.credential, cred_hosts.get(g.credential or "", [])
                )
            except InvalidInput as e:
                self.problem(g.line, where, e.worded(KEYS))
                continue
            change = self._grant(g, current, now)
            if change is not None:
                changes.append(change)
        for key, (row, principal, credential) in state.grants.items():
            if key in wanted_grants:
                continue
            gone = principal not in live_principals or (
                credential is not None and credential not in cred_hosts
            )
            if gone:
                if _grant_state(row, now) == "active":
                    # Revoked with its principal or credential: shown, so nothing goes unseen.
                    changes.append(Change("grant", key, REVOKE))
                continue
            if self.prune:
                if _grant_state(row, now) == "active":
                    changes.append(Change("grant", key, REVOKE))
            elif _grant_state(row, now) == "active":
                untouched.append(f"grant {key}")
        raise_problems(self.problems)
        return Plan(tuple(changes), tuple(untouched))

    def _secret(self, c: CredentialSpec, settings: dict[str, Any]) -> Secret | None:
        if c.source is None or c.source.ref is not None:
            return None
        if c.name not in self.secrets:
            try:
                secret = validation.scheme_secret(c.scheme, c.source.read(), settings)
            except InvalidInput as e:
                self.problem(c.source_line, f'credential "{c.name}"', e.worded(KEYS))
                return None
            self.secrets[c.name] = secret
        return self.secrets[c.name]

    def _credential(self, c: CredentialSpec, row: Credential | None) -> Change | None:
        where = f'credential "{c.name}"'
        try:
            patterns = validation.credential_hosts(c.hosts)
            settings = validation.credential_options(c.scheme, c.options, patterns)
        except InvalidInput as e:
            self.problem(c.line, where, e.worded(KEYS))
            return None
        self.settings[c.name] = settings
        secret = self._secret(c, settings)
        wanted = {
            "scheme": c.scheme,
            "hosts": list(c.hosts),
            "header": c.header,
            "param": c.param,
            "options": _settings(settings),
        }
        if row is None:
            if c.source is None:
                self.problem(c.line, where, "secret_env or secret_file is needed to create it")
                return None
            fields: dict[str, tuple[Any, Any]] = {
                k: (None, v) for k, v in wanted.items() if v is not None
            }
            if secret is not None:
                fields["secret"] = (None, self.key.fingerprint(secret))
            if c.source.ref is not None:
                fields["secret_ref"] = (None, c.source.ref)
            return Change("credential", c.name, CREATE, fields)
        have = {
            "scheme": row.scheme,
            "hosts": list(row.hosts),
            "header": row.header_name,
            "param": row.param_name,
            "options": _settings(row.options),
        }
        fields = {k: (have[k], v) for k, v in wanted.items() if have[k] != v}
        if "scheme" in fields and c.source is None:
            self.problem(c.line, where, "changing the scheme needs secret_env or secret_file")
        if secret is not None:
            fp = self.key.fingerprint(secret)
            if fp != row.fingerprint:
                fields["secret"] = (None if row.secret_ref else row.fingerprint, fp)
            if row.secret_ref is not None:  # sealed from now on
                fields["secret_ref"] = (row.secret_ref, None)
        ref = c.source.ref if c.source is not None else None
        if ref is not None and ref != row.secret_ref:
            fields["secret_ref"] = (row.secret_ref, ref)
        return Change("credential", c.name, UPDATE, fields) if fields else None

    def _grant(
        self, g: GrantSpec, current: tuple[Grant, str, str | None] | None, now: datetime
    ) -> Change | None:
        wanted = _grant_fields(g)
        if current is None:
            if g.expires_at is not None and g.expires_at <= now:
                self.problem(g.line, f'grant "{g.key}"', "its expiry is in the past")
                return None
            return Change("grant", g.key, CREATE, {k: (None, v) for k, v in wanted.items() if v})
        row, principal, credential = current
        have = {
            "principal": principal,
            "credential": credential,
            "hosts": sorted(row.hosts or []),
            "methods": sorted(row.methods),
            "paths": sorted(row.paths),
            "once": row.once,
            "websocket": row.websocket,
            "encoded_slash": row.encoded_slash,
            "expires": _instant(row.expires_at),
            "purpose": row.purpose,
            "rate": row.rate,
            "burst": row.burst,
            "max_uses": row.max_uses,
            "approval": row.approval,
            "hold": row.hold,
            "body": row.body,
            "budget": row.budget,
        }
        fields = {k: (have[k], v) for k, v in wanted.items() if have[k] != v}
        if "expires" in fields and g.expires_at is not None and g.expires_at <= now:
            self.problem(g.line, f'grant "{g.key}"', "its new expiry is in the past")
        if row.consumed_at is not None and not _used_up(g, row):
            # More uses, or no longer a once-grant: the file makes it usable again.
            fields["state"] = ("consumed", "active")
        return Change("grant", g.key, UPDATE, fields) if fields else None


def _used_up(g: GrantSpec, row: Grant) -> bool:
    """Would the grant as the file describes it still be used up, given what was spent?"""
    if g.once:
        return row.once or row.uses >= 1  # a grant that was used once is no new once-grant
    return g.limits.max_uses is not None and row.uses >= g.limits.max_uses


# What credentials.options holds that comes from the secret, not from the file.
HINT_KEYS = frozenset(
    {"access_key_id", "client_email", "token_uri", "app_id"}
    | {"cert_subject", "cert_issuer", "cert_sans", "cert_not_after"}  # mtls
)
# Settings kept under another name than the file's (and the CLI's) key.
FILE_KEYS = {"positions": "position"}


def _settings(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """A credential's scheme settings as the file speaks of them: no secret hint, no nulls."""
    kept = {k: v for k, v in (options or {}).items() if k not in HINT_KEYS and v is not None}
    return kept or None


def _grant_fields(g: GrantSpec) -> dict[str, Any]:
    return {
        "principal": g.principal,
        "credential": g.credential,
        "hosts": sorted(g.hosts),
        "methods": sorted(g.methods),
        "paths": sorted(g.paths),
        "once": g.once,
        "websocket": g.websocket,
        "encoded_slash": g.encoded_slash,
        "expires": _instant(g.expires_at),
        "purpose": g.purpose,
        "rate": g.limits.rate,
        "burst": g.limits.burst,
        "max_uses": g.limits.max_uses,
        "approval": g.limits.approval,
        "hold": g.limits.hold,
        "body": None if g.body is None else g.body.to_json(),
        "budget": g.limits.budget,
    }


def _instant(when: datetime | None) -> str | None:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z") if when else None


def plan(db: Database, key: MasterKey, policy: PolicyFile, *, prune: bool = False) -> Plan:
    """What applying `policy` would change. Raises PolicyFileError naming every problem."""
    keys.check(db, key)
    with db.session() as session:
        return _Planner(policy, key, prune).plan(_read(session))


class _Unchanged(Exception):
    pass


def apply(
    db: Database,
    key: MasterKey,
    policy: PolicyFile,
    *,
    prune: bool = False,
    expected: Plan | None = None,
    write_tokens: Callable[[dict[str, str]], Callable[[], None]] | None = None,
) -> Applied:
    """Apply `policy` in one transaction.

    `expected` is the plan shown to the operator: if the store changed since, nothing is
    applied. `write_tokens` stores the new principals' tokens before the commit and returns
    what to do once it succeeded (move them into place).
    """
    keys.check(db, key)
    planner = _Planner(policy, key, prune)
    with db.session() as session:
        # Every secret is read (and every problem found) before the store is locked.
        planner.plan(_read(session))
    tokens: dict[str, str] = {}
    finish: Callable[[], None] | None = None
    try:
        with db.session() as session, session.begin():
            # Taken first: a second apply waits here, then plans against this one's result.
            bump(session)  # logged as ALL: every proxy reloads the applied file whole
            state = _read(session)
            result = planner.plan(state)
            if expected is not None and result != expected:
                raise Conflict("the store changed since the plan was shown; nothing applied")
            if result.empty:
                raise _Unchanged
            tokens = _execute(session, key, policy, planner, state, result)
            if tokens and write_tokens is not None:
                finish = write_tokens(tokens)
    except _Unchanged:
        return Applied(result, {})  # rolled back: not even the counter moved
    if finish is not None:
        finish()
    return Applied(result, tokens)


def _execute(
    session: Session,
    key: MasterKey,
    policy: PolicyFile,
    planner: _Planner,
    state: _State,
    result: Plan,
) -> dict[str, str]:
    now = utcnow()
    tokens: dict[str, str] = {}
    by_name = {c.name: c for c in policy.credentials}
    by_principal = {p.name: p for p in policy.principals}
    by_key = {g.key: g for g in policy.grants}
    order = {"principal": 0, "credential": 1, "grant": 2}
    for change in sorted(result.changes, key=lambda c: order[c.kind]):
        if change.kind == "principal":
            wanted = by_principal.get(change.name)
            if change.action == CREATE:
                token = new_token()
                principal = Principal(
                    name=change.name, token_hash=hash_token(token), created_at=now
                )
                session.add(principal)
                state.principals[change.name] = principal
                tokens[change.name] = token
            if change.action in (CREATE, UPDATE):
                assert wanted is not None
                principal = state.principals[change.name]
                principal.rate, principal.burst = wanted.limits.rate, wanted.limits.burst
                session.flush()
            else:
                principals.disable(session, state.principals[change.name], now)
        elif change.kind == "credential":
            if change.action == REMOVE:
                credentials.destroy(session, state.credentials[change.name], now)
                continue
            spec = by_name[change.name]
            cred = state.credentials.get(change.name)
            if cred is None:
                cred = Credential(name=spec.name, fingerprint="", created_at=now)
                session.add(cred)
                state.credentials[spec.name] = cred
            cred.scheme = spec.scheme
            cred.hosts = list(spec.hosts)
            cred.header_name = spec.header
            cred.param_name = spec.param
            settings = planner.settings[spec.name]
            hint = {k: v for k, v in (cred.options or {}).items() if k in HINT_KEYS}
            if "secret" in change.fields:
                secret = planner.secrets[spec.name]
                hint = validation.secret_hint(spec.scheme, secret)
                cred.key_id, cred.nonce, cred.ciphertext = keys.seal(key, spec.name, secret)
                cred.fingerprint = key.fingerprint(secret)
                cred.secret_ref = None
                if change.action == UPDATE:
                    cred.rotated_at = now
            elif change.fields.get("secret_ref", (None, None))[1] is not None:
                # Held elsewhere from now on: nothing sealed is kept.
                cred.secret_ref = change.fields["secret_ref"][1]
                cred.key_id = cred.nonce = cred.ciphertext = None
                cred.fingerprint = secretref.mark(key, spec.name, cred.secret_ref)
                hint = {}
                if change.action == UPDATE:
                    cred.rotated_at = now
            cred.options = (settings | hint) or None
            session.flush()
        else:
            if change.action == REVOKE:
                state.grants[change.name][0].revoked_at = now
                continue
            g = by_key[change.name]
            current = state.grants.get(g.key)
            grant = current[0] if current is not None else Grant(created_at=now)
            grant.key = None if g.implicit_id is not None else g.key
            grant.principal_id = state.principals[g.principal].id
            credential_id = state.credentials[g.credential].id if g.credential is not None else None
            if current is not None and grant.credential_id != credential_id:
                # An owner approved requests of a `first` grant sent with its credential: a
                # grant that now stamps another one holds the next request again.
                session.execute(
                    update(AccessRequest)
                    .where(
                        AccessRequest.grant_id == grant.id,
                        AccessRequest.kind == HOLD,
                        AccessRequest.state == APPROVED,
                    )
                    .values(cover_until=now)
                )
            grant.credential_id = credential_id
            # The expiry was checked against the clock by the plan, where it changed.
            shape = validation.grant_spec(g.methods, g.hosts, g.paths, None, g.encoded_slash)
            row = validation.grant_columns(
                dataclasses.replace(shape, expires_at=g.expires_at),
                once=g.once,
                websocket=g.websocket,
                purpose=g.purpose,
                limits=g.limits,
                body=g.body,
            )
            for column, value in row.items():
                setattr(grant, column, value)
            if "state" in change.fields:
                grant.consumed_at = None
            if current is None:
                session.add(grant)
            session.flush()
    return tokens


def token_writer(directory: Path) -> Callable[[dict[str, str]], Callable[[], None]]:
    """Write each new principal's token to DIRECTORY/<name>.token (0600) around the commit.

    The directory must be ours and closed to others; each token goes to a new file of its own
    (never through a link or into a file someone else made), which is renamed into place once
    the transaction committed.
    """

    def write(tokens: dict[str, str]) -> Callable[[], None]:
        staged: list[tuple[str, Path]] = []
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = directory.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                raise InvalidInput(f"token_dir {directory} is not a directory of this user")
            if info.st_mode & 0o022:
                raise InvalidInput(f"token_dir {directory} is writable by others: chmod go-w")
            for name in tokens:
                final = directory / f"{name}.token"
                if final.is_symlink() or final.is_dir():
                    raise InvalidInput(f"{final} is a link or a directory: remove it first")
            for name, token in tokens.items():
                fd, temp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
                with os.fdopen(fd, "w") as f:
                    f.write(token + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                staged.append((temp, directory / f"{name}.token"))
        except OSError as e:
            for temp, _ in staged:
                os.unlink(temp)
            raise InvalidInput(f"cannot write tokens to {directory}: {e.strerror}") from e

        def finish() -> None:
            for temp, final in staged:
                try:
                    os.replace(temp, final)
                except OSError as e:
                    raise InvalidInput(
                        f"applied, but {final} could not be written ({e.strerror}): "
                        f"the token is in {temp}"
                    ) from e

        return finish

    return write


# -- export --------------------------------------------------------------------------


def export(db: Database) -> str:
    """The store's principals, credentials and active grants as a policy file."""
    now = utcnow()
    with db.session() as session:
        state = _read(session)
        lines = [
            f"# credproxy policy, exported {_instant(now)}",
            "# Secrets are never exported: to create or rotate a credential, uncomment its",
            "# secret_env (or use secret_file). Without one, apply keeps the stored secret.",
            "# Only active grants are listed; used once-grants and expired grants are not.",
        ]
        for name, p in sorted(state.principals.items()):
            lines += ["", "[[principal]]", f"name = {_toml(name)}"]
            if p.rate is not None:
                lines.append(f"rate = {_toml(p.rate)}")
            if p.burst is not None:
                lines.append(f"burst = {_toml(p.burst)}")
        for name, c in sorted(state.credentials.items()):
            lines += ["", "[[credential]]", f"name = {_toml(name)}", f"scheme = {_toml(c.scheme)}"]
            lines.append(f"hosts = {_toml(list(c.hosts))}")
            if c.header_name is not None:
                lines.append(f"header = {_toml(c.header_name)}")
            if c.param_name is not None:
                lines.append(f"param = {_toml(c.param_name)}")
            for option, value in sorted((_settings(c.options) or {}).items()):
                lines.append(f"{FILE_KEYS.get(option, option)} = {_toml(value)}")
            if c.secret_ref is not None:  # a reference is no secret: written as it is
                lines.append(f"secret_ref = {_toml(c.secret_ref)}")
                continue
            # Not CREDPROXY_*: those are credproxy's own settings, which secret_env may not name.
            env = "SECRET_" + "".join(ch if ch.isalnum() else "_" for ch in name.upper())
            lines.append(f"# secret_env = {_toml(env)}")
        for key, (g, principal, credential) in state.grants.items():
            if _grant_state(g, now) != "active":
                continue
            lines += ["", *grant_table(_view(key, g, principal, credential))]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class GrantView:
    """An active grant as a policy file writes it, read out of its session."""

    key: str  # its id in a policy file: the key, or grant-<id>
    id: int
    principal: str
    credential: str | None
    hosts: tuple[str, ...]  # () means the credential's
    methods: tuple[str, ...]
    paths: tuple[str, ...]
    once: bool
    websocket: bool
    encoded_slash: bool
    expires_at: datetime | None
    purpose: str | None
    rate: str | None
    burst: int | None
    max_uses: int | None
    approval: str | None
    hold: int | None
    body: Any
    created_at: datetime
    budget: Any = None  # the stored JSON of its token budget (store/rules/budgets.py)


def _view(key: str, g: Grant, principal: str, credential: str | None) -> GrantView:
    return GrantView(
        key=key,
        id=g.id,
        principal=principal,
        credential=credential,
        hosts=tuple(sorted(g.hosts or [])),
        methods=tuple(sorted(g.methods)),
        paths=tuple(sorted(g.paths)),
        once=g.once,
        websocket=g.websocket,
        encoded_slash=g.encoded_slash,
        expires_at=g.expires_at,
        purpose=g.purpose,
        rate=g.rate,
        burst=g.burst,
        max_uses=g.max_uses,
        approval=g.approval,
        hold=g.hold,
        body=g.body,
        created_at=g.created_at,
        budget=g.budget,
    )


@dataclass(frozen=True)
class Current:
    """What a suggestion is drawn against: live principals, credentials' hosts, active grants."""

    principals: frozenset[str]
    credential_hosts: dict[str, tuple[str, ...]]
    grants: tuple[GrantView, ...]


def current(db: Database) -> Current:
    """The store as a plan reads it: no secret is opened."""
    now = utcnow()
    with db.session() as session:
        state = _read(session)
        return Current(
            frozenset(state.principals),
            {name: tuple(c.hosts) for name, c in state.credentials.items()},
            tuple(
                _view(key, g, principal, credential)
                for key, (g, principal, credential) in state.grants.items()
                if _grant_state(g, now) == "active"
            ),
        )


def grant_table(g: GrantView) -> list[str]:
    """The grant's [[grant]] table, as `export` writes it and `apply` reads it back."""
    lines = ["[[grant]]", f"id = {_toml(g.key)}", f"principal = {_toml(g.principal)}"]
    if g.credential is not None:
        lines.append(f"credential = {_toml(g.credential)}")
    if g.hosts:
        lines.append(f"hosts = {_toml(sorted(g.hosts))}")
    lines.append(f"methods = {_toml(sorted(g.methods))}")
    lines.append(f"paths = {_toml(sorted(g.paths))}")
    for flag in ("once", "websocket", "encoded_slash"):
        if getattr(g, flag):
            lines.append(f"{flag} = true")
    if set(g.methods) - {"*"} - REGISTERED_METHODS:
        lines.append("extension_methods = true")
    if g.expires_at is not None:
        lines.append(f"expires = {_instant(g.expires_at)}")
    if g.purpose is not None:
        lines.append(f"purpose = {_toml(g.purpose)}")
    for limit in ("rate", "burst", "max_uses", "approval"):
        if getattr(g, limit) is not None:
            lines.append(f"{limit} = {_toml(getattr(g, limit))}")
    if g.hold is not None:
        lines.append(f'hold = "{g.hold}s"')
    budget = budgets.from_json(g.budget) if g.budget is not None else None
    if budget is not None:
        lines.append(f"budget = {_toml(list(budget.specs()))}")
        if budget.cap:
            lines.append("cap_max_tokens = true")
    body = bodyrules.describe_for_file(g.body)
    if body is not None:
        lines.append(body)
    return lines


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, str):
        # JSON's string escapes are TOML's; DEL is the one control character JSON leaves raw.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, Sequence):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(type(value).__name__)


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return "-" if value is None else str(value)
