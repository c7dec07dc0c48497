"""The decision: a principal's compiled grants + the facts of one request -> allow or deny.

Pure: imports neither mitmproxy nor SQLAlchemy, so the hostile-input table can test it alone.

One module, about 530 lines: the compiled policy, its incremental update and the decision
share one index; the decision's single pass must read the structures it was built with.
"""

from __future__ import annotations

import hmac
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple
from urllib.parse import unquote_to_bytes

from addon.core.reasons import Reason
from store.crypto import Secret, hash_token, token_matches
from store.records import (
    TOMBSTONE_RETENTION,
    Coverage,
    CredentialRecord,
    Delta,
    GrantRecord,
    SessionToken,
    Snapshot,
)
from store.rules.bodyrules import BodyRule
from store.rules.budgets import Budget
from store.rules.grammar import HostPattern, Rate, path_matches
from store.rules.mintspec import MINTED, token_version

DEFAULT_PORTS = {"https": 443, "http": 80}


def long_lived(principal_id: int) -> int:
    """The id of the token `principal add` made: minus its principal's id (session tokens have
    ids from 1). A name removed and added again is another principal, its token another id."""
    return -principal_id


CANDIDATE_CACHE = 1024


@dataclass(frozen=True)
class Rule:
    """One grant, compiled: everything the hot path needs, nothing it must look up."""

    grant_id: int
    credential: CredentialRecord | None
    hosts: tuple[HostPattern, ...]
    methods: frozenset[str] | None  # None: every method
    paths: tuple[str, ...]
    once: bool
    websocket: bool
    expires_at: datetime | None
    consumed: bool = False
    encoded_slash: bool = False  # a `*` may match a segment holding %2F
    rate: Rate | None = None
    burst: int | None = None
    max_uses: int | None = None
    approval: str | None = None  # each or first: requests wait for an owner
    hold: int = 0  # seconds they wait
    body: BodyRule | None = None  # what the body may ask: decided once the body is in
    budget: Budget | None = None  # token budgets: checked before forwarding, charged after

    def allows_host(self, host: str, port: int, scheme: str) -> bool:
        default = DEFAULT_PORTS.get(scheme, 443)
        if not any(h.matches(host, port, default) for h in self.hosts):
            return False
        # The credential's own hosts bound every grant that uses it, whatever the grant says.
        return self.credential is None or any(
            h.matches(host, port, 443) for h in self.credential.hosts
        )

    def allows_method(self, method: str) -> bool:
        return self.methods is None or method in self.methods

    def longest_path(self, path: str) -> int:
        slash = self.encoded_slash
        return max((len(p) for p in self.paths if path_matches(p, path, slash)), default=-1)


class Request(NamedTuple):
    """The facts of one request, already canonical: lower-case host, canonical path."""

    host: str
    port: int
    scheme: str
    method: str
    path: str
    upgrade: bool = False


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: Reason | None = None
    detail: str = ""
    rule: Rule | None = None
    # The body decides: the rules that allow the rest, in the order they are preferred, up to
    # the first without a body rule (which allows any body). `rule` is the first of them.
    pending: tuple[Rule, ...] = ()

    @classmethod
    def deny(cls, reason: Reason, detail: str) -> Decision:
        return cls(False, reason, detail)


# Why no candidate is left, by how far the furthest one got (see Policy.decide). Expired and
# used grants are tombstones checked last: one that matches the request names its own state,
# whatever the other grants on the host say, on every replica and after every restart.
_STAGE_DENIALS = (
    Decision.deny(Reason.NO_GRANT, "no grant for this host and port"),
    Decision.deny(Reason.METHOD_NOT_ALLOWED, "no grant allows this method here"),
    Decision.deny(Reason.PATH_NOT_ALLOWED, "no grant allows this path"),
    Decision.deny(Reason.UPGRADE_NOT_ALLOWED, "no grant allows protocol upgrades here"),
    Decision.deny(Reason.INSECURE_SCHEME, "credentials are only sent over https"),
    Decision.deny(Reason.GRANT_EXPIRED, "the grant for this request has expired"),
    Decision.deny(Reason.GRANT_CONSUMED, "this grant was already used up"),
)


@dataclass
class PrincipalPolicy:
    """A principal's rules, indexed by exact host and by wildcard suffix.

    Never changed once a Policy serves it: a change builds the principal a new one
    (Policy.apply), so a decision reads one version of the principal's rules throughout.
    """

    exact: dict[str, list[Rule]] = field(default_factory=lambda: defaultdict(list))
    wildcard: dict[str, list[Rule]] = field(default_factory=lambda: defaultdict(list))
    rules: dict[int, Rule] = field(default_factory=dict)  # by grant id
    # (host, port, scheme) -> candidates; the rules never change, so this never goes stale.
    # Hosts come from agents: bounded, cleared whole when full.
    _found: dict[tuple[str, int, str], tuple[Rule, ...]] = field(default_factory=dict)

    def changed(self, changes: dict[int, Rule | None]) -> PrincipalPolicy | None:
        """A new PrincipalPolicy: this one with `changes` (None: the grant is gone), or None
        when no rule is left. Only the index entries of the hosts the changed rules name are
        built again; the others are shared with this one (built lists are never changed)."""
        rules = {**self.rules}
        touched: set[tuple[bool, str]] = set()
        for gid, rule in changes.items():
            for found in (rules.pop(gid, None), rule):
                if found is not None:
                    touched.update(_buckets(found))
            if rule is not None:
                rules[gid] = rule
        if not rules:
            return None
        built = PrincipalPolicy(
            exact=defaultdict(list, self.exact),
            wildcard=defaultdict(list, self.wildcard),
            rules=rules,
        )
        for wildcard, host in touched:
            index = built.wildcard if wildcard else built.exact
            index[host] = [r for r in index.get(host, ()) if r.grant_id not in changes]
        for rule in changes.values():
            if rule is not None:
                for wildcard, host in _buckets(rule):
                    (built.wildcard if wildcard else built.exact)[host].append(rule)
        for wildcard, host in touched:
            index = built.wildcard if wildcard else built.exact
            if not index[host]:
                del index[host]
        return built

    def add(self, rule: Rule) -> None:
        self.rules[rule.grant_id] = rule
        for pattern in rule.hosts:
            if pattern.wildcard:
                self.wildcard[pattern.host[1:]].append(rule)
            else:
                self.exact[pattern.host].append(rule)

    def candidates(self, host: str, port: int, scheme: str) -> tuple[Rule, ...]:
        """The rules whose hosts (and credential's hosts) admit host:port, each once."""
        key = (host, port, scheme)
        found = self._found.get(key)
        if found is None:
            if len(self._found) >= CANDIDATE_CACHE:
                self._found.clear()
            found = self._found[key] = tuple(self._scan(host, port, scheme))
        return found

    def _scan(self, host: str, port: int, scheme: str) -> Iterator[Rule]:
        seen: set[int] = set()
        dot = host.find(".")
        buckets = [self.exact.get(host, ())]
        if dot > 0:
            buckets.append(self.wildcard.get(host[dot:], ()))
        for bucket in buckets:
            for rule in bucket:
                if rule.grant_id not in seen and rule.allows_host(host, port, scheme):
                    seen.add(rule.grant_id)
                    yield rule


class Policy:
    """The store compiled for the hot path: built whole from a Snapshot, then brought up to
    date by Delta after Delta (`apply`), each in time proportional to what it changed."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.counter = snapshot.counter
        self.key_id = snapshot.key_id
        self.mark = snapshot.mark
        self._tokens = dict(snapshot.token_hashes)
        self._principal_names = dict(snapshot.principal_ids)
        self._principal_ids = {name: pid for pid, name in snapshot.principal_ids.items()}
        self._sessions = {
            name: {t.id: t for t in found} for name, found in snapshot.sessions.items()
        }
        self._session_owner = {t.id: n for n, found in snapshot.sessions.items() for t in found}
        self._limits = dict(snapshot.principal_limits)
        self._coverage = snapshot.coverage
        self._credentials = dict(snapshot.credentials)
        self._credential_names = dict(snapshot.credential_ids)
        self._unreadable = set(snapshot.unreadable)
        self._versions: dict[str, str] = {}
        for credential in self._credentials.values():
            self._version(credential)
        self.path_secrets = self._path_secrets()
        self._principals: dict[str, PrincipalPolicy] = {}
        self._owner: dict[int, str] = {}  # grant id -> principal
        for grant in snapshot.grants:
            rules = self._principals.get(grant.principal)
            if rules is None:
                rules = self._principals[grant.principal] = PrincipalPolicy()
            rules.add(_compile(grant, self._credentials))
            self._owner[grant.id] = grant.principal
        self._allowed: dict[int, Decision] = {}

    @property
    def grant_count(self) -> int:
        return len(self._owner)

    @property
    def unreadable(self) -> tuple[str, ...]:
        return tuple(sorted(self._unreadable))

    @property
    def credentials(self) -> Mapping[str, CredentialRecord]:
        """The readable credentials, by name."""
        return self._credentials

    @property
    def token_versions(self) -> Mapping[str, str]:
        """Each readable minted credential's token_version (secret fingerprint, scheme,
        settings): tokens minted for another are dropped. Kept as credentials change, so that
        a change costs its own credentials' versions, not every credential's."""
        return self._versions

    def _version(self, credential: CredentialRecord) -> None:
        if credential.scheme in MINTED:
            self._versions[credential.name] = token_version(credential)

    def _path_secrets(self) -> tuple[Secret, ...]:
        # Secrets that go in a path (--scheme path): a target carrying one is refused by the
        # gate, in any encoding, before its path is written anywhere.
        return tuple(c.secret for c in self._credentials.values() if c.scheme == "path")

    def apply(self, delta: Delta) -> None:
        """Bring the policy to `delta.counter`. Runs on the event loop, between decisions:
        a principal whose rules change gets a new PrincipalPolicy, never an edited one."""
        for pid in delta.principals:
            gone = self._principal_names.pop(pid, None)
            if gone is not None:
                self._principal_ids.pop(gone, None)
                self._tokens.pop(gone, None)
                self._limits.pop(gone, None)
                self._sessions.pop(gone, None)  # its tokens are in the delta with it
        for pid, principal in delta.principals.items():
            if principal is not None:
                self._principal_names[pid] = name = principal.name
                self._principal_ids[name] = pid
                self._tokens[name] = principal.token_hash
                if principal.limit is not None:
                    self._limits[name] = principal.limit
        for tid, token in delta.tokens.items():
            owner = self._session_owner.pop(tid, None)
            held = self._sessions.get(owner) if owner is not None else None
            if owner is not None and held is not None and tid in held:
                self._sessions[owner] = {i: t for i, t in held.items() if i != tid}
            if token is not None:
                name, session = token
                self._sessions[name] = {**self._sessions.get(name, {}), tid: session}
                self._session_owner[tid] = name
        for cid in delta.credentials:
            old = self._credential_names.pop(cid, None)
            if old is not None:
                self._credentials.pop(old, None)
                self._versions.pop(old, None)
                self._unreadable.discard(old)
        for cid, found in delta.credentials.items():
            if isinstance(found, str):
                self._credential_names[cid] = found
                self._unreadable.add(found)
            elif found is not None:
                self._credential_names[cid] = found.name
                self._credentials[found.name] = found
                self._version(found)
        if delta.credentials:
            self.path_secrets = self._path_secrets()
        changed: dict[str, dict[int, Rule | None]] = {}
        for gid, grant in delta.grants.items():
            owner = self._owner.pop(gid, None)
            if owner is not None:
                changed.setdefault(owner, {})[gid] = None
            credential = None
            if grant is not None and grant.credential is not None:
                credential = self._credentials.get(grant.credential)
                if credential is None:
                    continue  # as in a full read: no readable credential, no grant
            if grant is not None:
                changed.setdefault(grant.principal, {})[gid] = _rule(grant, credential)
                self._owner[gid] = grant.principal
        for name, rules in changed.items():
            # In time proportional to the change: a principal's other rules are shared.
            built = self._principals.get(name, PrincipalPolicy()).changed(rules)
            if built is not None:
                self._principals[name] = built
            else:
                self._principals.pop(name, None)
        if delta.coverage is not None:
            self._coverage = delta.coverage
        self.counter, self.key_id, self.mark = delta.counter, delta.key_id, delta.mark

    def current(self, credential: CredentialRecord) -> bool:
        """Whether `credential` is this policy's record of it (not a rotated one's)."""
        return self._credentials.get(credential.name) is credential

    def authenticate(self, name: str, token: str, now: datetime | None = None) -> bool:
        return self.token_of(name, token, now or datetime.now(UTC)) is not None

    def token_of(self, name: str, token: str, now: datetime) -> int | None:
        """Which live token of `name` this is (its `long_lived` id, or a session's), or None."""
        token_hash = self._tokens.get(name)
        # Compare against a dummy when the name is unknown, so timing does not reveal names.
        if token_matches(token, token_hash or "0" * 64) and token_hash is not None:
            return long_lived(self._principal_ids.get(name, 0))
        sessions = self._sessions.get(name)
        if sessions:
            digest = hash_token(token)
            for session in sessions.values():
                if hmac.compare_digest(digest, session.token_hash) and _unexpired(session, now):
                    return session.id
        return None

    def token_live(self, name: str, token_id: int, now: datetime) -> bool:
        """Is the token a connection authenticated with still live (not revoked, expired)?"""
        if name not in self._tokens:
            return False
        if token_id < 1:  # the principal's own token: the principal it was checked against
            return long_lived(self._principal_ids.get(name, 0)) == token_id
        session = self._sessions.get(name, {}).get(token_id)
        return session is not None and _unexpired(session, now)

    def may_connect(self, principal: str, host: str, port: int) -> bool:
        """The CONNECT gate: does any grant name this host and port (on https)?

        Nothing is dialled for a tunnel; the requests inside it are told precisely why
        (grant-expired, grant-consumed) rather than the CONNECT failing without a reason.
        """
        rules = self._principals.get(principal)
        return rules is not None and bool(rules.candidates(host, port, "https"))

    def decide(self, principal: str, request: Request, now: datetime) -> Decision:
        rules = self._principals.get(principal)
        matching = rules.candidates(request.host, request.port, request.scheme) if rules else ()
        if not matching:
            if request.scheme == "http" and rules and self._granted_on_https(rules, request):
                return Decision.deny(Reason.INSECURE_SCHEME, "credentials are only sent over https")
            return Decision.deny(Reason.NO_GRANT, "no grant for this host and port")
        # One pass over the candidates. Each check narrows the rules still in play, in the
        # order of _STAGE_DENIALS; when none is left, the reason is the check that stopped
        # the rule that got furthest.
        furthest = 0
        best: Rule | None = None
        best_key: tuple[bool, int, bool, int] | None = None
        bodied: list[tuple[tuple[bool, int, bool, int], Rule]] | None = None
        method, path = request.method, request.path
        # The store forgets a grant TOMBSTONE_RETENTION after it expired; so does a policy
        # that has not been reloaded since.
        forgotten = now - TOMBSTONE_RETENTION
        for r in matching:
            if r.expires_at is not None and r.expires_at <= forgotten:
                continue
            furthest = max(furthest, 1)
            if r.methods is not None and method not in r.methods:
                continue
            furthest = max(furthest, 2)
            n = r.longest_path(path)
            if n < 0:
                continue
            furthest = max(furthest, 3)
            if request.upgrade and not r.websocket:
                continue
            furthest = max(furthest, 4)
            if request.scheme != "https" and r.credential is not None:
                continue  # credentials are only sent over https
            furthest = max(furthest, 5)
            if r.expires_at is not None and r.expires_at <= now:
                continue
            furthest = max(furthest, 6)
            if r.consumed:
                continue
            # Standing grants before once- and use-counted grants (never burn a use
            # needlessly), then the most specific path, then a credential over none, then the
            # oldest grant.
            key = (r.once or r.max_uses is not None, -n, r.credential is None, r.grant_id)
            if r.body is not None:
                # Not a candidate until its body is read: set aside, in preference order.
                if bodied is None:
                    bodied = []
                bodied.append((key, r))
                continue
            if best_key is None or key < best_key:
                best, best_key = r, key
        if bodied is not None:
            return self._pending(bodied, best, best_key)
        if best is None:
            return _STAGE_DENIALS[furthest]
        allowed = self._allowed.get(best.grant_id)
        if allowed is None or allowed.rule is not best:
            allowed = self._allowed[best.grant_id] = Decision(True, rule=best)
        return allowed

    @staticmethod
    def _pending(
        bodied: list[tuple[tuple[bool, int, bool, int], Rule]],
        best: Rule | None,
        best_key: tuple[bool, int, bool, int] | None,
    ) -> Decision:
        """Rules with body rules preferred to the best rule without one: the body decides
        between them (`decide_body`); that best rule, if any, is the last resort."""
        ahead = sorted(
            (item for item in bodied if best_key is None or item[0] < best_key),
            key=lambda item: item[0],
        )
        if not ahead:
            assert best is not None
            return Decision(True, rule=best)
        pending = tuple(r for _, r in ahead) + ((best,) if best is not None else ())
        return Decision(True, rule=pending[0], pending=pending)

    @staticmethod
    def _granted_on_https(rules: PrincipalPolicy, request: Request) -> bool:
        port = 443 if request.port == 80 else request.port
        return bool(rules.candidates(request.host, port, "https"))

    def carries_path_secret(self, target: bytes) -> bool:
        decoded = unquote_to_bytes(target)
        return any(s.reveal() in target or s.reveal() in decoded for s in self.path_secrets)

    def owner(self, grant_id: int) -> str | None:
        """The principal the grant belongs to now (a policy file may move a grant)."""
        return self._owner.get(grant_id)

    def rule(self, grant_id: int) -> Rule | None:
        """The grant's compiled rule, if the policy holds it (a tombstone included)."""
        owner = self._owner.get(grant_id)
        rules = self._principals.get(owner) if owner is not None else None
        return rules.rules.get(grant_id) if rules is not None else None

    def covering(
        self,
        grant_id: int,
        method: str,
        host: str,
        port: int,
        path: str,
        now: datetime,
        operation: str | None = None,
    ) -> Coverage | None:
        """An owner's approval that lets this request of a `first` grant go without a hold.
        For a grant with a body rule, the kind includes what the body asked (`operation`)."""
        kind = (method, host, port, path, operation)
        for found in self._coverage.get(grant_id, ()):
            if (found.method, found.host, found.port, found.path, found.operation) == kind:
                if found.until is None or now < found.until:
                    return found
        return None

    def principal_limit(self, principal: str) -> tuple[Rate, int | None] | None:
        """The principal's own rate and burst, if it has one."""
        return self._limits.get(principal)

    def principals(self) -> Iterable[str]:
        return self._tokens.keys()


def _buckets(rule: Rule) -> Iterator[tuple[bool, str]]:
    """The index entries a rule is found under: (wildcard, host or suffix)."""
    for pattern in rule.hosts:
        yield (True, pattern.host[1:]) if pattern.wildcard else (False, pattern.host)


def _unexpired(session: SessionToken, now: datetime) -> bool:
    return session.expires_at is None or now < session.expires_at


def _compile(grant: GrantRecord, credentials: dict[str, CredentialRecord]) -> Rule:
    return _rule(grant, credentials[grant.credential] if grant.credential else None)


def _rule(grant: GrantRecord, credential: CredentialRecord | None) -> Rule:
    return Rule(
        grant_id=grant.id,
        credential=credential,
        hosts=grant.hosts,
        methods=None if "*" in grant.methods else _with_head(grant.methods),
        paths=grant.paths,
        once=grant.once,
        websocket=grant.websocket,
        expires_at=grant.expires_at,
        consumed=grant.consumed,
        encoded_slash=grant.encoded_slash,
        rate=grant.rate,
        burst=grant.burst,
        max_uses=grant.max_uses,
        approval=grant.approval,
        hold=grant.hold or 0,
        body=grant.body,
        budget=grant.budget,
    )


def _with_head(methods: frozenset[str]) -> frozenset[str]:
    """GET allows HEAD: a HEAD discloses nothing the GET does not (uv probes wheels with it)."""
    return methods | {"HEAD"} if "GET" in methods else methods
