"""How each kind of secret reference is read: a file here; AWS Secrets Manager and Vault in
addon/proxy/remote.py, imported only when a reference of theirs is used.

A backend's failure is a SourceError with one of the fixed classes below: its own text (an
exception's message, a response body) is never kept, logged or shown.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Protocol

from store.rules.secretref import FILE, SecretRef

MAX_VALUE = 64 * 1024
# What went wrong, as the audit line, the metrics and `credential list` say it.
NOT_FOUND = "not-found"
PERMISSION_DENIED = "permission-denied"
UNREADABLE = "unreadable"
EMPTY = "empty"
TOO_LARGE = "too-large"
MALFORMED = "malformed"  # not the scheme's shape (a sigv4 key pair that is no JSON, say)
UNAVAILABLE = "unavailable"  # the backend did not answer, or answered with a server error
AUTH_FAILED = "auth-failed"  # the backend refused credproxy's own credentials
NOT_INSTALLED = "not-installed"  # the kind's optional client library is missing
ERRORS = (
    NOT_FOUND,
    PERMISSION_DENIED,
    UNREADABLE,
    EMPTY,
    TOO_LARGE,
    MALFORMED,
    UNAVAILABLE,
    AUTH_FAILED,
    NOT_INSTALLED,
)


class SourceError(Exception):
    """A reference that cannot be read now; `kind` is one of ERRORS, and all it says."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Backend(Protocol):
    # Watched: its identity is looked at every poll, and the value read when it changed.
    # Otherwise the value is fetched again every TTL.
    watched: bool

    def identity(self, ref: SecretRef) -> object: ...

    def fetch(self, ref: SecretRef) -> bytes: ...


def trimmed(raw: bytes) -> bytes:
    """One trailing newline off, as `credential add` and secret_file read a secret.

    Raises: SourceError."""
    if raw.endswith(b"\r\n"):
        raw = raw[:-2]
    elif raw.endswith(b"\n"):
        raw = raw[:-1]
    if len(raw) > MAX_VALUE:
        raise SourceError(TOO_LARGE)
    if not raw:
        raise SourceError(EMPTY)
    return raw


def _os_error(e: OSError) -> SourceError:
    if isinstance(e, FileNotFoundError | NotADirectoryError):
        return SourceError(NOT_FOUND)
    if isinstance(e, PermissionError):
        return SourceError(PERMISSION_DENIED)
    return SourceError(UNREADABLE)


class Files:
    """file:/PATH. kubelet rotates a mounted Secret by writing a new `..<timestamp>` folder and
    swapping the `..data` symlink the key's own symlink goes through: the identity is the
    file the path resolves to now (followed through every link), so the swap shows."""

    watched = True

    def identity(self, ref: SecretRef) -> object:
        try:
            info = os.stat(ref.target)
            real = os.path.realpath(ref.target)
        except OSError as e:
            raise _os_error(e) from None
        return (real, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    def fetch(self, ref: SecretRef) -> bytes:
        # Opened without blocking and read only if it is a regular file: a FIFO (or a device)
        # swapped in at the path would otherwise hold the reading thread, and its source,
        # forever.
        try:
            fd = os.open(ref.target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as e:
            raise _os_error(e) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SourceError(UNREADABLE)
            os.set_blocking(fd, True)
            raw = b""
            while len(raw) <= MAX_VALUE + 2:
                piece = os.read(fd, MAX_VALUE + 3 - len(raw))
                if not piece:
                    break
                raw += piece
        except OSError as e:
            raise _os_error(e) from None
        finally:
            os.close(fd)
        return trimmed(raw)


def default_backends() -> dict[str, Callable[[], Backend]]:
    """Each kind's backend, built when a reference of that kind is first used (the remote
    kinds are added by addon/proxy/sources.py, which imports addon/proxy/remote.py)."""
    return {FILE: Files}
