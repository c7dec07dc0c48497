"""`credproxy principal`: who connects, and the further tokens (sessions) each may hold."""

from __future__ import annotations

import argparse
from typing import Any

from addon.cli.output import emit, table
from addon.cli.parsing import group, identifier, rate_flags
from store.errors import InvalidInput
from store.rules import validation
from store.rules.grammar import parse_expiry
from store.settings import Settings

COMMAND = "principal"
_SCOPE = "over all of this principal's requests"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    principal = group(sub, COMMAND, "sandboxes and agents (who connects)")
    p = principal.add_parser("add", parents=[common], help="create; prints the token once")
    p.add_argument("name", help="[a-z0-9][a-z0-9._-]{0,62}")
    rate_flags(p, _SCOPE)
    p.set_defaults(func=cmd_principal_add)
    p = principal.add_parser("update", parents=[common], help="change its rate limit")
    p.add_argument("name", help="the principal")
    rate_flags(p, _SCOPE)
    p.add_argument("--no-rate", action="store_true", help="remove its rate limit")
    p.set_defaults(func=cmd_principal_update)
    p = principal.add_parser("list", parents=[common], help="live principals")
    p.set_defaults(func=cmd_principal_list)
    p = principal.add_parser("remove", parents=[common], help="disable and revoke its grants")
    p.add_argument("name", help="the principal")
    p.set_defaults(func=cmd_principal_remove)

    token = group(principal, "token", "further tokens: sessions", dest="token_action")
    p = token.add_parser("add", parents=[common], help="prints the token once")
    p.add_argument("name", help="the principal")
    p.add_argument("--expires", help="30s, 10m, 2h, 7d or an ISO-8601 time (default: never)")
    p.add_argument("--note", help="what the token is for")
    p.set_defaults(func=cmd_token_add)
    p = token.add_parser("list", parents=[common], help="in every state; never the tokens")
    p.add_argument("name", nargs="?", help="only this principal's")
    p.set_defaults(func=cmd_token_list)
    p = token.add_parser("revoke", parents=[common], help="by id")
    p.add_argument("id", type=identifier, help="the token's id (principal token list)")
    p.set_defaults(func=cmd_token_revoke)


def cmd_principal_add(args: argparse.Namespace, settings: Settings) -> int:
    limits = validation.limits(args.rate, args.burst)
    token = settings.quick().add_principal(args.name, limits)
    url = f"http://{args.name}:{token}@{settings.advertise}"
    emit(
        settings,
        {"name": args.name, "token": token, "proxy_url": url},
        [
            f"principal  {args.name}",
            f"token      {token}",
            f"proxy_url  {url}",
            "The token is shown once; it is stored only as a hash.",
        ],
    )
    return 0


def cmd_principal_update(args: argparse.Namespace, settings: Settings) -> int:
    if args.no_rate == (args.rate is not None):
        raise InvalidInput("give --rate N/UNIT [--burst N] or --no-rate")
    limits = validation.limits(args.rate, args.burst)
    settings.store().set_principal_limits(args.name, limits)
    emit(
        settings,
        {"name": args.name, "rate": args.rate},
        [f"principal {args.name}: rate {args.rate or 'none'}"],
    )
    return 0


def cmd_principal_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = [
        {
            "name": p.name,
            "created_at": p.created_at.isoformat(timespec="seconds"),
            "rate": p.rate,
            "burst": p.burst,
        }
        for p in settings.reader().list_principals()
    ]
    emit(settings, rows, table(rows, ["name", "created_at", "rate", "burst"]))
    return 0


def cmd_principal_remove(args: argparse.Namespace, settings: Settings) -> int:
    revoked = settings.store().remove_principal(args.name)
    emit(
        settings,
        {"name": args.name, "revoked_grants": revoked},
        [f"removed principal {args.name}; revoked {revoked} grant(s)"],
    )
    return 0


def cmd_token_add(args: argparse.Namespace, settings: Settings) -> int:
    expires = parse_expiry(args.expires) if args.expires else None
    token_id, token = settings.store().add_token(args.name, expires, args.note)
    url = f"http://{args.name}:{token}@{settings.advertise}"
    emit(
        settings,
        {
            "id": token_id,
            "name": args.name,
            "token": token,
            "proxy_url": url,
            "expires_at": expires.isoformat() if expires else None,
        },
        [
            f"principal  {args.name}",
            f"id         {token_id}",
            f"token      {token}",
            f"proxy_url  {url}",
            "The token is shown once; it is stored only as a hash.",
        ],
    )
    return 0


def cmd_token_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = [
        {
            "id": t.id,
            "principal": t.principal,
            "note": t.note,
            "created_at": t.created_at.isoformat(timespec="seconds"),
            "expires_at": t.expires_at.isoformat() if t.expires_at else None,
            "revoked_at": t.revoked_at.isoformat() if t.revoked_at else None,
            "state": t.state,
        }
        for t in settings.store().list_tokens(args.name)
    ]
    columns = ["id", "principal", "created_at", "expires_at", "state", "note"]
    emit(settings, rows, table(rows, columns))
    return 0


def cmd_token_revoke(args: argparse.Namespace, settings: Settings) -> int:
    settings.store().revoke_token(args.id)
    emit(settings, {"id": args.id, "state": "revoked"}, [f"revoked token {args.id}"])
    return 0
