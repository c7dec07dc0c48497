"""`credproxy request`: agents' access requests and held requests, approved or denied."""

from __future__ import annotations

import argparse
import getpass
from typing import Any

from addon.cli.output import emit, table
from addon.cli.parsing import group, identifier
from addon.core.argtypes import count
from store.errors import InvalidInput
from store.records import ACCESS, APPROVED, BUDGET, DENIED, REQUEST_STATES, AccessRequestEntry
from store.rules import validation
from store.rules.grammar import parse_expiry
from store.settings import Settings

COMMAND = "request"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    request = group(sub, COMMAND, "access requests from agents")
    p = request.add_parser("list", parents=[common], help="access requests, by id")
    p.add_argument("--state", choices=REQUEST_STATES, help="only those in this state")
    p.set_defaults(func=cmd_request_list)
    p = request.add_parser(
        "approve", parents=[common], help="turn it into a grant, or let a held request go on"
    )
    p.add_argument("id", type=identifier, help="the request's id")
    p.add_argument("--credential", help="stamp this credential (its hosts must cover the host)")
    p.add_argument("--path", help="path pattern, instead of the requested path")
    lifetime = p.add_mutually_exclusive_group()
    lifetime.add_argument("--once", action="store_true", help="usable by exactly one request")
    lifetime.add_argument("--expires", help="30s, 10m, 2h, 7d or an ISO-8601 time")
    cover = p.add_mutually_exclusive_group()
    cover.add_argument(
        "--next",
        type=count(1, validation.MAX_BURST),
        metavar="N",
        help="a held request of an approval-first grant: approve the next N of its kind too",
    )
    cover.add_argument(
        "--for",
        dest="cover_for",
        metavar="DURATION",
        help="a held request of an approval-first grant: approve its kind for 30s, 10m, 2h, 7d",
    )
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="KIND=TOKENS/WINDOW",
        help="a budget request: the grant's budgets from now on, repeatable, as for grant budget",
    )
    p.set_defaults(func=cmd_request_approve)
    p = request.add_parser("deny", parents=[common], help="refuse it")
    p.add_argument("id", type=identifier, help="the request's id")
    p.add_argument("--reason", help="a note the agent can read")
    p.set_defaults(func=cmd_request_deny)


def _request_row(r: AccessRequestEntry) -> dict[str, Any]:
    return {
        "id": r.id,
        "principal": r.principal,
        "host": r.host,
        "port": r.port,
        "method": r.method,
        "path": r.path,
        "purpose": r.purpose,
        "source": r.source,
        "state": r.state,
        "count": r.count,
        "first_seen": r.first_seen.isoformat(),
        "last_seen": r.last_seen.isoformat(),
        "decided_at": r.decided_at.isoformat() if r.decided_at else None,
        "decision_reason": r.decision_reason,
        "grant_id": r.grant_id,
        "kind": r.kind,
        "hold_until": r.hold_until.isoformat() if r.hold_until else None,
        "cover_until": r.cover_until.isoformat() if r.cover_until else None,
        "cover_uses": r.cover_uses,
        "covered": r.covered,
        # What a held request's body asked under a grant's body rule (GraphQL operation, MCP
        # method and tool, JSON-RPC method); never its arguments.
        "operation": r.operation,
        # A budget request: the limits found spent; once approved, the grant's budget before
        # and after. Who decided: a console operator, or cli:USER.
        "budget_spent": r.budget_spent,
        "budget_was": r.budget_was,
        "budget": r.budget_set,
        "decided_by": r.decided_by,
    }


def cmd_request_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = [_request_row(r) for r in settings.reader().list_access_requests(args.state)]
    columns = ["id", "principal", "method", "host", "port", "path", "operation", "source", "state"]
    columns.append("count")
    columns += ["last_seen", "grant_id", "kind", "purpose"]
    if any(r["budget_spent"] for r in rows):
        columns.append("budget_spent")
    emit(settings, rows, table(rows, columns))
    return 0


def cmd_request_approve(args: argparse.Namespace, settings: Settings) -> int:
    if args.budget:
        return _approve_budget(args, settings)
    expires = parse_expiry(args.expires) if args.expires else None
    until = None
    if args.cover_for:
        try:
            until = parse_expiry(args.cover_for)
        except InvalidInput as e:
            raise InvalidInput(f"invalid --for {args.cover_for!r}: use 30s, 10m, 2h or 7d") from e
    kind, grant_id = settings.store().approve_request(
        args.id,
        credential=args.credential,
        path=args.path,
        once=args.once,
        expires_at=expires,
        next_uses=args.next,
        cover_until=until,
        decided_by=operator(),
    )
    said = f"added grant {grant_id}" if kind == ACCESS else f"it goes on under grant {grant_id}"
    emit(
        settings,
        {"id": args.id, "grant_id": grant_id, "state": APPROVED, "kind": kind},
        [f"approved request {args.id}; {said}"],
    )
    return 0


def _approve_budget(args: argparse.Namespace, settings: Settings) -> int:
    given = {"--credential": args.credential, "--path": args.path, "--once": args.once or None}
    given |= {"--expires": args.expires, "--next": args.next, "--for": args.cover_for}
    for flag, value in given.items():
        if value is not None:
            raise InvalidInput(f"{flag} does not go with --budget")
    grant_id, was, now = settings.store().approve_budget_request(args.id, args.budget, operator())
    emit(
        settings,
        {
            "id": args.id,
            "grant_id": grant_id,
            "state": APPROVED,
            "kind": BUDGET,
            "budget_was": was,
            "budget": now,
        },
        [f"approved request {args.id}; grant {grant_id} budget: {now} (was: {was or 'none'})"],
    )
    return 0


def operator() -> str:
    """Who decides from the CLI, for the audit line: the login name, as the system says."""
    try:
        return f"cli:{getpass.getuser()}"[:80]
    except (OSError, KeyError):  # no name for this uid (a container's)
        return "cli"


def cmd_request_deny(args: argparse.Namespace, settings: Settings) -> int:
    settings.store().deny_access_request(args.id, args.reason, operator())
    emit(settings, {"id": args.id, "state": DENIED}, [f"denied request {args.id}"])
    return 0
