"""Patches of mitmproxy's internals, where it has no hook, and the one way they are installed.

Each patch module opens with which mitmproxy function it replaces, and why no hook serves,
and exposes an `install()` wearing `@once`: its first call checks the shape of what it
replaces, raising RuntimeError if mitmproxy changed (fail closed at start, never open later),
and replaces it; every later call does nothing. An install that raised installed nothing, and
the next call checks again. They are written against mitmproxy 11 and 12 (pyproject.toml
bounds it below 13); the shape checks are what makes another version fail at start.
`addon/mitm/patches.py` installs them all, in the order they wrap each other, with the one
patch that lives beside the state it reads in a higher wing (addon/proxy/signing.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

# The modules whose install() ran, in the order they ran.
_installed: dict[str, None] = {}


def once(install: Callable[[], None]) -> Callable[[], None]:
    """Make a patch module's `install` run once per process; `__wrapped__` is the unguarded
    one, for a test that checks the shape check itself."""
    name = install.__module__

    @functools.wraps(install)
    def guarded() -> None:
        if name not in _installed:
            install()
            _installed[name] = None

    return guarded


def installed() -> tuple[str, ...]:
    """The patch modules installed in this process, in order."""
    return tuple(_installed)
