"""`credproxy usage`: each grant's token budgets, what their windows used and what remains."""

from __future__ import annotations

import argparse
from typing import Any

from addon.cli.output import emit, table
from store.records import BudgetEntry
from store.rules.budgets import MICROS
from store.settings import Settings

COMMAND = "usage"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        COMMAND, parents=[common], help="token budgets of grants: used and remaining"
    )
    p.add_argument("--principal", help="only this principal's grants")
    p.set_defaults(func=cmd_usage)


def _row(e: BudgetEntry) -> dict[str, Any]:
    def amount(n: int) -> int | float:
        return n / MICROS if e.kind == "spend" else n  # US dollars

    return {
        "grant": e.grant_id,
        "principal": e.principal,
        "state": e.state,
        "budget": f"{e.kind}/{e.window}",
        "limit": amount(e.limit),
        "used": amount(e.used),
        "remaining": amount(e.remaining),
        "resets_at": e.resets_at.isoformat().replace("+00:00", "Z"),
        "requests": e.requests,
        "estimated": e.estimated,
    }


def cmd_usage(args: argparse.Namespace, settings: Settings) -> int:
    rows = [_row(e) for e in settings.reader().list_budgets(args.principal)]
    lines = table(rows, list(rows[0])) if rows else ["no grant has a budget"]
    emit(settings, rows, lines)
    return 0
