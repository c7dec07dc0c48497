"""Secrets held elsewhere, resolved at the edge: one Source per credential whose secret is a
reference (store/rules/secretref.py), read at start and kept current off the request path.

A file is looked at every `poll` s and read again when it changed; a remote value is fetched
again every `ttl` s. One read per source at a time (single flight), in a pool of its own.
A source is

    ok       its last read succeeded: its value is stamped
    stale    reads fail since less than `max_stale` s: the last good value is stamped still
    failing  no value to stamp (never read, or failing for longer): requests are refused
             502 credentials-unavailable

The policy holds the store's record of such a credential (no secret, `available` False);
`bind` puts the resolved one in its place, with the grants that use it, whenever a value or
its availability changes. A new value gets `credential.rotated` in the audit stream with
both keyed fingerprints; the redaction set follows the record as it follows a rotation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from addon.core.policy import Policy, Rule
from addon.observe import audit
from addon.proxy.sourcekinds import (
    MALFORMED,
    NOT_INSTALLED,
    UNAVAILABLE,
    UNREADABLE,
    Backend,
    SourceError,
)
from addon.proxy.sourcekinds import default_backends as _file_backends
from store.crypto import Secret
from store.errors import InvalidInput
from store.records import CredentialRecord, Delta, GrantRecord, Snapshot
from store.rules import secretref, validation


def _secrets_manager() -> Backend:
    # The remote backends' libraries are optional extras (aws, vault): an ImportError here is
    # reported as not-installed, for their references alone.
    from addon.proxy.remote import SecretsManager

    return SecretsManager()


def _parameter_store() -> Backend:
    from addon.proxy.remote import ParameterStore

    return ParameterStore()


def _vault() -> Backend:
    from addon.proxy.remote import Vault

    return Vault()


def default_backends() -> dict[str, Callable[[], Backend]]:
    """Each kind's backend, built when a reference of that kind is first used."""
    return {
        **_file_backends(),
        secretref.AWS_SM: _secrets_manager,
        secretref.AWS_SSM: _parameter_store,
        secretref.VAULT: _vault,
    }


PENDING, OK, STALE, FAILING = "pending", "ok", "stale", "failing"
STATES = (OK, STALE, FAILING)  # as the metrics count them: a pending source is failing


@dataclass(frozen=True)
class SourceSettings:
    poll: float = 1.0  # a file's identity is looked at this often
    ttl: float = 300.0  # a remote value is fetched again this often
    max_stale: float = 300.0  # the last good value serves this long after reads start failing
    first_fetch: float = 5.0  # how long a new reference's first read may hold a reload
    retry: float = 5.0  # a failing remote source is tried again this often (at most ttl)
    # A read still running after this long counts as failing (max-stale runs from its start);
    # it is not started again until it returns (single flight).
    read_timeout: float = 30.0


DEFAULTS = SourceSettings()


class Outcome(NamedTuple):
    identity: object
    value: Secret | None  # None: the same as before (a file whose identity did not change)
    error: str | None


class Source:
    """One credential's reference, its last good value and its state."""

    def __init__(self, record: CredentialRecord, backend: Backend) -> None:
        assert record.secret_ref is not None
        self.name, self.text = record.name, record.secret_ref
        self.ref = secretref.parse(record.secret_ref)
        self.scheme, self.options = record.scheme, record.options
        self.backend = backend
        self.value: Secret | None = None
        self.fingerprint: str | None = None
        self.identity: object = None
        self.state: str = PENDING
        self.error: str | None = None
        self.failed_since: float | None = None
        self.next_at = 0.0
        self.busy = False
        self.started: float | None = None  # when the read in flight began
        self.overdue = False  # that read ran past read_timeout and was counted as failing

    def __repr__(self) -> str:
        return f"Source({self.name!r}, {self.text!r}, {self.state})"

    def same(self, record: CredentialRecord) -> bool:
        return (self.text, self.scheme, self.options) == (
            record.secret_ref,
            record.scheme,
            record.options,
        )

    def usable(self) -> bool:
        return self.value is not None and self.state in (OK, STALE)

    def served(self) -> tuple[str | None, bool]:
        return self.fingerprint, self.usable()

    def check(self) -> Outcome:
        """One read, in a thread; never raises."""
        identity: object = None
        try:
            if self.backend.watched:
                identity = self.backend.identity(self.ref)
                if identity == self.identity and self.value is not None:
                    return Outcome(identity, None, None)
            raw = self.backend.fetch(self.ref)
            value = validation.scheme_secret(self.scheme, Secret(raw), self.options)
        except SourceError as e:
            return Outcome(None, None, e.kind)
        except InvalidInput:  # our own words, but about the value: classified all the same
            return Outcome(None, None, MALFORMED)
        except Exception:  # noqa: BLE001 - fail closed: a read that broke is a failing read
            return Outcome(None, None, UNREADABLE)
        return Outcome(identity, value, None)


class Sources:
    """Every referenced credential's Source, and the task that keeps them current."""

    def __init__(
        self,
        fingerprint: Callable[[Secret], str],
        settings: SourceSettings = DEFAULTS,
        backends: Mapping[str, Callable[[], Backend]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._fingerprint = fingerprint
        self._makers = dict(backends or default_backends())
        self._backends: dict[str, Backend] = {}
        self._clock = clock
        self._sources: dict[str, Source] = {}
        self._resolved: dict[str, tuple[CredentialRecord, str | None, CredentialRecord]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._log = audit.logger()
        self.on_change: Callable[[], None] = lambda: None

    def __repr__(self) -> str:
        return f"Sources({len(self._sources)} references)"

    # -- which credentials --------------------------------------------------------------

    def track(self, records: Iterable[CredentialRecord]) -> list[Source]:
        """Follow these records' references (and no others); returns the new Sources."""
        wanted = {r.name: r for r in records if r.secret_ref is not None}
        for name in [n for n in self._sources if n not in wanted]:
            del self._sources[name]
            self._resolved.pop(name, None)
        new = []
        for name, record in wanted.items():
            found = self._sources.get(name)
            if found is None or not found.same(record):
                self._sources[name] = found = Source(record, self.backend(record))
                self._resolved.pop(name, None)
                new.append(found)
        return new

    def backend(self, record: CredentialRecord) -> Backend:
        kind = secretref.parse(record.secret_ref or "").kind
        if kind not in self._backends:
            maker = self._makers.get(kind)
            try:
                if maker is None:
                    raise ImportError(kind)
                self._backends[kind] = maker()
            except ImportError:
                return _Missing()
        return self._backends[kind]

    def resolved(self, record: CredentialRecord) -> CredentialRecord:
        """The record with its source's value in, or as it is when there is none to serve."""
        source = self._sources.get(record.name)
        if source is None or not source.usable():
            return record
        cached = self._resolved.get(record.name)
        if cached is not None and cached[0] is record and cached[1] == source.fingerprint:
            return cached[2]
        assert source.value is not None and source.fingerprint is not None
        found = dataclasses.replace(
            record, secret=source.value, fingerprint=source.fingerprint, available=True
        )
        self._resolved[record.name] = (record, source.fingerprint, found)
        return found

    def refingerprint(self) -> None:
        """Each held value fingerprinted again, under the key the store is read with now (a
        master-key rotation): stamped with it, and what the next read is compared with."""
        for source in self._sources.values():
            if source.value is not None:
                source.fingerprint = self._fingerprint(source.value)

    def report(self) -> list[tuple[str, str, str, str | None]]:
        """(credential, reference, state, error) of every source, by name."""
        return [(s.name, s.text, s.state, s.error) for _, s in sorted(self._sources.items())]

    def count(self, state: str) -> int:
        if state == FAILING:
            return sum(s.state in (FAILING, PENDING) for s in self._sources.values())
        return sum(s.state == state for s in self._sources.values())

    # -- reading ------------------------------------------------------------------------

    def load(self, sources: Iterable[Source]) -> None:
        """First reads before the proxy listens (a remote one bounded by its client's
        timeouts)."""
        for source in sources:
            self._settle(source, source.check())

    async def first(self, sources: list[Source]) -> None:
        """New references' first reads, before the reload that brings them in is served;
        at most `first_fetch` s. One that has not answered by then is failing until it does."""
        if not sources:
            return
        loop = asyncio.get_running_loop()
        waits = [loop.run_in_executor(self._pool(), s.check) for s in sources]
        for source in sources:
            source.busy, source.started = True, self._clock()
        done, _ = await asyncio.wait(waits, timeout=self.settings.first_fetch)
        for source, wait in zip(sources, waits, strict=True):
            if wait in done:
                source.busy = False
                self._settle(source, wait.result())
            else:
                wait.add_done_callback(partial(self._finished, source))

    async def run(self) -> None:
        """Look at each source when it is due, for as long as the proxy runs."""
        while True:
            self.tick()
            await asyncio.sleep(self.settings.poll)

    def tick(self) -> None:
        now, changed = self._clock(), False
        loop = asyncio.get_running_loop()
        for source in list(self._sources.values()):
            if source.state == STALE and self._expired(source, now):
                changed |= self._fail(source, now)
            if source.busy and not source.overdue and self._overdue(source, now):
                # A hung read (a backend that never answers): failing from now on, so that
                # max-stale ends the last value's service as for any failing read.
                source.overdue = True
                changed |= self._settle(source, Outcome(None, None, UNAVAILABLE))
            if source.busy or now < source.next_at:
                continue
            source.busy, source.started, source.overdue = True, now, False
            future = self._pool().submit(source.check)
            future.add_done_callback(partial(_on_loop, loop, self._finished_future, source))
        if changed:
            self.on_change()

    def _overdue(self, source: Source, now: float) -> bool:
        started = source.started
        # Written so that a NaN reads as overdue: fail closed.
        return started is not None and not now - started <= self.settings.read_timeout

    def _finished_future(self, source: Source, future: Future[Outcome]) -> None:
        source.busy, source.started, source.overdue = False, None, False
        if self._sources.get(source.name) is source and self._settle(source, future.result()):
            self.on_change()

    def _finished(self, source: Source, wait: asyncio.Future[Outcome]) -> None:
        source.busy, source.started, source.overdue = False, None, False
        if wait.cancelled() or wait.exception() is not None:
            return
        if self._sources.get(source.name) is source and self._settle(source, wait.result()):
            self.on_change()

    def _settle(self, source: Source, outcome: Outcome) -> bool:
        """The read's outcome; whether what is stamped changed."""
        now, before = self._clock(), source.served()
        settings = self.settings
        if outcome.error is None:
            if outcome.value is not None:
                fp = self._fingerprint(outcome.value)
                if source.fingerprint is not None and fp != source.fingerprint:
                    self._log.info(
                        "credential.rotated",
                        credential=source.name,
                        source=source.ref.kind,
                        old_fp=source.fingerprint,
                        new_fp=fp,
                    )
                source.value, source.fingerprint = outcome.value, fp
            if source.state in (STALE, FAILING):
                self._log.info("secret_source.recovered", credential=source.name)
            source.identity, source.state, source.error = outcome.identity, OK, None
            source.failed_since = None
            source.next_at = now + (settings.poll if source.backend.watched else settings.ttl)
        else:
            if source.failed_since is None or source.error != outcome.error:
                self._log.warning(
                    "secret_source.failing",
                    credential=source.name,
                    source=source.ref.kind,
                    error=outcome.error,
                    max_stale_s=settings.max_stale,
                )
            if source.failed_since is None:
                source.failed_since = now
            source.identity, source.error = None, outcome.error  # the next good read re-reads
            if source.value is not None and not self._expired(source, now):
                source.state = STALE
            else:
                source.state = FAILING
            retry = min(settings.ttl, settings.retry)
            source.next_at = now + (settings.poll if source.backend.watched else retry)
        return source.served() != before

    def _expired(self, source: Source, now: float) -> bool:
        # Written so that a NaN reads as expired: fail closed.
        since = source.failed_since
        return since is not None and not now - since <= self.settings.max_stale

    def _fail(self, source: Source, now: float) -> bool:
        source.state = FAILING
        self._log.error("secret_source.stale_expired", credential=source.name)
        return True

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            # Enough that a few slow backends (bounded by their timeouts) do not hold up the
            # others' reads.
            self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="credproxy-src")
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _on_loop(
    loop: asyncio.AbstractEventLoop,
    then: Callable[[Source, Future[Outcome]], None],
    source: Source,
    future: Future[Outcome],
) -> None:
    loop.call_soon_threadsafe(then, source, future)


class _Missing:
    """A kind whose optional client library is not installed: always failing, one class."""

    watched = False

    def identity(self, ref: secretref.SecretRef) -> object:
        raise SourceError(NOT_INSTALLED)

    def fetch(self, ref: secretref.SecretRef) -> bytes:
        raise SourceError(NOT_INSTALLED)


# -- the policy's side: which grants use a referenced credential ----------------------------


@dataclass
class Binding:
    """A policy's referenced credentials: name -> (row id, the store's record, grant ids)."""

    held: dict[str, tuple[int, CredentialRecord, set[int]]] = dataclasses.field(
        default_factory=dict
    )


_BINDINGS: weakref.WeakKeyDictionary[Policy, Binding] = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # a full read records its binding in a thread


def bound(policy: Policy, snapshot: Snapshot) -> None:
    """Record what the policy built from `snapshot` holds of referenced credentials."""
    ids = {name: cid for cid, name in snapshot.credential_ids.items()}
    held: dict[str, tuple[int, CredentialRecord, set[int]]] = {
        name: (ids[name], record, set())
        for name, record in snapshot.credentials.items()
        if record.secret_ref is not None
    }
    if held:
        for grant in snapshot.grants:
            if grant.credential in held:
                held[grant.credential][2].add(grant.id)
    with _lock:
        _BINDINGS[policy] = Binding(held)


def applied(policy: Policy, delta: Delta) -> None:
    """Follow a store delta the policy was brought up to date with."""
    with _lock:
        binding = _BINDINGS.setdefault(policy, Binding())
    held = binding.held
    for cid, found in delta.credentials.items():
        for name in [n for n, (i, _, _) in held.items() if i == cid]:
            del held[name]
        if isinstance(found, CredentialRecord) and found.secret_ref is not None:
            held[found.name] = (cid, found, set())
    for gid, grant in delta.grants.items():
        for _, _, gids in held.values():
            gids.discard(gid)
        if grant is not None and grant.credential in held:
            held[grant.credential][2].add(gid)


def referenced(policy: Policy) -> list[CredentialRecord]:
    """The store's records of the policy's referenced credentials."""
    with _lock:
        binding = _BINDINGS.get(policy)
    return [record for _, record, _ in binding.held.values()] if binding else []


def bind(policy: Policy, sources: Sources) -> bool:
    """Put each referenced credential's resolved record in the policy, with the grants that
    use it, where it is not in already; whether anything changed."""
    with _lock:
        binding = _BINDINGS.get(policy)
    if binding is None or not binding.held:
        return False
    credentials: dict[int, CredentialRecord | str | None] = {}
    grants: dict[int, GrantRecord | None] = {}
    for name, (cid, record, gids) in binding.held.items():
        wanted = sources.resolved(record)
        if policy.credentials.get(name) is wanted:
            continue
        credentials[cid] = wanted
        for gid in gids:
            owner, rule = policy.owner(gid), policy.rule(gid)
            # Only a grant the policy holds now, for this credential: never one brought back.
            if owner is not None and rule is not None and rule.credential is not None:
                if rule.credential.name == name:
                    grants[gid] = regrant(rule, owner)
    if not credentials:
        return False
    policy.apply(
        Delta(
            counter=policy.counter,
            key_id=policy.key_id,
            changes=0,
            principals={},
            tokens={},
            credentials=credentials,
            grants=grants,
            mark=policy.mark,
        )
    )
    return True


def regrant(rule: Rule, principal: str) -> GrantRecord:
    """The grant a rule was compiled from, as far as compiling it again gives the same rule
    (GET's HEAD and every method's `*` come back as they were)."""
    assert rule.credential is not None
    return GrantRecord(
        id=rule.grant_id,
        principal=principal,
        credential=rule.credential.name,
        hosts=rule.hosts,
        methods=frozenset({"*"}) if rule.methods is None else rule.methods,
        paths=rule.paths,
        once=rule.once,
        websocket=rule.websocket,
        expires_at=rule.expires_at,
        consumed=rule.consumed,
        encoded_slash=rule.encoded_slash,
        rate=rule.rate,
        burst=rule.burst,
        max_uses=rule.max_uses,
        approval=rule.approval,
        hold=rule.hold or None,
        body=rule.body,
    )


def describe(report: Iterable[tuple[str, str, str, str | None]]) -> Iterable[str]:
    """One line per reference that cannot be read, as `run` prints them at start."""
    for name, ref, state, error in report:
        if state != OK:
            yield f"credential {name}: its secret at {ref} is {state} ({error or 'not read'})"
