"""`credproxy init`: create or upgrade the store, and make the master key and the CA if missing."""

from __future__ import annotations

import argparse
import os
from typing import Any

from addon.cli.output import emit
from store.crypto import KEY_ENV, MasterKey, write_key_file
from store.errors import MasterKeyError
from store.settings import Settings

COMMAND = "init"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(COMMAND, parents=[common], help="create or upgrade the store, key and CA")
    p.set_defaults(func=cmd_init)


def cmd_init(args: argparse.Namespace, settings: Settings) -> int:
    # Imported when init runs, not with the parser every command builds: the ORM store
    # (SQLAlchemy, alembic) and the CA (cryptography's x509) would slow every other command.
    from store.ca import PUBLIC_CERT, ensure_ca
    from store.repository import Store

    store = Store(settings.db, None, create=True)
    store.migrate()
    revision = store.schema_revision()
    created_key = False
    if os.environ.get(KEY_ENV) or settings.key_file.exists():
        key = settings.key()
    else:
        if store.stored_key_id() is not None:
            raise MasterKeyError(
                f"{store.display_url} already has a master key; "
                f"its key file {settings.key_file} is missing"
            )
        key = MasterKey.generate(f"key file {settings.key_file}")
        write_key_file(settings.key_file, key)
        created_key = True
    store.key = key
    store.check_key(adopt=True)
    created_ca = ensure_ca(settings.certs)
    store.restrict_file()
    store.close()
    ca = settings.certs / PUBLIC_CERT
    emit(
        settings,
        {
            "db": store.display_url,
            "schema": revision,
            "key_id": key.key_id,
            "key_source": key.source,
            "key_created": created_key,
            "ca": str(ca),
            "ca_created": created_ca,
        },
        [
            f"database  {store.display_url} (schema {revision})",
            f"key       {key.source}, id {key.key_id}{' (created)' if created_key else ''}",
            f"ca        {ca}{' (created)' if created_ca else ''}",
        ],
    )
    return 0
