"""What a change logs in change_log, so that every proxy reads only what it touched.

Pure: store/db/engine.py writes these rows through SQLAlchemy and store/db/lite.py through sqlite3,
and both must write the same ones.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

# What a change touched, as change_log names it. A change that notes nothing is logged as ALL:
# every proxy then reloads the whole store, which is always right, only slower.
PRINCIPAL, TOKEN, CREDENTIAL, GRANT, REQUEST, ALL = (
    "principal",
    "token",
    "credential",
    "grant",
    "request",
    "all",
)
# Every change also logs a random mark: two stores at one counter with different marks (one
# restored in place, and changed since) are different states; a replica then reads whole.
MARK = "mark"
# change_log keeps the last LOG_KEPT changes; a proxy further behind reloads whole.
LOG_KEPT = 10_000
PRUNE_EVERY = 1_000


def rows(noted: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """The (kind, row id) pairs to log for a change that noted `noted`, with its mark."""
    kept = set(noted)
    if any(kind == ALL for kind, _ in kept):
        kept = {(ALL, 0)}  # everything: the rows beside it say no more
    return sorted((kept or {(ALL, 0)}) | {(MARK, secrets.randbelow(2**31))})


def pruned_through(counter: int) -> int | None:
    """After the change numbered `counter`: delete the log's rows up to this counter, if any."""
    return counter - LOG_KEPT if counter % PRUNE_EVERY == 0 else None
