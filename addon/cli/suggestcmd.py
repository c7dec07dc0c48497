"""`credproxy policy suggest`: a policy file drawn from the audit and the access requests
(store/policyfile/suggest.py), for `plan` and `apply` to take as it is."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from addon.cli.parsing import group
from addon.core.argtypes import count
from addon.observe import auditread
from store.errors import InvalidInput
from store.policyfile import evidence, reconcile, suggest, suggestfile
from store.settings import Settings
from store.tables import access_requests

COMMAND = "policy"
_AGO = re.compile(r"([1-9][0-9]{0,8})([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    policy = group(sub, COMMAND, "policy drawn from evidence")
    p = policy.add_parser(
        "suggest",
        parents=[common],
        help="grants to add, narrow or retire, from the audit and access requests",
    )
    p.add_argument(
        "audit",
        nargs="*",
        help="audit files (JSON lines, gzip or not; - for standard input, the default "
        "unless --requests is given alone)",
    )
    p.add_argument(
        "--requests", action="store_true", help="also the store's pending access requests"
    )
    p.add_argument("--since", help="only evidence from then: 30m, 7d ago or an ISO-8601 time")
    p.add_argument("--until", help="only evidence before then: 30m, 7d ago or an ISO-8601 time")
    p.add_argument(
        "--min-denials",
        type=count(1, 1_000_000),
        default=suggest.MIN_DENIALS,
        metavar="N",
        help=f"denials a pattern needs to be suggested (default {suggest.MIN_DENIALS})",
    )
    p.add_argument(
        "--min-ids",
        type=count(2, 1_000_000),
        default=evidence.MIN_IDS,
        metavar="N",
        help=f"distinct id-like values before a segment becomes * (default {evidence.MIN_IDS})",
    )
    p.add_argument(
        "--max-keys",
        type=count(1, 10_000_000),
        default=evidence.MAX_KEYS,
        metavar="N",
        help=f"distinct keys held in memory (default {evidence.MAX_KEYS}); past it, counted",
    )
    p.add_argument("--out", type=Path, help="write the policy file here (default: stdout)")
    p.set_defaults(func=cmd_suggest)


def _instant(text: str | None, now: datetime, flag: str) -> datetime | None:
    if text is None:
        return None
    ago = _AGO.fullmatch(text)
    if ago:
        return now - timedelta(**{_UNITS[ago.group(2)]: int(ago.group(1))})
    try:
        when = datetime.fromisoformat(text)
    except ValueError as e:
        raise InvalidInput(f"invalid {flag} {text!r}: 30m, 7d (ago) or an ISO-8601 time") from e
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def cmd_suggest(args: argparse.Namespace, settings: Settings) -> int:
    now = datetime.now(UTC)
    since = _instant(args.since, now, "--since")
    until = _instant(args.until, now, "--until")
    if since is not None and until is not None and since >= until:
        raise InvalidInput("--since must come before --until")
    names = list(args.audit) or ([] if args.requests else ["-"])
    if names.count("-") > 1:
        raise InvalidInput("standard input (-) can be read once")
    if names == ["-"] and sys.stdin.isatty():
        raise InvalidInput("give audit files, or pipe the audit to standard input")
    db = settings.reader().db  # opens no secret: needs no key
    state = reconcile.current(db)
    found = evidence.Evidence((g.id for g in state.grants), args.max_keys)
    counts = auditread.read(names, found, since, until)
    if args.requests:
        for r in access_requests.pending(db):
            if (since is None or r.last_seen >= since) and (until is None or r.first_seen < until):
                found.requested(
                    (r.principal, r.host, r.port, r.method, r.path),
                    r.first_seen,
                    r.last_seen,
                    r.count,
                )
    result = suggest.suggest(
        state,
        found,
        uses_read=counts.requests > 0,
        min_denials=args.min_denials,
        min_ids=args.min_ids,
        since=since,
        until=until,
    )
    result.skipped.update({f"audit lines {why}": n for why, n in counts.skipped.items()})
    text = suggestfile.render(result)
    if args.out is not None:
        try:
            fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        except OSError as e:
            raise InvalidInput(f"cannot write {args.out}: {e.strerror}") from e
    if args.json:
        out = suggestfile.as_json(result) | {
            "read": {
                "lines": counts.lines,
                "requests": counts.requests,
                "denials": counts.denials,
                "uses": counts.uses,
                "connects": counts.connects,
            }
        }
        print(json.dumps(out))
    elif args.out is None:
        sys.stdout.write(text)
    else:
        print(
            f"wrote {args.out}: {len(result.additions)} to add, {len(result.narrowings)} to "
            f"narrow, {len(result.unused)} unused, {len(result.hosts)} hosts refused at CONNECT"
        )
    return 0
