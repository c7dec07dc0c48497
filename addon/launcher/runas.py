"""Who CMD runs as, and whether that user could open credproxy's secrets.

Without `--isolate`, CMD sees the file system as its user does: exec refuses to start it
when that user can read the master key or the CA's key, or change the SQLite store, unless
the operator says `--unsafe-state-access`. `--user NAME` (exec as root) runs CMD as another
user through util-linux's setpriv.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from addon.launcher.sandbox import referenced_files
from store.ca import PRIVATE_BUNDLE
from store.db import lite
from store.errors import InvalidInput
from store.settings import Settings


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: frozenset[int]
    home: str


def current() -> User:
    entry = _entry(os.getuid())
    return User(
        entry.pw_name if entry else str(os.getuid()),
        os.getuid(),
        os.getgid(),
        frozenset(os.getgroups()) | {os.getgid()},
        entry.pw_dir if entry else os.environ.get("HOME", "/"),
    )


def named(name: str) -> User:
    """The user `--user` names; InvalidInput when unknown or when exec cannot switch."""
    if os.geteuid() != 0:
        raise InvalidInput("--user needs exec to run as root")
    try:
        entry = pwd.getpwnam(name) if not name.isdigit() else pwd.getpwuid(int(name))
    except KeyError as e:
        raise InvalidInput(f"--user {name!r}: no such user") from e
    if entry.pw_uid == 0:
        raise InvalidInput("--user: CMD would run as root, which can read every secret")
    return User(
        entry.pw_name,
        entry.pw_uid,
        entry.pw_gid,
        frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid)),
        entry.pw_dir,
    )


def _entry(uid: int) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwuid(uid)
    except KeyError:
        return None


def switch(user: User) -> list[str]:
    """The command prefix that runs CMD as `user`, with no way back to root."""
    tool = shutil.which("setpriv")
    if tool is None:
        raise InvalidInput("--user needs setpriv (util-linux), which is not installed")
    return [
        tool,
        f"--reuid={user.uid}",
        f"--regid={user.gid}",
        f"--groups={','.join(str(g) for g in sorted(user.groups)) or user.gid}",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


def exposed_state(settings: Settings, user: User) -> str | None:
    """What of credproxy's state `user` could read or change, named for the refusal; None."""
    checks: list[tuple[Path, str, int]] = [
        (settings.key_file, "read the master key", os.R_OK),
        (settings.certs / PRIVATE_BUNDLE, "read the CA's private key", os.R_OK),
    ]
    database = lite.sqlite_file(settings.db)
    if database is not None:
        checks += [
            (database, "change the store", os.W_OK),
            (database.parent, "change the store (its folder)", os.W_OK),
        ]
    # Secrets held in files (credentials' file: references) are secrets too.
    for held in sorted(referenced_files(settings)):
        if held.is_file():
            checks.append((held, "read a credential's secret file", os.R_OK))
    for path, what, want in checks:
        if path.exists() and _may(path, user, want):
            return f"{what} ({path})"
    return None


def may_run(path: Path, user: User) -> bool:
    """Whether `user` may execute `path` (resolved, by mode bits) and read its folder."""
    real = Path(os.path.realpath(path))
    return _may(real, user, os.X_OK) and _may(real.parent, user, os.R_OK)


def _may(path: Path, user: User, want: int) -> bool:
    """Whether `user` may open `path` for `want`, by its mode bits and its folders'."""
    if user.uid == 0:
        return True
    real = Path(os.path.realpath(path))
    for folder in reversed(real.parents):
        if not _bits(folder, user, os.X_OK):
            return False
    return _bits(real, user, want)


def _bits(path: Path, user: User, want: int) -> bool:
    try:
        info = path.stat()
    except OSError:
        return False
    shift = 6 if info.st_uid == user.uid else 3 if info.st_gid in user.groups else 0
    need = {os.R_OK: stat.S_IROTH, os.W_OK: stat.S_IWOTH, os.X_OK: stat.S_IXOTH}[want]
    return bool(info.st_mode & (need << shift))
