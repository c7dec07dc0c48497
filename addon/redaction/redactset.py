"""The redaction set: every value of each credential's secrets this replica has known.

A credential's values come from several holders: the store (its secret's parts as the last
reload read them, so a refresh token or access token another replica sealed, or a rotated
secret, is in within the reload window), the process's own mints (the token, the refresh token
it was given) and its STS calls (temporary keys). A value no holder has any more is retired,
not dropped: it stays in the set for GRACE after this replica saw it go (then until that
credential's values next change), with at most MAX_RETIRED retired values per credential,
the oldest going first.

A set is compiled once per change, in a thread where the change comes from one (a mint, an
STS call, `prepare` after a reload), so that requests find it built.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from addon.core.responsive import responsive
from addon.redaction.redact import Redactor, prepare

# A minted token is replaced at 75 % of its life, so it outlives that by a quarter of its
# lifetime at most: 6 h of the longest one read (minters.MAX_LIFETIME, a day).
GRACE = 6 * 3600.0
# Eight hour-long refresh tokens and their access tokens: six hours of them. A credential
# replacing values faster drops only values replaced six lifetimes ago or more.
MAX_RETIRED = 16
STORE, MINTED, ROLE = "store", "minted", "role"


class RedactionSets:
    """Each credential's values to redact: what each holder has, and what was retired."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, frozenset[bytes]]] = {}
        self._retired: dict[str, dict[bytes, float]] = {}  # value -> when it was retired
        self._sets: dict[str, tuple[bytes, ...]] = {}
        self._prepared: dict[str, Any] = {}  # name -> prepare(its set), once built
        self._used: set[str] = set()  # asked for a redactor: worth preparing after a change
        self._records: dict[str, object] = {}  # the store's record each name was read from

    def __repr__(self) -> str:
        return f"RedactionSets({len(self._sets)} credentials)"

    def secrets(self, name: str) -> tuple[bytes, ...]:
        with self._lock:
            return self._sets.get(name, ())

    def hold(self, name: str, holder: str, values: Iterable[bytes], build: bool = False) -> bool:
        """`values` are what `holder` has of the credential now; what it had before and no
        holder has any more is retired. `build`: compile the set now (in a thread). Returns
        whether the set changed."""
        with self._lock:
            changed = self._hold(name, holder, frozenset(v for v in values if v))
        if build:
            self.prepare((name,))
        return changed

    def follow(
        self, credentials: Mapping[str, Any], parts: Callable[[Any], tuple[bytes, ...]]
    ) -> list[str]:
        """The store's holding, at each policy install: `credentials` by name, `parts` what
        redaction looks for of one. Records not seen before are read; names gone (removed,
        unreadable) hold nothing. Returns the names whose set changed and that requests use."""
        found = {
            name: parts(record)
            for name, record in credentials.items()
            if self._records.get(name) is not record
        }
        gone = [name for name in self._records if name not in credentials]
        changed = []
        with self._lock:
            for name, values in found.items():
                self._records[name] = credentials[name]
                if self._hold(name, STORE, frozenset(values)) and name in self._used:
                    changed.append(name)
            for name in gone:
                del self._records[name]
                if self._hold(name, STORE, frozenset()) and name in self._used:
                    changed.append(name)
        return changed

    def prepare(self, names: Iterable[str]) -> None:
        """Compile these credentials' sets; in a thread, never on the event loop."""
        for name in names:
            with self._lock:
                values = self._sets.get(name)
                if values is None or name in self._prepared:
                    continue
            with responsive():  # tens of ms of the GIL per value
                built = prepare(values)
            with self._lock:
                if self._sets.get(name) == values:
                    self._prepared[name] = built

    def redactor(self, name: str, extra: Iterable[bytes]) -> Redactor:
        """A redactor for a request stamped with credential `name` whose own values are
        `extra`: the credential's whole set, and `extra` whatever the set holds."""
        wanted = frozenset(v for v in extra if v)
        with self._lock:
            self._used.add(name)
            values = self._sets.get(name, ())
            built = self._prepared.get(name)
            ready = name in self._prepared
        if not wanted <= frozenset(values):
            # A value no holder told of: redacted all the same, compiled here.
            return Redactor(tuple(sorted(wanted.union(values))))
        if ready:
            return Redactor(values, built)
        built = prepare(values)  # on the event loop: no thread had built it yet
        with self._lock:
            if self._sets.get(name) == values:
                self._prepared[name] = built
        return Redactor(values, built)

    def _hold(self, name: str, holder: str, values: frozenset[bytes]) -> bool:
        held = self._held.get(name, {})
        before = held.get(holder, frozenset())
        if values == before:
            return False
        if values:
            held[holder] = values
            self._held[name] = held
        else:
            held.pop(holder, None)
        kept = frozenset().union(*held.values())
        now = self._clock()
        retired = self._retired.setdefault(name, {})
        for value in before - kept:
            retired[value] = now
        for value in kept:
            retired.pop(value, None)
        for value, at in list(retired.items()):
            if now - at >= GRACE:
                del retired[value]
        excess = len(retired) - MAX_RETIRED
        if excess > 0:
            for value in sorted(retired, key=retired.__getitem__)[:excess]:
                del retired[value]
        values_now = tuple(sorted(kept.union(retired)))
        if values_now == self._sets.get(name):
            return False
        self._prepared.pop(name, None)
        if values_now:
            self._sets[name] = values_now
        else:  # nothing held, nothing retired: the credential is forgotten
            for table in (self._sets, self._held, self._retired):
                table.pop(name, None)
            self._used.discard(name)
        return True


SETS = RedactionSets()
