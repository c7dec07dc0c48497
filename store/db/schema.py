"""Schema readiness: the revision a database is at, migrating it, and refusing a newer one."""

from __future__ import annotations

from typing import Any

from sqlalchemy import column, inspect, select, table
from sqlalchemy.exc import DBAPIError

from store.db.engine import Database
from store.db.revisions import MIGRATIONS, refuse_newer
from store.db.revisions import check_head as check_revision
from store.errors import StoreUnavailable

_VERSIONS = table("alembic_version", column("version_num"))


def _alembic() -> Any:
    # Alembic is imported where it is used: it costs a noticeable part of start-up.
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def migrate(db: Database, revision: str = "head") -> None:
    """Bring the schema to `revision`; harmless when already there."""
    refuse_newer(db.display_url, revision_of(db))
    config = _alembic()
    # Alembic only when migrating: every other command's start-up stays without it.
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
    check_revision(db.display_url, revision_of(db))
