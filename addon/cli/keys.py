"""`credproxy key rotate`: every secret re-sealed under a new master key."""

from __future__ import annotations

import argparse
import os
from typing import Any

from addon.cli.output import emit
from addon.cli.parsing import group
from store.crypto import KEY_ENV, MasterKey, write_key_file
from store.errors import MasterKeyError
from store.settings import Settings

COMMAND = "key"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    key = group(sub, COMMAND, "the master key")
    p = key.add_parser("rotate", parents=[common], help="re-seal every secret under a new key")
    p.set_defaults(func=cmd_key_rotate)


def cmd_key_rotate(args: argparse.Namespace, settings: Settings) -> int:
    if os.environ.get(KEY_ENV):
        raise MasterKeyError(
            f"the key comes from {KEY_ENV}: unset it to rotate into --key-file, "
            "then set it from the new file"
        )
    store = settings.store()
    new = MasterKey.generate(f"key file {settings.key_file}")
    pending = settings.key_file.with_name(settings.key_file.name + ".new")
    # Write the new key before the secrets are re-sealed under it, so a crash never leaves
    # secrets sealed under a key that exists nowhere.
    pending.unlink(missing_ok=True)
    write_key_file(pending, new)
    try:
        resealed = store.rotate_key(new)
    except BaseException:
        pending.unlink(missing_ok=True)
        raise
    os.replace(pending, settings.key_file)
    emit(
        settings,
        {"key_id": new.key_id, "resealed": resealed},
        [f"rotated the master key to id {new.key_id}; re-sealed {resealed} secret(s)"],
    )
    return 0
