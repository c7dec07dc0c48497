"""Grants drafted from evidence: added from denials, narrowed to their use, listed when unused.

Nothing is ever wider than what was seen plus the one generalisation rule of
`evidence.patterns`, and a narrowing never leaves the grant it narrows. suggestfile.py writes
the result as a policy file of [[grant]] tables only, which `plan` and `apply` take as it is:
the principals and credentials it names are the store's own.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from store.errors import InvalidInput
from store.policyfile.evidence import (
    MAX_EXAMPLES,
    MIN_IDS,
    Evidence,
    Tally,
    covers,
    fold,
    patterns,
)
from store.policyfile.reconcile import Current, GrantView
from store.rules.grammar import HostPattern, parse_host, path_matches

# Paths of one suggested grant; past it an addition keeps the most denied, a narrowing is not
# suggested (it would cut paths that were used).
MAX_PATHS = 64
MIN_DENIALS = 2


@dataclass(frozen=True)
class Addition:
    key: str
    principal: str
    credential: str | None
    host: str  # as a grant writes it: `host` (443) or `host:port`
    methods: tuple[str, ...]
    paths: tuple[str, ...]
    tally: Tally
    examples: tuple[str, ...]
    also: tuple[str, ...]  # other credentials that cover the host


@dataclass(frozen=True)
class AskedHost:
    """A host a principal was refused a tunnel to: listed, never granted (no path was seen)."""

    principal: str
    host: str
    credentials: tuple[str, ...]
    tally: Tally


@dataclass(frozen=True)
class Narrowing:
    grant: GrantView
    hosts: tuple[str, ...]  # the grant's own when unchanged (() for the credential's)
    methods: tuple[str, ...]
    paths: tuple[str, ...]
    tally: Tally
    examples: tuple[str, ...]


@dataclass(frozen=True)
class Suggestion:
    additions: tuple[Addition, ...]
    hosts: tuple[AskedHost, ...]
    narrowings: tuple[Narrowing, ...]
    unused: tuple[GrantView, ...]
    skipped: dict[str, int]  # why evidence gave no suggestion, counted
    uses_read: bool  # whether use evidence was read at all (narrow and retire need it)
    since: datetime | None
    until: datetime | None
    min_denials: int
    min_ids: int


def suggest(
    now: Current,
    evidence: Evidence,
    *,
    uses_read: bool,
    min_denials: int = MIN_DENIALS,
    min_ids: int = MIN_IDS,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Suggestion:
    if min_denials < 1 or min_ids < 2:
        raise InvalidInput("invalid --min-denials or --min-ids: at least 1 and 2")
    skipped: dict[str, int] = defaultdict(int)
    additions = _additions(now, evidence, min_denials, min_ids, skipped)
    hosts = _asked_hosts(now, evidence, skipped)
    narrowings: list[Narrowing] = []
    unused: list[GrantView] = []
    if uses_read:
        for g in now.grants:
            uses = evidence.used.get(g.id, {})
            if not uses:
                unused.append(g)
            elif g.id in evidence.incomplete:
                skipped["grant with uses past --max-keys (not narrowed)"] += 1
            else:
                used_on = _used_hosts(now, g, evidence)
                narrowed = _narrow(g, uses, used_on, min_ids, skipped)
                if narrowed is not None:
                    narrowings.append(narrowed)
    if evidence.dropped:
        skipped["keys past --max-keys"] = evidence.dropped
    if evidence.other_grants:
        skipped["uses of grants no longer active"] = evidence.other_grants
    return Suggestion(
        tuple(additions),
        tuple(hosts),
        tuple(narrowings),
        tuple(unused),
        dict(skipped),
        uses_read,
        since,
        until,
        min_denials,
        min_ids,
    )


def _names_host(now: Current, g: GrantView, host: str, port: int) -> bool:
    hosts = g.hosts or now.credential_hosts.get(g.credential or "", ())
    default = 80 if port == 80 and g.credential is None else 443
    return any(parse_host(h).matches(host, port, default) for h in hosts)


def _asked_hosts(now: Current, evidence: Evidence, skipped: dict[str, int]) -> list[AskedHost]:
    asked = []
    for (principal, host, port), tally in sorted(evidence.hosts.items()):
        if principal not in now.principals:
            skipped["denials of principals not in the store"] += tally.count
        elif any(_names_host(now, g, host, port) for g in now.grants if g.principal == principal):
            skipped["refused CONNECTs to a host a grant now names"] += tally.count
        else:
            shown = str(HostPattern(host, None if port == 443 else port))
            asked.append(
                AskedHost(principal, shown, tuple(_credential_for(now, host, port)), tally)
            )
    return asked


def _allows(now: Current, g: GrantView, host: str, port: int, method: str, path: str) -> bool:
    """Would active grant `g` allow this request's host, method and path as they stand?"""
    if not _names_host(now, g, host, port):
        return False
    methods = set(g.methods)
    if not ("*" in methods or method in methods or (method == "HEAD" and "GET" in methods)):
        return False
    return any(path_matches(p, path, g.encoded_slash) for p in g.paths)


def _credential_for(now: Current, host: str, port: int) -> list[str]:
    return sorted(
        name
        for name, hosts in now.credential_hosts.items()
        if any(parse_host(h).matches(host, port, 443) for h in hosts)
    )


def _additions(
    now: Current, evidence: Evidence, min_denials: int, min_ids: int, skipped: dict[str, int]
) -> list[Addition]:
    by_place: dict[tuple[str, str, int], dict[str, dict[str, Tally]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    grants_of: dict[str, list[GrantView]] = defaultdict(list)
    for g in now.grants:
        grants_of[g.principal].append(g)
    for (principal, host, port, method, path), tally in evidence.denied.items():
        if principal not in now.principals:
            skipped["denials of principals not in the store"] += tally.count
        elif any(_allows(now, g, host, port, method, path) for g in grants_of[principal]):
            skipped["denials an active grant now allows"] += tally.count
        else:
            by_place[(principal, host, port)][method][path] = tally
    additions = []
    for (principal, host, port), methods in sorted(by_place.items()):
        # Methods whose patterns are the same share one grant; the others get their own, so
        # that no method is granted a path it was not denied.
        shared: dict[tuple[str, ...], list[tuple[str, dict[str, Tally]]]] = defaultdict(list)
        for method, paths in sorted(methods.items()):
            drawn = patterns(paths, min_ids)
            left = len(paths) - sum(len(v) for v in drawn.values())
            if left:
                skipped["paths no grant pattern can write"] += left
            kept = {
                p: members
                for p, members in drawn.items()
                if sum(paths[m].count for m in members) >= min_denials
            }
            below = sum(
                paths[m].count for p, members in drawn.items() if p not in kept for m in members
            )
            if below:
                skipped["denials below --min-denials"] += below
            if kept:
                ranked = sorted(kept, key=lambda p: (-sum(paths[m].count for m in kept[p]), p))
                chosen = tuple(sorted(ranked[:MAX_PATHS]))
                members = {m: paths[m] for p in chosen for m in kept[p]}
                shared[chosen].append((method, members))
                if len(ranked) > MAX_PATHS:
                    skipped["patterns past the paths of one grant"] += len(ranked) - MAX_PATHS
        credentials = _credential_for(now, host, port)
        shown = str(HostPattern(host, None if port == 443 else port))
        for chosen, entries in sorted(shared.items()):
            names = [m for m, _ in entries]
            if "GET" in names and "HEAD" in names:
                names.remove("HEAD")  # a grant of GET allows HEAD
            tally = Tally()
            seen: dict[str, Tally] = {}
            for _, members in entries:
                for path, t in members.items():
                    tally.merge(t)
                    seen[path] = t
            credential = credentials[0] if credentials else None
            digest = hashlib.sha256(
                json.dumps([principal, credential, shown, names, chosen]).encode()
            ).hexdigest()[:12]
            additions.append(
                Addition(
                    key=f"suggested-{digest}",
                    principal=principal,
                    credential=credential,
                    host=shown,
                    methods=tuple(names),
                    paths=chosen,
                    tally=tally,
                    examples=_examples(seen),
                    also=tuple(credentials[1:]),
                )
            )
    return additions


def _examples(seen: dict[str, Tally]) -> tuple[str, ...]:
    ranked = sorted(seen, key=lambda p: (-seen[p].count, p))
    return tuple(ranked[:MAX_EXAMPLES])


def _used_hosts(now: Current, g: GrantView, evidence: Evidence) -> tuple[str, ...]:
    """The hosts `g` was used on, when fewer than it names (a wildcard, a host never used);
    else the grant's own. Only hosts its patterns cover on the same port are written."""
    places = evidence.places.get(g.id, set())
    if g.id in evidence.unplaced or not places:
        return g.hosts
    named = [parse_host(h) for h in (g.hosts or now.credential_hosts.get(g.credential or "", ()))]
    used = sorted(
        {HostPattern(host, None if port == 443 else port) for host, port in places}, key=str
    )
    if not all(any(p.covers(u) for p in named) for u in used):
        return g.hosts  # a port the pattern stands for only on plain http, or a stale grant
    if {str(u) for u in used} == {str(p) for p in named}:
        return g.hosts
    return tuple(str(u) for u in used)


def _narrow(
    g: GrantView,
    uses: dict[tuple[str, str], Tally],
    hosts: tuple[str, ...],
    min_ids: int,
    skipped: dict[str, int],
) -> Narrowing | None:
    granted = set(g.methods)
    used = {m if m in granted or m != "HEAD" else "GET" for m, _ in uses}
    if "*" not in granted and not used <= granted:
        skipped["grants whose use the audit shows outside them (not narrowed)"] += 1
        return None
    if "GET" in used:
        used.discard("HEAD")
    methods = tuple(sorted(used)) if "*" in granted or used < granted else g.methods
    seen: dict[str, Tally] = {}
    for (_, path), tally in uses.items():
        seen.setdefault(path, Tally()).merge(tally)
    drawn = patterns(seen, min_ids)
    chosen: set[str] = set()
    for pattern, members in drawn.items():
        if any(covers(p, pattern, g.encoded_slash) for p in g.paths):
            chosen.add(pattern)
        else:  # the rule went past the grant: the paths themselves, which it did allow
            chosen.update(members)
    chosen = set(fold({c: [] for c in chosen}))
    written = {m for members in drawn.values() for m in members}
    if any(not any(covers(c, u) for c in chosen) for u in set(seen) - written):
        skipped["grants used on paths no pattern can write (not narrowed)"] += 1
        return None
    if not all(any(covers(p, c, g.encoded_slash) for p in g.paths) for c in chosen):
        skipped["grants whose use the audit shows outside them (not narrowed)"] += 1
        return None
    if len(chosen) > MAX_PATHS:
        skipped["grants used on more paths than one grant lists (not narrowed)"] += 1
        return None
    paths = tuple(sorted(chosen))
    if set(methods) == granted and set(paths) == set(g.paths) and hosts == g.hosts:
        return None
    tally = Tally()
    for t in seen.values():
        tally.merge(t)
    return Narrowing(g, hosts, methods, paths, tally, _examples(seen))
