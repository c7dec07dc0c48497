"""What an audit showed, gathered within a bound, and the one rule that turns paths into patterns.

Memory grows with the distinct keys seen, never with the lines: a denial's key is (principal,
host, port, method, path), a refused CONNECT's (principal, host, port), a use's (grant, method,
path). Past `max_keys` a new key is
dropped and counted, and a grant whose use was dropped is marked incomplete (never narrowed).

The generalisation rule (`patterns`): a path is its own pattern, except that a segment after
the first becomes `*` when it looks like an id (`ID`: digits, a UUID, or 7 to 64 hex digits
holding a digit) and at least `min_ids` distinct values were seen at that place among paths of
the same shape. A pattern is a segment prefix, as grants match paths, so a pattern never goes
above the paths it was drawn from.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from store.errors import InvalidInput
from store.rules.grammar import validate_path_pattern

MAX_KEYS = 100_000
MIN_IDS = 3
MAX_EXAMPLES = 3
ID = re.compile(
    r"[0-9]+"
    r"|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    r"|(?=[a-f]*[0-9])[0-9a-f]{7,64}",
    re.IGNORECASE,
)


@dataclass
class Tally:
    """How many times, first and last: of one key, or of a suggestion's keys together."""

    count: int = 0
    first: datetime | None = None
    last: datetime | None = None
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, when: datetime, count: int = 1, reason: str | None = None) -> None:
        self.count += count
        self.first = when if self.first is None or when < self.first else self.first
        self.last = when if self.last is None or when > self.last else self.last
        if reason is not None:
            self.reasons[reason] = self.reasons.get(reason, 0) + count

    def merge(self, other: Tally) -> None:
        for when in (other.first, other.last):
            if when is not None:
                self.add(when, 0)
        self.count += other.count
        for reason, n in other.reasons.items():
            self.reasons[reason] = self.reasons.get(reason, 0) + n


DenialKey = tuple[str, str, int, str, str]  # principal, host, port, method, path
HostKey = tuple[str, str, int]  # principal, host, port: a refused CONNECT shows no more


class Evidence:
    """Denials and uses, keyed; bounded by `max_keys` distinct keys in all."""

    def __init__(self, known_grants: Iterable[int], max_keys: int = MAX_KEYS) -> None:
        if max_keys < 1:
            raise InvalidInput(f"invalid --max-keys {max_keys}: at least 1")
        self.max_keys = max_keys
        self.denied: dict[DenialKey, Tally] = {}
        self.hosts: dict[HostKey, Tally] = {}
        # Only the store's active grants are followed: the audit cannot grow this beyond them.
        self.used: dict[int, dict[tuple[str, str], Tally]] = {g: {} for g in known_grants}
        self.incomplete: set[int] = set()
        # Each followed grant's (host, port) as used; a grant in `unplaced` had a use without.
        self.places: dict[int, set[tuple[str, int]]] = {g: set() for g in self.used}
        self.unplaced: set[int] = set()
        self.keys = 0
        self.dropped = 0
        self.other_grants = 0  # uses of grants no longer active

    def _room(self) -> bool:
        if self.keys >= self.max_keys:
            self.dropped += 1
            return False
        self.keys += 1
        return True

    def deny(self, key: DenialKey, when: datetime, reason: str, count: int = 1) -> None:
        tally = self.denied.get(key)
        if tally is None:
            if not self._room():
                return
            tally = self.denied[key] = Tally()
        tally.add(when, count, reason)

    def connect(self, key: HostKey, when: datetime) -> None:
        """A refused CONNECT: the host was asked for; what inside the tunnel, never seen."""
        tally = self.hosts.get(key)
        if tally is None:
            if not self._room():
                return
            tally = self.hosts[key] = Tally()
        tally.add(when)

    def requested(self, key: DenialKey, first: datetime, last: datetime, count: int) -> None:
        """An access request of the store: the same denials as the audit's, so the larger
        count stands, never the sum."""
        tally = self.denied.get(key)
        if tally is None:
            if not self._room():
                return
            tally = self.denied[key] = Tally()
        extra = max(0, count - tally.count)
        tally.add(first, 0)
        tally.add(last, extra, "access-request" if extra else None)

    def use(
        self,
        grant: int,
        method: str,
        path: str,
        when: datetime,
        place: tuple[str, int] | None = None,
    ) -> None:
        uses = self.used.get(grant)
        if uses is None:
            self.other_grants += 1
            return
        places = self.places[grant]
        if place is None:
            self.unplaced.add(grant)
        elif place not in places:
            if self._room():
                places.add(place)
            else:
                self.incomplete.add(grant)
        tally = uses.get((method, path))
        if tally is None:
            if not self._room():
                self.incomplete.add(grant)
                return
            tally = uses[(method, path)] = Tally()
        tally.add(when)


def looks_like_id(segment: str) -> bool:
    return ID.fullmatch(segment) is not None


def patterns(paths: Iterable[str], min_ids: int = MIN_IDS) -> dict[str, list[str]]:
    """Each pattern the rule draws from `paths`, with the paths it stands for.

    A path the pattern grammar cannot write (an escape other than %2F, an empty segment, a
    segment that is `*` itself) is left out: no pattern is drawn from it. Patterns under
    another of the set are folded into it.
    """
    shapes: dict[tuple[str, ...], list[tuple[str, ...]]] = defaultdict(list)
    for path in sorted(set(paths)):
        segments = tuple(path[1:].split("/"))
        if "*" in segments:  # a literal `*` segment would be written as a wildcard
            continue
        shape = tuple("*" if i > 0 and looks_like_id(s) else s for i, s in enumerate(segments))
        shapes[shape].append(segments)
    drawn: dict[str, list[str]] = defaultdict(list)
    for shape, members in shapes.items():
        starred = {
            i for i, s in enumerate(shape) if s == "*" and len({m[i] for m in members}) >= min_ids
        }
        for segments in members:
            pattern = "/" + "/".join("*" if i in starred else s for i, s in enumerate(segments))
            try:
                validate_path_pattern(pattern)
            except InvalidInput:
                continue
            drawn[pattern].append("/" + "/".join(segments))
    return fold(drawn)


def fold(drawn: dict[str, list[str]]) -> dict[str, list[str]]:
    """Drop each pattern another of the set covers, its paths going to the one that does."""
    kept: dict[str, list[str]] = {}
    for pattern in sorted(drawn, key=lambda p: (p.count("/"), p)):
        outer = next((k for k in kept if covers(k, pattern)), None)
        if outer is None:
            kept[pattern] = list(drawn[pattern])
        else:
            kept[outer].extend(drawn[pattern])
    return kept


def covers(outer: str, inner: str, encoded_slash: bool = False) -> bool:
    """Does every path `inner` matches also match `outer` (both grant path patterns; `outer`'s
    `*` takes a segment holding %2F only with `encoded_slash`, as the proxy matches it)?"""
    if outer == "/":
        return True
    wanted, below = outer.strip("/").split("/"), outer.endswith("/")
    got, got_below = inner.strip("/").split("/"), inner.endswith("/") and inner != "/"
    if inner == "/" or len(got) < len(wanted):
        return False
    if below and len(got) == len(wanted) and not got_below:
        return False
    return all(
        w == g or (w == "*" and g != "" and (encoded_slash or "%2F" not in g))
        for w, g in zip(wanted, got, strict=False)
    )
