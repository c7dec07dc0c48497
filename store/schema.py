"""Schema readiness: the revision a database is at, migrating it, and refusing a newer one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import column, inspect, select, table
from sqlalchemy.exc import DBAPIError

from store.engine import Database
from store.errors import StoreUnavailable

MIGRATIONS = Path(__file__).parent / "migrations"
# The newest revision in MIGRATIONS, so that `run` checks the schema without importing Alembic
# (a noticeable part of its start-up). tests/test_migrations.py holds it to Alembic's own head.
SCHEMA_HEAD = "0009"
# Every revision this code can migrate from; anything else was written by a newer credproxy.
KNOWN_SCHEMAS = frozenset(
    p.name.split("_", 1)[0] for p in (MIGRATIONS / "versions").glob("0*_*.py")
)
_VERSIONS = table("alembic_version", column("version_num"))


def _alembic() -> Any:
    # Alembic is imported where it is used: it costs a noticeable part of start-up.
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def migrate(db: Database, revision: str = "head") -> None:
    """Bring the schema to `revision`; harmless when already there."""
    _refuse_newer(db, revision_of(db))
    config = _alembic()
    from alembic import command
    from alembic.util import CommandError

    try:
        with db.engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    except DBAPIError as e:
        raise db.unreachable(e) from e
    except CommandError as e:
        raise StoreUnavailable(
            f"cannot migrate database {db.display_url}: {str(e).splitlines()[0][:200]}"
        ) from e


def _refuse_newer(db: Database, current: str | None) -> None:
    if current is not None and not KNOWN_SCHEMAS.issuperset(current.split(", ")):
        raise StoreUnavailable(
            f"database {db.display_url} is at schema {current}, newer than this "
            f"credproxy's {SCHEMA_HEAD}: upgrade credproxy"
        )


def revision_of(db: Database) -> str | None:
    """Alembic's recorded revision, None before the first migration."""
    try:
        with db.engine.connect() as connection:
            if not inspect(connection).has_table(_VERSIONS.name):
                return None
            versions = connection.execute(select(_VERSIONS.c.version_num)).scalars()
            # More than one row (branched heads) reads as neither head nor none.
            return ", ".join(sorted(versions)) or None
    except DBAPIError as e:
        raise db.unreachable(e) from e


def check_head(db: Database) -> None:
    """Raise unless the schema is at SCHEMA_HEAD."""
    current = revision_of(db)
    _refuse_newer(db, current)
    if current != SCHEMA_HEAD:
        raise StoreUnavailable(
            f"database {db.display_url} is at schema {current or 'none'}, "
            f"not {SCHEMA_HEAD}: run credproxy init"
        )
