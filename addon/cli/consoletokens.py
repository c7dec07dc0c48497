"""`credproxy console token`: who may sign in to the approvers' console (`run --console`)."""

from __future__ import annotations

import argparse
from typing import Any

from addon.cli.output import emit, table
from addon.cli.parsing import group
from store.rules.grammar import parse_expiry
from store.settings import Settings

COMMAND = "console"
DEFAULT_EXPIRY = "30d"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    console = group(sub, COMMAND, "the approvers' console (run --console)")
    token = group(console, "token", "operators' sign-in tokens", dest="token_action")
    p = token.add_parser("add", parents=[common], help="prints the token once")
    p.add_argument("name", help="the operator, [a-z0-9][a-z0-9._-]{0,62}")
    p.add_argument(
        "--expires",
        default=DEFAULT_EXPIRY,
        help=f"30s, 10m, 2h, 7d or an ISO-8601 time (default: {DEFAULT_EXPIRY})",
    )
    p.set_defaults(func=cmd_token_add)
    p = token.add_parser("list", parents=[common], help="in every state; never the tokens")
    p.set_defaults(func=cmd_token_list)
    p = token.add_parser("revoke", parents=[common], help="every live token of an operator")
    p.add_argument("name", help="the operator")
    p.set_defaults(func=cmd_token_revoke)


def cmd_token_add(args: argparse.Namespace, settings: Settings) -> int:
    expires = parse_expiry(args.expires)
    token = settings.store().add_console_token(args.name, expires)
    when = expires.isoformat(timespec="seconds")
    emit(
        settings,
        {"operator": args.name, "token": token, "expires_at": when},
        [
            f"operator  {args.name}",
            f"token     {token}",
            f"expires   {when}",
            "The token is shown once; it is stored only as a hash.",
        ],
    )
    return 0


def cmd_token_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = [
        {
            "id": t.id,
            "operator": t.operator,
            "created_at": t.created_at.isoformat(timespec="seconds"),
            "expires_at": t.expires_at.isoformat(timespec="seconds"),
            "revoked_at": t.revoked_at.isoformat(timespec="seconds") if t.revoked_at else None,
            "state": t.state,
        }
        for t in settings.store().list_console_tokens()
    ]
    emit(settings, rows, table(rows, ["id", "operator", "created_at", "expires_at", "state"]))
    return 0


def cmd_token_revoke(args: argparse.Namespace, settings: Settings) -> int:
    count = settings.store().revoke_console_tokens(args.name)
    emit(
        settings,
        {"operator": args.name, "revoked": count},
        [f"revoked {count} console token(s) of {args.name}"],
    )
    return 0
