"""What a command prints on success: its lines for a person, or with --json one JSON document."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from store.settings import Settings


def emit(settings: Settings, data: Any, lines: Sequence[str]) -> None:
    if settings.json:
        print(json.dumps(data, default=str))
    else:
        for line in lines:
            print(line)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> list[str]:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, list):
            return ",".join(str(x) for x in v)
        return str(v)

    cells = [[cell(row[c]) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*columns).rstrip()] + [fmt.format(*r).rstrip() for r in cells]


def yes(flag: bool) -> str:
    return "yes" if flag else "no"
