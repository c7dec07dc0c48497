"""What `exec --isolate` shows CMD of the file system: bubblewrap's arguments, and the refusals.

The sandbox sees the host's tree read-only, minus the hidden set (credproxy's state: the
store and its journals, the master key, the CA folder, a database's socket) and minus the
masked folders (`/tmp`, `/run`, `--hide`), which are empty. A folder on the way to a hidden
path is shown as its listing at launch with the hidden entry left out, so that a file the
proxy writes there later (a journal, a rotated key) never appears inside. The working
directory and `--rw` paths are writable; none of them may hold a hidden path.
Pure but for reading listings and resolving paths.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from store.db import lite
from store.errors import CredproxyError, InvalidInput
from store.settings import DEFAULT_KEY_FILE, Settings

MASKED = (Path("/tmp"), Path("/run"))  # noqa: S108 - an empty tmpfs inside, not a file we use
# Each with /var/run/... as the symlink to /run: the folders where local databases listen.
SOCKET_DIRS = (Path("/run/postgresql"), Path("/run/mysqld"), Path("/var/lib/mysql"))
SQLITE_SIBLINGS = ("", "-wal", "-shm", "-journal")
# Files that hold the credentials credproxy reads remote secrets with (addon/proxy/remote.py):
# Vault's token or login files, the AWS credential chain's files, named by these variables.
BACKEND_FILE_VARS = (
    "VAULT_TOKEN_FILE",
    "VAULT_APPROLE_ROLE_ID_FILE",
    "VAULT_APPROLE_SECRET_ID_FILE",
    "VAULT_K8S_TOKEN_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
)
# Where those files are when no variable names them: the AWS chain's default file, and a
# pod's service-account folder (its token logs in to Vault, or to the Kubernetes API).
BACKEND_DEFAULTS = (
    Path("~/.aws/credentials"),
    Path("/var/run/secrets/kubernetes.io/serviceaccount"),
    Path("/run/secrets/kubernetes.io/serviceaccount"),
)
UNSHARE = ("--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL")


class IsolationUnavailable(CredproxyError):
    pass


@dataclass(frozen=True)
class Pinned:
    """A path the operator named, held open from the check to the mount: bubblewrap mounts
    this very folder (/proc/self/fd/N), whatever its name points at by then."""

    fd: int
    real: Path
    writable: bool


@dataclass(frozen=True)
class View:
    """The sandbox's file system, resolved: what is hidden, masked, writable, shown again."""

    hidden: frozenset[Path]
    masked: tuple[Path, ...]  # each an empty tmpfs
    pinned: tuple[Pinned, ...]  # the working directory first, then --rw and --ro
    shown: tuple[Path, ...]  # read-only, also where masked (the CA, the helper's Python)

    @property
    def workdir(self) -> Path:
        return self.pinned[0].real

    def fds(self) -> list[int]:
        return [p.fd for p in self.pinned]


def bwrap() -> str:
    tool = shutil.which("bwrap")
    if tool is None:
        raise IsolationUnavailable(
            "--isolate needs bubblewrap (bwrap; Debian and Ubuntu: apt install bubblewrap), "
            "which is not installed"
        )
    return tool


def check() -> None:
    """Raise IsolationUnavailable unless bubblewrap can make its namespaces here."""
    done = subprocess.run(  # noqa: S603 - a fixed argument list, no shell
        [bwrap(), "--ro-bind", "/", "/", *UNSHARE, "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["unknown reason"])[-1]
        raise IsolationUnavailable(
            f"--isolate cannot create its sandbox here ({why}): unprivileged user namespaces "
            "may be switched off (sysctl kernel.unprivileged_userns_clone, or AppArmor's "
            "restriction on Ubuntu 24.04 and later)"
        )


def state_paths(settings: Settings) -> set[Path]:
    """Everything of credproxy's that opens a secret or changes the policy, resolved."""
    paths = {settings.key_file, settings.certs, *SOCKET_DIRS}
    database = _sqlite_database(settings.db)
    if database is not None:
        paths |= {database.with_name(database.name + s) for s in SQLITE_SIBLINGS}
        # `init`'s key beside the store, also when the key now comes from the environment.
        paths.add(database.with_name(DEFAULT_KEY_FILE))
    paths |= _socket_dirs(settings.db)
    return {_real(p) for p in paths} | referenced_files(settings) | backend_files(os.environ)


def backend_files(environ: Mapping[str, str]) -> set[Path]:
    """The files credproxy logs in to secret backends with, that exist, as named and
    resolved: whoever reads Vault's token reads every secret it may read."""
    paths = [Path(environ[v]) for v in BACKEND_FILE_VARS if environ.get(v)]
    for default in BACKEND_DEFAULTS:
        try:
            paths.append(default.expanduser())
        except RuntimeError:  # no home to expand `~` to: nothing of it to hide
            continue
    found: set[Path] = set()
    for path in paths:
        try:
            present = path.exists()
        except OSError:  # not even stat-able by this user: nor by CMD, which runs as it or less
            continue
        if present:
            found |= {path, _real(path)}
    return found


def referenced_files(settings: Settings) -> set[Path]:
    """The files credentials' secret references name (`file:/...`), as named and resolved: a
    secret as much as the store's. A mounted Kubernetes Secret's folder (it holds `..data`) is
    taken whole: its other keys, and the timestamped folder the links lead to."""
    found: set[Path] = set()
    try:
        reader = settings.reader()
    except CredproxyError:
        return found  # no store to read: exec fails on its session token before CMD runs
    try:
        rows = reader.list_credentials()
    finally:
        reader.close()
    for row in rows:
        ref = row.secret_ref or ""
        if not ref.startswith("file:"):
            continue
        path = Path(ref.removeprefix("file:"))
        found |= {path, _real(path)}
        if (path.parent / "..data").exists():
            found |= {path.parent, _real(path.parent)}
    return found


def _sqlite_database(url: str) -> Path | None:
    path = lite.sqlite_file(url)
    if path is not None or not url.startswith("sqlite"):
        return path
    # SQLAlchemy only for a URL lite cannot read: exec's start-up stays without it.
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    return Path(database) if database and database != ":memory:" else None


def _socket_dirs(url: str) -> set[Path]:
    """Unix socket folders a server store's URL names (`?host=/run/...`, `unix_socket=`)."""
    if url.startswith("sqlite"):
        return set()
    from sqlalchemy.engine import make_url

    found: set[Path] = set()
    parsed = make_url(url)
    for key in ("host", "unix_socket"):
        values = parsed.query.get(key, ())
        for value in (values,) if isinstance(values, str) else values:
            if value.startswith("/"):
                found.add(Path(value) if key == "host" else Path(value).parent)
    if parsed.host and parsed.host.startswith("/"):
        found.add(Path(parsed.host))
    return found


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _within(path: Path, top: Path) -> bool:
    return path == top or top in path.parents


def view(
    settings: Settings,
    workdir: Path,
    *,
    read_write: Sequence[Path] = (),
    read_only: Sequence[Path] = (),
    hide: Sequence[Path] = (),
    exposed: Iterable[Path] = (),
) -> View:
    """The sandbox for CMD; InvalidInput when a writable path would hold credproxy's state
    or a path to show would expose it. The named paths are held open (close them with
    `release`)."""
    hidden = frozenset(state_paths(settings) | {_real(p) for p in hide})
    for path in _secret_files(settings):
        if path.is_file() and path.stat().st_nlink > 1:
            raise InvalidInput(
                f"--isolate: {path} has another name (a hard link) that the sandbox would show"
            )
    pinned: list[Pinned] = []
    try:
        named = [(workdir, "the working directory", True)]
        named += [(p, f"--rw {p}", True) for p in read_write]
        named += [(p, f"--ro {p}", False) for p in read_only]
        for path, what, writable in named:
            pin = _pin(path, what, writable)
            pinned.append(pin)
            real = pin.real
            if writable:
                inside = sorted(
                    h
                    for h in hidden
                    if (_within(h, real) and os.path.lexists(h)) or _within(real, h)
                )
                if inside:
                    raise InvalidInput(
                        f"--isolate: {what} holds credproxy's state ({inside[0]}), which the "
                        "command could then read or change: run it from another directory"
                    )
            else:
                covered = sorted(h for h in hidden if _within(h, real) or _within(real, h))
                if covered:
                    raise InvalidInput(
                        f"--isolate: {what} would show {covered[0]}, which is hidden"
                    )
    except BaseException:
        release_fds([p.fd for p in pinned])
        raise
    shown = tuple(_real(p) for p in exposed)
    return View(hidden, tuple(_real(p) for p in MASKED), tuple(pinned), shown)


def _pin(path: Path, what: str, writable: bool) -> Pinned:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidInput(f"--isolate: {what}: {e.strerror}") from e
    # The folder itself, as the kernel names it now: what the checks and the mount both see.
    return Pinned(fd, Path(os.readlink(f"/proc/self/fd/{fd}")), writable)


def release_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)


def _secret_files(settings: Settings) -> list[Path]:
    """The key, the SQLite store and every file of the CA folder (its private key)."""
    found = [settings.key_file]
    database = _sqlite_database(settings.db)
    if database is not None:
        found.append(database)
    if settings.certs.is_dir():
        found += [p for p in settings.certs.iterdir() if p.is_file()]
    found += [p for p in referenced_files(settings) | backend_files(os.environ) if p.is_file()]
    return found


def arguments(v: View) -> list[str]:
    """bubblewrap's arguments for the view; later mounts cover earlier ones."""
    args: list[str] = []
    listings: list[Path] = []
    # /proc and /dev get the sandbox's own; masked folders an empty tmpfs, just after.
    _show(
        Path("/"), v.hidden | {Path("/proc"), Path("/dev"), *v.masked}, args, listings, "--ro-bind"
    )
    for path in v.masked:
        args += ["--tmpfs", str(path)]
    for path in v.shown:  # the CA inside its hidden folder: shown by itself
        if path not in v.hidden:
            _show(path, v.hidden, args, listings, "--ro-bind")
    for pin in v.pinned:  # checked above: none holds, or lies inside, a hidden path
        # bubblewrap mounts the open folder itself and closes the descriptor: it never
        # reaches CMD, where `..` from it would climb the host's tree past every mount.
        bind = "--bind-fd" if pin.writable else "--ro-bind-fd"
        args += [bind, str(pin.fd), str(pin.real)]
    # Last, once everything shown inside them is mounted: a listing takes no new entries.
    args += ["--dev", "/dev", "--proc", "/proc"]
    for path in (*listings, Path("/")):
        args += ["--remount-ro", str(path)]
    args += ["--chdir", str(v.workdir)]
    return args


def _show(
    path: Path, hidden: frozenset[Path], args: list[str], listings: list[Path], bind: str
) -> None:
    """Mount `path` as it is, or, when a hidden path lies beneath, each entry but that one."""
    if path in hidden:
        return
    if not any(path in h.parents for h in hidden):
        args += [bind + "-try", str(path), str(path)]
        return
    if path != Path("/"):
        args += ["--tmpfs", str(path)]
        listings.append(path)
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        entries = []
    for entry in entries:
        child = Path(entry.path)
        if _kin(child, hidden):
            continue
        try:
            mode = os.lstat(child).st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            args += ["--symlink", os.readlink(child), str(child)]
        else:
            _show(child, hidden, args, listings, bind)


def _kin(path: Path, hidden: frozenset[Path]) -> bool:
    """A hidden path, or a sibling named after one: `credproxy.key.new` and
    `.credproxy.key.1a2b.tmp` while the key rotates, `credproxy.db.exchange-lock`, a journal."""
    if path in hidden:
        return True
    name = path.name
    for h in hidden:
        if h.parent == path.parent and name.startswith((f"{h.name}.", f"{h.name}-", f".{h.name}.")):
            return True
    return False


def shown(v: View, files: Iterable[Path]) -> View:
    """The view with these files (the CA, its truststore) shown as well, private keys never."""
    added = tuple(_real(p) for p in files)
    for path in added:
        if b"PRIVATE KEY" in path.read_bytes():
            raise InvalidInput(f"--isolate: {path} holds a private key and is not shown")
    return View(v.hidden, v.masked, v.pinned, v.shown + added)
