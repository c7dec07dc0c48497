"""`Store(url, key)`: the store as one object, each method handed to the module of its concern."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Engine

from store import snapshot
from store.crypto import MasterKey, Secret
from store.db import delta, schema
from store.db.engine import Database
from store.records import (
    AccessRequestEntry,
    BudgetEntry,
    ConsoleTokenEntry,
    CredentialEntry,
    Delta,
    GrantEntry,
    PrincipalEntry,
    Snapshot,
    TokenEntry,
    Usage,
)
from store.rules import budgets as rules_budgets
from store.rules.bodyrules import BodyRule
from store.rules.validation import NO_LIMITS, Limits
from store.tables import (
    access_requests,
    approvals,
    budgets,
    console_tokens,
    credentials,
    grants,
    keys,
    principals,
    rates,
    tokens,
)

T = TypeVar("T")


class Store:
    """The store behind one database URL; `key` may be None for commands that need no secret."""

    def __init__(self, url: str, key: MasterKey | None, *, create: bool = False) -> None:
        self.db = Database(url, create=create)
        self.key = key

    @property
    def engine(self) -> Engine:
        return self.db.engine

    @property
    def display_url(self) -> str:
        return self.db.display_url

    def reopen_if_replaced(self) -> bool:
        """Reopen if another file now stands at the SQLite path; raises unless it is ready."""
        return self.db.reopen_if_replaced(self.check_ready)

    def restrict_file(self) -> None:
        self.db.restrict_file()

    def close(self) -> None:
        self.db.close()

    def change_counter(self) -> int:
        return self.db.change_counter()

    # -- schema and key --------------------------------------------------------------

    def migrate(self, revision: str = "head") -> None:
        schema.migrate(self.db, revision)

    def schema_revision(self) -> str | None:
        return schema.revision_of(self.db)

    def check_ready(self) -> None:
        """Raise unless the schema is at head and the master key is the store's own."""
        schema.check_head(self.db)
        self.check_key()

    def check_key(self, *, adopt: bool = False) -> None:
        keys.check(self.db, self.key, adopt=adopt)

    def stored_key_id(self) -> str | None:
        return keys.stored_key_id(self.db)

    def rotate_key(self, new_key: MasterKey) -> int:
        return keys.rotate(self.db, keys.need(self.key), new_key)

    # -- the approvers' console's operators ------------------------------------------

    def add_console_token(self, operator: str, expires_at: datetime) -> str:
        return console_tokens.add(self.db, operator, expires_at)

    def list_console_tokens(self) -> list[ConsoleTokenEntry]:
        return console_tokens.listing(self.db)

    def revoke_console_tokens(self, operator: str) -> int:
        return console_tokens.revoke(self.db, operator)

    def live_console_tokens(self) -> int:
        return console_tokens.live_count(self.db)

    def console_operator(self, token: str) -> tuple[str, int] | None:
        return console_tokens.operator_of(self.db, token)

    def console_token_live(self, token_id: int) -> bool:
        return console_tokens.is_live(self.db, token_id)

    # -- principals, credentials, grants ---------------------------------------------

    def add_principal(self, name: str, limits: Limits = NO_LIMITS) -> str:
        return principals.add(self.db, name, limits)

    def set_principal_limits(self, name: str, limits: Limits) -> None:
        principals.set_limits(self.db, name, limits)

    def list_principals(self) -> list[PrincipalEntry]:
        return principals.listing(self.db)

    def remove_principal(self, name: str) -> int:
        return principals.remove(self.db, name)

    def add_token(
        self, principal: str, expires_at: datetime | None, note: str | None = None
    ) -> tuple[int, str]:
        return tokens.add(self.db, principal, expires_at, note)

    def list_tokens(self, principal: str | None = None) -> list[TokenEntry]:
        return tokens.listing(self.db, principal)

    def revoke_token(self, token_id: int) -> None:
        tokens.revoke(self.db, token_id)

    def add_credential(
        self,
        name: str,
        scheme: str,
        hosts: Sequence[str],
        secret: Secret | None,
        header_name: str | None = None,
        param_name: str | None = None,
        options: Mapping[str, Any] | None = None,
        secret_ref: str | None = None,
    ) -> str:
        key = keys.need(self.key)
        return credentials.add(
            self.db, key, name, scheme, hosts, secret, header_name, param_name, options, secret_ref
        )

    def list_credentials(self) -> list[CredentialEntry]:
        return credentials.listing(self.db)

    def credential_hosts(self) -> dict[str, list[str]]:
        """Each live credential's hosts, by name."""
        return {c.name: c.hosts for c in self.list_credentials()}

    def exchange_credential(
        self,
        name: str,
        fingerprint: str,
        step: Callable[[dict[str, Any]], tuple[T, dict[str, Any] | None]],
        hold: float = 15.0,
    ) -> T:
        return credentials.exchange(self.db, keys.need(self.key), name, fingerprint, step, hold)

    def rotate_credential(
        self, name: str, secret: Secret | None, secret_ref: str | None = None
    ) -> str:
        return credentials.rotate(self.db, keys.need(self.key), name, secret, secret_ref)

    def remove_credential(self, name: str) -> int:
        return credentials.remove(self.db, name)

    def add_grant(
        self,
        principal: str,
        methods: Sequence[str],
        credential: str | None = None,
        hosts: Sequence[str] = (),
        paths: Sequence[str] = (),
        once: bool = False,
        websocket: bool = False,
        expires_at: datetime | None = None,
        purpose: str | None = None,
        encoded_slash: bool = False,
        limits: Limits = NO_LIMITS,
        body: BodyRule | None = None,
    ) -> int:
        return grants.add(
            self.db,
            principal,
            methods,
            credential,
            hosts,
            paths,
            once,
            websocket,
            expires_at,
            purpose,
            encoded_slash,
            limits,
            body,
        )

    def list_grants(self, principal: str | None = None) -> list[GrantEntry]:
        return grants.listing(self.db, principal)

    def revoke_grant(self, grant_id: int) -> bool:
        return grants.revoke(self.db, grant_id)

    def consume_once(self, grant_id: int) -> bool:
        return grants.consume_once(self.db, grant_id)

    def use_grant(self, grant_id: int) -> bool:
        return grants.use(self.db, grant_id)

    # -- token budgets ---------------------------------------------------------------

    def budget_used(self, grant_id: int, windows: Sequence[str]) -> dict[str, Usage]:
        return budgets.used(self.db, grant_id, windows)

    def charge_budget(
        self,
        grant_id: int,
        windows: Sequence[str],
        input_tokens: int,
        output_tokens: int,
        estimated: bool,
        spend_micros: int = 0,
    ) -> None:
        budgets.charge(
            self.db, grant_id, windows, input_tokens, output_tokens, estimated, spend_micros
        )

    def set_grant_budget(
        self, grant_id: int, specs: Sequence[str], cap: bool | None = None
    ) -> str | None:
        """Replace the grant's budgets with `specs` (none, and no `cap`: no budget), and
        whether they cap max_tokens (None: as they did); their description.

        Raises: InvalidInput, NotFound.
        """
        return rules_budgets.describe(grants.set_budget(self.db, grant_id, specs, cap))

    def list_budgets(self, principal: str | None = None) -> list[BudgetEntry]:
        return budgets.listing(self.db, principal)

    # -- access requests -------------------------------------------------------------

    def record_access_request(
        self,
        principal: str,
        host: str,
        port: int,
        method: str,
        path: str,
        purpose: str | None = None,
        explicit: bool = False,
    ) -> tuple[int, str] | None:
        return access_requests.record(
            self.db, principal, host, port, method, path, purpose, explicit
        )

    def get_access_request(self, principal: str, request_id: int) -> AccessRequestEntry | None:
        return access_requests.get(self.db, principal, request_id)

    def list_access_requests(self, state: str | None = None) -> list[AccessRequestEntry]:
        return access_requests.listing(self.db, state)

    def approve_access_request(
        self,
        request_id: int,
        credential: str | None = None,
        path: str | None = None,
        once: bool = False,
        expires_at: datetime | None = None,
        next_uses: int | None = None,
        cover_until: datetime | None = None,
    ) -> int | None:
        """The new grant of an access request; for a held request, the grant it waits on."""
        return self.approve_request(
            request_id, credential, path, once, expires_at, next_uses, cover_until
        )[1]

    def approve_request(
        self,
        request_id: int,
        credential: str | None = None,
        path: str | None = None,
        once: bool = False,
        expires_at: datetime | None = None,
        next_uses: int | None = None,
        cover_until: datetime | None = None,
        decided_by: str | None = None,
    ) -> tuple[str, int | None]:
        return access_requests.approve(
            self.db,
            request_id,
            credential,
            path,
            once,
            expires_at,
            next_uses,
            cover_until,
            decided_by,
        )

    def record_budget_request(
        self,
        principal: str,
        grant_id: int,
        host: str,
        port: int,
        method: str,
        path: str,
        spent: str,
    ) -> tuple[int, str]:
        return access_requests.record_budget(
            self.db, principal, grant_id, host, port, method, path, spent
        )

    def approve_budget_request(
        self, request_id: int, specs: Sequence[str], decided_by: str | None = None
    ) -> tuple[int, str | None, str]:
        """Raise (replace) the budget of a budget request's grant; (grant, was, now)."""
        return access_requests.approve_budget(self.db, request_id, list(specs), decided_by)

    # -- requests held for approval --------------------------------------------------

    def hold_request(
        self,
        principal: str,
        grant_id: int,
        host: str,
        port: int,
        method: str,
        path: str,
        seconds: int,
        share: bool,
        operation: str | None = None,
        spent: str | None = None,
    ) -> tuple[int, bool]:
        return approvals.hold(
            self.db, principal, grant_id, host, port, method, path, seconds, share, operation, spent
        )

    def hold_states(self, ids: Sequence[int]) -> dict[int, str]:
        return approvals.states(self.db, ids)

    def settle_hold(self, request_id: int) -> str:
        return approvals.settle(self.db, request_id)

    def leave_hold(self, request_id: int) -> None:
        approvals.leave(self.db, request_id)

    def use_approval(self, request_id: int) -> bool:
        return approvals.use_cover(self.db, request_id)

    def take_rates(self, buckets: Sequence[rates.Bucket], now: float) -> tuple[int, float] | None:
        return rates.take(self.db, buckets, now)

    def deny_access_request(
        self, request_id: int, reason: str | None = None, decided_by: str | None = None
    ) -> None:
        access_requests.deny(self.db, request_id, reason, decided_by)

    def decided_access_requests(self, since: datetime) -> list[AccessRequestEntry]:
        return access_requests.decided_since(self.db, since)

    # -- the proxy's view ------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        return snapshot.read(self.db, keys.need(self.key))

    def delta(self, since: int, mark: int | None = None) -> Delta | None:
        """What changed after counter `since` (whose change had `mark`); None when only a
        full snapshot can say."""
        return delta.read(self.db, keys.need(self.key), since, mark)

    def state_mark(self) -> tuple[int, int | None]:
        return self.db.state_mark()
