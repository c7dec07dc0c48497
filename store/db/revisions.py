"""Which schema revision this code serves, and the verdict on a store's: no database code here,
so that a command that never imports SQLAlchemy (store/db/lite.py) checks it alike."""

from __future__ import annotations

from pathlib import Path

from store.errors import StoreUnavailable

MIGRATIONS = Path(__file__).parent.parent / "migrations"
# The newest revision in MIGRATIONS, so that `run` checks the schema without importing Alembic
# (a noticeable part of its start-up). tests/test_migrations.py holds it to Alembic's own head.
SCHEMA_HEAD = "0014"
# Every revision this code can migrate from; anything else was written by a newer credproxy.
KNOWN_SCHEMAS = frozenset(
    p.name.split("_", 1)[0] for p in (MIGRATIONS / "versions").glob("0*_*.py")
)


def refuse_newer(display_url: str, current: str | None) -> None:
    if current is not None and not KNOWN_SCHEMAS.issuperset(current.split(", ")):
        raise StoreUnavailable(
            f"database {display_url} is at schema {current}, newer than this "
            f"credproxy's {SCHEMA_HEAD}: upgrade credproxy"
        )


def check_head(display_url: str, current: str | None) -> None:
    """Raise unless `current` (Alembic's recorded revision, None before any) is SCHEMA_HEAD."""
    refuse_newer(display_url, current)
    if current != SCHEMA_HEAD:
        raise StoreUnavailable(
            f"database {display_url} is at schema {current or 'none'}, "
            f"not {SCHEMA_HEAD}: run credproxy init"
        )
