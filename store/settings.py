"""Where the store, the master key and the CA live: flags first, then CREDPROXY_*, then defaults."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from store.crypto import MasterKey, load_master_key
from store.db import lite
from store.errors import InvalidInput

if TYPE_CHECKING:
    from store.repository import Store

DEFAULT_DB = "sqlite:///credproxy.db"
DEFAULT_KEY_FILE = "credproxy.key"
DEFAULT_CERTS = "certs"
DEFAULT_ADVERTISE = "127.0.0.1:8080"


@dataclass(frozen=True)
class Settings:
    """Resolved once from the command line's flags and the environment."""

    db: str
    key_file: Path
    certs: Path
    advertise: str
    json: bool

    @classmethod
    def resolve(cls, args: argparse.Namespace) -> Settings:
        env = os.environ
        db = args.db or env.get("CREDPROXY_DB") or DEFAULT_DB
        try:
            if lite.sqlite_file(db) is None:
                from store.db.engine import parse_url  # SQLAlchemy: only for the URLs it serves

                parse_url(db)
        except InvalidInput as e:
            raise InvalidInput(f"{'--db' if args.db else 'CREDPROXY_DB'}: {e}") from e
        return cls(
            db=db,
            key_file=Path(args.key_file or env.get("CREDPROXY_KEY_FILE") or DEFAULT_KEY_FILE),
            certs=Path(args.certs or env.get("CREDPROXY_CERTS") or DEFAULT_CERTS),
            advertise=env.get("CREDPROXY_ADVERTISE") or DEFAULT_ADVERTISE,
            json=bool(getattr(args, "json", False)),
        )

    def key(self) -> MasterKey:
        return load_master_key(self.key_file, os.environ)

    def store(self) -> Store:
        """Open the store and check that it is migrated and that the key is its own."""
        from store.repository import Store

        store = Store(self.db, self.key())
        store.check_ready()
        return store

    def reader(self) -> Store:
        """Open the store for commands that read no secret: without the key, never creating."""
        from store.repository import Store

        store = Store(self.db, None)
        store.check_ready()
        return store

    def quick(self, *, key: bool = True) -> lite.Store | Store:
        """The store for `principal add`, `grant add` and `grant list`, checked as store()
        (or, without `key`, reader()) checks it: on a plain SQLite URL through sqlite3 alone
        (store/db/lite.py), so that the call never imports SQLAlchemy; otherwise the full one."""
        path = lite.sqlite_file(self.db)
        if path is None:
            return self.store() if key else self.reader()
        return lite.Store(self.db, path, self.key() if key else None)
