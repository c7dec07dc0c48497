"""What `run --shared-rates` costs: one store transaction per request, against the in-memory
buckets. `python -m bench.shared_rates [--takes N]`; PostgreSQL at 127.0.0.1:5432 if it is
reachable (a database of its own, dropped after), SQLite always. Prints a markdown table."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from addon.proxy.ratelimit import Buckets, principal_limit
from store.repository import Store
from store.rules.grammar import parse_rate
from store.tables.rates import Bucket

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def _timed(take: Callable[[int], object], n: int, threads: int) -> tuple[float, float]:
    """Median and 99th percentile of one take, in ms, with `threads` callers at once."""
    durations: list[float] = []

    def one(i: int) -> None:
        started = time.perf_counter()
        take(i)
        durations.append(time.perf_counter() - started)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))
    durations.sort()
    return statistics.median(durations) * 1000, durations[int(len(durations) * 0.99)] * 1000


@contextmanager
def _pg_database() -> Iterator[str | None]:
    import psycopg

    name = "credproxy_bench_" + os.urandom(4).hex()
    try:
        admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError:
        yield None
        return
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def _store(url: str | None) -> Store | None:
    if url is None:
        return None
    try:
        store = Store(url, None, create=True)
        store.migrate()
    except Exception:  # noqa: BLE001 - a store that is not there is left out of the table
        return None
    return store


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shared_rates", description=__doc__)
    p.add_argument("--takes", type=int, default=2000, help="takes per cell (default 2000)")
    args = p.parse_args()
    rate = parse_rate("1000000/s")
    rows = []
    memory = Buckets()
    limits = [principal_limit("agent", rate, None)]
    for threads in (1, 4):
        rows.append(
            (
                "in memory (per replica)",
                threads,
                *_timed(lambda i: memory.take(limits), args.takes, threads),
            )
        )
    with tempfile.TemporaryDirectory() as tmp, _pg_database() as pg_url:
        for label, url in (
            ("SQLite", f"sqlite:///{Path(tmp) / 'bench.db'}"),
            ("PostgreSQL", pg_url),
        ):
            store = _store(url)
            if store is None:
                continue
            for threads in (1, 4):
                # One bucket per caller thread and one they share, as a grant's and a principal's.
                def take(i: int, store: Store = store, threads: int = threads) -> object:
                    own = Bucket(f"grant:{i % threads}:bench", 1e6, 1e6)
                    shared = Bucket("principal:bench", 1e6, 1e6)
                    return store.take_rates([shared, own], time.time())

                rows.append((label, threads, *_timed(take, args.takes, threads)))
            store.close()
    print("| buckets | callers at once | median ms | p99 ms |")
    print("|---|---|---|---|")
    for label, threads, median, p99 in rows:
        print(f"| {label} | {threads} | {median:.3f} | {p99:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
