"""The one line `credproxy run` prints for a person at a terminal, before the JSON lines: by
the single process and by the --workers supervisor alike."""

from __future__ import annotations

from pathlib import Path


def greeting(listen: list[str], admin: list[str], db: str, ca: Path) -> str:
    """Where it listens, the store, the CA to trust and how to stop."""
    admin_part = f" (admin {', '.join(admin)})" if admin else ""
    return (
        f"credproxy listening on {', '.join(listen)}{admin_part}; store {db}; "
        f"clients must trust {ca}; Ctrl-C stops it. JSON lines follow."
    )
