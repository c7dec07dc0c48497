"""The rate_buckets table: token buckets shared by every replica (`run --shared-rates`).

A take reads and writes every bucket of a request in one transaction, with the rows locked
(PostgreSQL) or the database (SQLite): an exact total over replicas, at the cost of one store
round trip per request. Levels refill by each replica's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite

from store.db.engine import Database
from store.db.models import RateBucket


class Bucket(NamedTuple):
    key: str  # names the limit, its rate and its capacity: a changed limit starts afresh
    per_second: float
    capacity: float


def take(db: Database, buckets: Sequence[Bucket], now: float) -> tuple[int, float] | None:
    """A token from every bucket, or from none: the index of the first that refuses and the
    seconds until it would admit a request."""
    keys = sorted({b.key for b in buckets})  # one lock order for every caller
    with db.session() as session, session.begin():
        dialect = session.get_bind().dialect.name
        module = postgresql if dialect == "postgresql" else sqlite
        fresh = [{"key": b.key, "tokens": b.capacity, "at": now} for b in buckets]
        session.execute(module.insert(RateBucket).values(fresh).on_conflict_do_nothing())
        rows = {
            row.key: row
            for row in session.scalars(
                select(RateBucket)
                .where(RateBucket.key.in_(keys))
                .order_by(RateBucket.key)
                .with_for_update()
            )
        }
        levels = []
        for index, bucket in enumerate(buckets):
            row = rows[bucket.key]
            level = min(bucket.capacity, row.tokens + max(0.0, now - row.at) * bucket.per_second)
            if level < 1.0:
                return index, (1.0 - level) / bucket.per_second
            levels.append((row, level))
        for row, level in levels:
            row.tokens, row.at = level - 1.0, now
        return None
