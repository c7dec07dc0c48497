"""The live policy: a compiled snapshot of the store, kept up to date as its counter moves.

A change is applied from the store's change log (store/db/delta.py, Policy.apply), in time
proportional to it. The whole store is read when the log cannot say (a gap, a key rotation,
a policy file, a restored file, SIGHUP), and every `full_interval` s after changes as the
safety net: that read runs beside the incremental updates, which it then catches up with.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar

from addon.core import bodies
from addon.core.policy import Policy
from addon.core.responsive import responsive
from addon.core.usage import Charge
from addon.observe import audit
from addon.proxy import sources
from addon.proxy.sources import Sources, SourceSettings
from addon.redaction.redactset import SETS
from addon.schemes.mint import TOKENS
from addon.schemes.stamping import redacted
from store.crypto import MasterKey, Secret
from store.errors import CredproxyError, StoreUnavailable
from store.records import Usage
from store.repository import Store

T = TypeVar("T")

# A database that accepts but never answers must not hold a request or the poll forever.
DB_TIMEOUT = 5.0
# Thread pools left behind to calls stuck past their deadline, at most (4 threads each).
MAX_ABANDONED = 16
# The periodic full reload, and how long a full read may take.
FULL_INTERVAL = 60.0
FULL_TIMEOUT = 60.0
FULL, INCREMENTAL = "full", "incremental"


class LivePolicy:
    """Serves the last good Policy for at most `max_stale` s once the store stops answering."""

    def __init__(
        self,
        store: Store,
        *,
        max_stale: float = 30.0,
        poll_interval: float = 0.5,
        reload_key: Callable[[], MasterKey] | None = None,
        full_interval: float = FULL_INTERVAL,
        source_settings: SourceSettings = sources.DEFAULTS,
    ) -> None:
        self.store = store
        self.max_stale = max_stale
        self.poll_interval = poll_interval
        self.full_interval = full_interval
        self._full: asyncio.Future[Policy] | None = None  # a periodic full read under way
        self._full_at = time.monotonic()
        self._full_counter = -1
        self._polling = asyncio.Lock()
        self._owed = False  # a forced full read that has not been served yet
        self._reload_key = reload_key
        # Database calls never run on the event loop; a pool of their own so a hung database
        # cannot starve anything else that uses the default executor.
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="credproxy-db")
        self.policy: Policy | None = None
        self.last_ok = 0.0
        self.store_up = True
        self._stale_reported = False
        self._log = audit.logger()
        self.on_reload: Callable[[], None] = lambda: None
        # Access-request decisions already written to the audit stream.
        self._decided_since = datetime.now(UTC)
        # Secrets held elsewhere (file:, aws-sm:, vault: references), fingerprinted under
        # whatever key the store is read with now.
        self.sources = Sources(self._fingerprint, source_settings)
        self._fingerprinted_with: str | None = None  # the key id of the sources' fingerprints
        self.sources.on_change = self._sources_changed

    def load(self) -> Policy:
        """Synchronous first load, before the proxy listens; raises CredproxyError."""
        policy = self._build()
        self._install(policy, policy.counter)
        return policy

    def current(self) -> Policy | None:
        """The policy to decide with, or None when it is older than --max-stale."""
        # Written so that a NaN limit reads as stale: fail closed, whatever slipped through.
        if self.policy is None or not time.monotonic() - self.last_ok <= self.max_stale:
            return None
        return self.policy

    async def call(self, fn: Callable[..., T], *args: Any, timeout: float = DB_TIMEOUT) -> T:
        """Run a store call in the database pool; StoreUnavailable after `timeout` s."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError as e:
            self._abandon()
            raise StoreUnavailable(f"the store did not answer within {timeout:g} s") from e

    def _abandon(self) -> None:
        """A call past its deadline may hold a thread and a connection that never come back
        (a connection gone silent after a failover): leave both behind, start afresh."""
        global _abandoned
        _abandoned += 1
        if _abandoned > MAX_ABANDONED:
            return  # a bound on stuck threads: later calls queue, and time out, behind them
        # Not cancel_futures: a queued call's own caller would get CancelledError, not its
        # timeout (the poller would die of it). Its deadline ends it like any other.
        self._executor.shutdown(wait=False)
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="credproxy-db")
        self.store.engine.dispose(close=False)  # new connections; the stuck ones stay theirs

    async def consume_once(self, grant_id: int) -> bool:
        """Raises StoreUnavailable when the store cannot say."""
        try:
            return await self.call(self.store.consume_once, grant_id)
        except CredproxyError as e:
            self._down(e)
            raise

    async def use_grant(self, grant_id: int) -> bool:
        """Raises StoreUnavailable when the store cannot say."""
        try:
            return await self.call(self.store.use_grant, grant_id)
        except CredproxyError as e:
            self._down(e)
            raise

    async def budget_used(self, grant_id: int, windows: list[str]) -> dict[str, Usage]:
        """Raises StoreUnavailable when the store cannot say."""
        try:
            return await self.call(self.store.budget_used, grant_id, windows)
        except CredproxyError as e:
            self._down(e)
            raise

    async def charge_budget(
        self, grant_id: int, windows: list[str], charge: Charge, spend_micros: int = 0
    ) -> None:
        """Raises StoreUnavailable when the store did not take it."""
        try:
            await self.call(
                self.store.charge_budget,
                grant_id,
                windows,
                charge.input_tokens,
                charge.output_tokens,
                charge.estimated,
                spend_micros,
            )
        except CredproxyError as e:
            self._down(e)
            raise

    async def run(self) -> None:
        resolving = asyncio.get_running_loop().create_task(self.sources.run())
        try:
            await self._run()
        finally:
            resolving.cancel()

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception as e:  # noqa: BLE001 - the poller must live; the policy goes stale
                self._log.error("hook.failed", hook="poll", error_type=type(e).__name__)
            await asyncio.sleep(self.poll_interval)

    async def poll(self, *, force: bool = False) -> None:
        """One look at the store; `force` rebuilds the policy even if nothing changed."""
        # One poll at a time (the timer's and SIGHUP's): a delta read before another poll's
        # install would otherwise be applied over it, and take the policy back a change.
        async with self._polling:
            await self._poll(force)

    async def _poll(self, force: bool) -> None:
        try:
            if await self.call(self.store.reopen_if_replaced):
                self._log.warning("store.replaced", db=self.store.display_url)
                force = True
            if await self.call(self._key_caught_up):
                force = True
            # A forced read (a restore, SIGHUP) that failed is owed until one is served: a
            # restored store may stand at the very counter the old one had.
            self._owed = force = force or self._owed
            counter, mark = await self.call(self.store.state_mark)
            policy, mode, changes, decided = self.policy, None, 0, False
            if policy is not None and counter == policy.counter and mark != policy.mark:
                # The same counter, another change: restored in place, and changed since.
                self._log.warning("store.diverged", counter=counter)
                force = self._owed = True
            if force and self._full is not None:
                # Read before a restore, maybe: never caught up with another store's log.
                self._full.cancel()
                self._full = None
            if self._full is not None and self._full.done():
                policy, mode = self._finish_full(policy)
            if force or policy is None:
                policy, mode = await self._full_read(), FULL
            full_counter = policy.counter if mode == FULL else None
            if counter != policy.counter:
                delta = await self.call(self.store.delta, policy.counter, policy.mark)
                if delta is None or delta.key_id != policy.key_id:
                    policy, mode = await self._full_read(), FULL
                    full_counter = policy.counter
                else:
                    # On the event loop, between two decisions; a few rows' work.
                    try:
                        policy.apply(delta)
                        sources.applied(policy, delta)
                    except Exception as e:  # noqa: BLE001 - fail closed, then read whole
                        policy, mode = await self._after_failed_apply(policy, e), FULL
                        full_counter = policy.counter
                    else:
                        mode, changes = mode or INCREMENTAL, delta.changes
                        decided = delta.decisions
            if mode is not None:
                # A reference new to this replica is read before the change is served.
                await self.sources.first(self.sources.track(sources.referenced(policy)))
                self._install(policy, full_counter)
                self._owed = False
                self.on_reload()
                if mode == FULL or decided:
                    await self._log_decisions()
                self._log.info(
                    "policy.reloaded",
                    counter=policy.counter,
                    grants=policy.grant_count,
                    unreadable=list(policy.unreadable),
                    mode=mode,
                    changes=changes,
                )
            else:
                self.last_ok = time.monotonic()
            self._start_full_if_due()
            if not self.store_up:
                self.store_up = True
                self._stale_reported = False
                self._log.info("store.recovered", counter=counter)
        except CredproxyError as e:
            self._down(e)
        if not self._stale_reported and self.current() is None:
            self._stale_reported = True
            self._log.error("store.stale", max_stale_s=self.max_stale)

    async def _after_failed_apply(self, policy: Policy, error: Exception) -> Policy:
        """A delta that raised half way: the policy it left is never served (requests are
        refused store-unavailable meanwhile); the whole store is read instead."""
        self._log.error("policy.apply_failed", error_type=type(error).__name__)
        if policy is self.policy:
            self.policy = None
        return await self._full_read()

    async def _log_decisions(self) -> None:
        """Approvals and denials happen in the CLI; the audit stream learns of them here."""
        try:
            decided = await self.call(self.store.decided_access_requests, self._decided_since)
        except CredproxyError:
            return  # the next reload tries again from the same point
        for row in decided:
            fields: dict[str, object] = {}
            if row.decided_by is not None:
                fields["operator"] = row.decided_by
            if row.budget_spent is not None:  # a budget request, or a hold over a budget
                fields |= {"kind": row.kind, "spent": row.budget_spent}
                if row.budget_set is not None:  # approved: the grant's budget, then and now
                    fields |= {"budget_was": row.budget_was, "budget": row.budget_set}
            self._log.info(
                f"access_request.{row.state}",
                id=row.id,
                principal=row.principal,
                host=row.host,
                port=row.port,
                method=row.method,
                path=row.path,
                grant_id=row.grant_id,
                **fields,
            )
            if row.decided_at is not None:  # always set: the query asks for decided ones
                self._decided_since = max(self._decided_since, row.decided_at)

    def _down(self, error: CredproxyError) -> None:
        if self.store_up:
            self.store_up = False
            self._log.warning("store.unavailable", error=str(error), max_stale_s=self.max_stale)

    def _build(self) -> Policy:
        # A million objects in a second or two (the records hold no cycles).
        with responsive():
            return self._build_policy()

    def _build_policy(self) -> Policy:
        snapshot = self.store.snapshot()
        key = self.store.key
        if key is not None and snapshot.key_id != key.key_id and self._reload_key is not None:
            # Another process rotated the master key: pick up the new key file.
            new_key = self._reload_key()
            if new_key.key_id == snapshot.key_id:
                self.store.key = new_key
                snapshot = self.store.snapshot()
        policy = Policy(snapshot)
        sources.bound(policy, snapshot)
        if any(g.body is not None and g.body.graphql is not None for g in snapshot.grants):
            bodies.import_graphql()  # here, off the event loop, rather than on a first request
        return policy

    def _key_caught_up(self) -> bool:
        """Served with another key than the store's (a rotation whose key file had not reached
        this replica when it looked): True once the key file holds the store's key, which is
        then the one used. Looked at every poll until then, the file being small."""
        policy, key = self.policy, self.store.key
        if policy is None or key is None or self._reload_key is None:
            return False
        if policy.key_id is None or policy.key_id == key.key_id:
            return False
        try:
            new_key = self._reload_key()
        except CredproxyError:
            return False  # the file as it stands now: looked at again at the next poll
        if new_key.key_id != policy.key_id:
            return False
        self.store.key = new_key
        return True

    async def _full_read(self) -> Policy:
        # The whole store: at 100,000 grants a second or more of CPU, longer on a busy host.
        return await self.call(self._build, timeout=FULL_TIMEOUT)

    def _install(self, policy: Policy, full_counter: int | None) -> None:
        """Serve `policy`; `full_counter`: the counter of the full read it was built from."""
        key = self.store.key
        if key is not None and key.key_id != self._fingerprinted_with:
            self._fingerprinted_with = key.key_id
            self.sources.refingerprint()
        new = self.sources.track(sources.referenced(policy))
        if new and not _loop_running():
            self.sources.load(new)  # the first load, before the proxy listens
        sources.bind(policy, self.sources)
        self.policy = policy
        self._follow(policy)
        self.last_ok = time.monotonic()
        if full_counter is not None:
            self._full_at, self._full_counter = self.last_ok, full_counter

    def _sources_changed(self) -> None:
        """A referenced secret rotated, or its source stopped or started serving: the policy
        being served takes the new record now, and redaction the new value, before any
        request stamps it."""
        policy = self.policy
        if policy is not None and sources.bind(policy, self.sources):
            self._follow(policy)

    def _fingerprint(self, secret: Secret) -> str:
        key = self.store.key
        assert key is not None  # the proxy reads the store with its key
        return key.fingerprint(secret)

    def _follow(self, policy: Policy) -> None:
        # Tokens minted with a credential since rotated, removed or changed are dropped now.
        TOKENS.retain(policy.token_versions)
        # The redaction sets follow the store: what another replica sealed (a rotated refresh
        # token, its access token) or an operator rotated is redacted from now on.
        changed = SETS.follow(policy.credentials, redacted)
        if changed:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # the first load, before the proxy listens
                SETS.prepare(changed)
            else:  # off the event loop; a request meanwhile compiles its own
                loop.run_in_executor(None, SETS.prepare, changed)

    def _start_full_if_due(self) -> None:
        """The safety net: read the whole store now and then, beside the incremental updates,
        once something changed since the last full read."""
        policy = self.policy
        if (
            self._full is None
            and policy is not None
            and policy.counter != self._full_counter
            and not time.monotonic() - self._full_at < self.full_interval
        ):
            future = asyncio.get_running_loop().run_in_executor(self._executor, self._build)
            self._full = asyncio.ensure_future(asyncio.wait_for(future, FULL_TIMEOUT))

    def _finish_full(self, policy: Policy | None) -> tuple[Policy | None, str | None]:
        """The periodic full read's policy, to be caught up and installed; or, when it
        failed, the one being served (it is tried again after full_interval)."""
        finished, self._full = self._full, None
        assert finished is not None
        self._full_at = time.monotonic()  # whatever it raises, not again before the interval
        try:
            return finished.result(), FULL
        except (CredproxyError, TimeoutError) as e:
            self._log.warning("policy.full_reload_failed", error_type=type(e).__name__)
            return policy, None

    def close(self) -> None:
        if self._full is not None:
            self._full.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.sources.close()
        self.store.close()


_abandoned = 0


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def abandoned() -> int:
    """How many store calls were left running past their deadline in this process."""
    return _abandoned
