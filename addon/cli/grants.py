"""`credproxy grant`: who may send what, where; the body-rule flags are in bodyflags.py."""

from __future__ import annotations

import argparse
from typing import Any

from addon.cli import bodyflags
from addon.cli.output import emit, table, yes
from addon.cli.parsing import group, identifier, rate_flags
from addon.core.argtypes import count
from store.errors import InvalidInput
from store.records import GrantEntry
from store.rules import validation
from store.rules.grammar import check_registered_method, parse_expiry
from store.settings import Settings

COMMAND = "grant"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    grant = group(sub, COMMAND, "who may send what, where")
    p = grant.add_parser("add", parents=[common], help="let a principal send some requests")
    p.add_argument("principal", help="the principal")
    p.add_argument("--credential", help="stamp this credential (default: pass-through)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="HOST[:PORT], repeatable (default: the credential's hosts)",
    )
    p.add_argument("--method", action="append", required=True, help="GET, POST, ... or '*'")
    p.add_argument(
        "--extension-method",
        action="store_true",
        help="allow --method names outside IANA's HTTP method registry",
    )
    p.add_argument("--path", action="append", default=[], help="path pattern (default /)")
    p.add_argument("--once", action="store_true", help="usable by exactly one request")
    p.add_argument("--websocket", action="store_true", help="allow Upgrade requests")
    p.add_argument(
        "--encoded-slash",
        action="store_true",
        help="let a '*' path segment match one holding %%2F too (npm's @scope%%2Fname)",
    )
    p.add_argument("--expires", help="30s, 10m, 2h, 7d or an ISO-8601 time")
    p.add_argument("--purpose", help="a note for operators, shown by grant list")
    rate_flags(p, "for requests this grant lets through, per proxy replica")
    p.add_argument(
        "--max-uses",
        type=count(1, validation.MAX_BURST),
        metavar="N",
        help="usable by exactly N requests across replicas (--once is --max-uses 1)",
    )
    p.add_argument(
        "--approval",
        choices=validation.APPROVALS,
        help="hold each request, or the first of each kind, until an owner approves it",
    )
    p.add_argument(
        "--hold",
        metavar="DURATION",
        help=f"how long a request waits for approval: 90s, 2m (default "
        f"{validation.DEFAULT_HOLD}s, at most {validation.MAX_HOLD}s)",
    )
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="KIND=TOKENS/WINDOW",
        help="a token budget across replicas, repeatable: KIND input, output or total; WINDOW "
        "hour, day or month (UTC), e.g. total=200000/day; or spend=DOLLARS/WINDOW, charged by "
        "run --prices (see credproxy usage)",
    )
    p.add_argument(
        "--cap-max-tokens",
        action="store_true",
        help="cap a model call's max_tokens to what the output and total budgets have left "
        "(see docs/budgets.md)",
    )
    bodyflags.add_flags(p)
    p.set_defaults(func=cmd_grant_add)
    p = grant.add_parser("list", parents=[common], help="grants in every state")
    p.add_argument("--principal", help="only this principal's")
    p.set_defaults(func=cmd_grant_list)
    p = grant.add_parser(
        "budget", parents=[common], help="replace a grant's token budgets (usage is kept)"
    )
    p.add_argument("id", type=identifier, help="the grant's id")
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="KIND=TOKENS/WINDOW",
        help="the grant's budgets from now on, repeatable, as for grant add",
    )
    p.add_argument("--clear", action="store_true", help="remove the grant's budgets")
    p.add_argument(
        "--cap-max-tokens",
        action=argparse.BooleanOptionalAction,
        help="cap (or no longer cap) a model call's max_tokens to what is left; "
        "without it, as before",
    )
    p.set_defaults(func=cmd_grant_budget)
    p = grant.add_parser("revoke", parents=[common], help="revoke one grant")
    p.add_argument("id", type=identifier, help="the grant's id")
    p.set_defaults(func=cmd_grant_revoke)


def cmd_grant_add(args: argparse.Namespace, settings: Settings) -> int:
    if not args.extension_method:
        for method in args.method:
            check_registered_method(method)
    expires = parse_expiry(args.expires) if args.expires else None
    limits = validation.limits(
        args.rate,
        args.burst,
        args.max_uses,
        args.once,
        args.approval,
        args.hold,
        args.budget,
        args.cap_max_tokens,
    )
    body = bodyflags.rule_from(args)
    grant_id = settings.quick().add_grant(
        args.principal,
        args.method,
        credential=args.credential,
        hosts=args.host,
        paths=args.path,
        once=args.once,
        websocket=args.websocket,
        expires_at=expires,
        purpose=args.purpose,
        encoded_slash=args.encoded_slash,
        limits=limits,
        body=body,
    )
    emit(
        settings,
        {
            "id": grant_id,
            "principal": args.principal,
            "credential": args.credential,
            "expires_at": expires.isoformat() if expires else None,
        },
        [f"added grant {grant_id} for {args.principal}"],
    )
    return 0


def _grant_row(g: GrantEntry) -> dict[str, Any]:
    return {
        "id": g.id,
        "principal": g.principal,
        "credential": g.credential,
        "hosts": g.hosts,
        "methods": g.methods,
        "paths": g.paths,
        "once": g.once,
        "websocket": g.websocket,
        "encoded_slash": g.encoded_slash,
        "expires_at": g.expires_at.isoformat() if g.expires_at else None,
        "purpose": g.purpose,
        "created_at": g.created_at.isoformat(),
        "state": g.state,
        "key": g.key,
        "rate": g.rate,
        "burst": g.burst,
        "max_uses": g.max_uses,
        "uses": g.uses,
        "approval": g.approval,
        "hold": g.hold,
        "body": g.body,
        "budget": g.budget,
        "cap_max_tokens": g.cap_max_tokens,
    }


def cmd_grant_list(args: argparse.Namespace, settings: Settings) -> int:
    store = settings.quick(key=False)
    grants = store.list_grants(args.principal)
    rows = [_grant_row(g) for g in grants]
    if settings.json:  # scripts read it by the thousand: no table to build
        emit(settings, rows, [])
        return 0
    # The table says what a grant reaches: a grant without hosts of its own has its
    # credential's. --json keeps null there, as stored.
    their_hosts = store.credential_hosts()
    shown = [
        row
        | {
            "hosts": g.hosts or their_hosts.get(g.credential or ""),
            "once": yes(g.once),
            "encoded_slash": yes(g.encoded_slash),
        }
        for row, g in zip(rows, grants, strict=True)
    ]
    columns = ["id", "principal", "credential", "hosts", "methods", "paths", "once", "expires_at"]
    if any(g.body for g in grants):  # the column only where some grant decides bodies
        columns.insert(columns.index("paths") + 1, "body")
    if any(g.budget for g in grants):
        columns.insert(columns.index("once"), "budget")
    emit(settings, rows, table(shown, columns + ["encoded_slash", "state", "purpose"]))
    return 0


def cmd_grant_budget(args: argparse.Namespace, settings: Settings) -> int:
    cap = args.cap_max_tokens
    if args.clear and (args.budget or cap is not None):
        raise InvalidInput("--clear removes the budget: give it alone")
    if not (args.budget or args.clear or cap is not None):
        raise InvalidInput(
            "give {budget} (repeatable), --[no-]cap-max-tokens or --clear", budget="--budget"
        )
    described = settings.store().set_grant_budget(args.id, args.budget, cap)
    said = f"grant {args.id} budget: {described}" if described else f"grant {args.id}: no budget"
    emit(settings, {"id": args.id, "budget": described}, [said])
    return 0


def cmd_grant_revoke(args: argparse.Namespace, settings: Settings) -> int:
    if settings.store().revoke_grant(args.id):
        emit(settings, {"id": args.id, "state": "revoked"}, [f"revoked grant {args.id}"])
    else:
        said = f"grant {args.id} was already revoked"
        emit(settings, {"id": args.id, "state": "revoked", "already_revoked": True}, [said])
    return 0
