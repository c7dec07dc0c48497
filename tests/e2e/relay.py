"""A TCP relay between the proxy and PostgreSQL that a test can slow, cut, hang and restore,
and a PostgreSQL database of a test module's own.

This is a real network fault, not a mock: the proxy's database connections go through it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@contextmanager
def pg_database(prefix: str, required_in_ci: bool = False) -> Iterator[str]:
    """A new database, dropped afterwards; skips the test when PostgreSQL is not reachable."""
    import psycopg

    name = prefix + os.urandom(4).hex()
    try:
        admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as e:
        if required_in_ci and os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required in CI: {e}")
        pytest.skip(f"PostgreSQL not reachable: {e}")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


class Relay:
    """`delay` slows every forwarded chunk (so store calls overlap and the pool opens several
    connections); `blackhole()` makes every connection open now swallow what it is sent and
    never close (a failover or a lost NAT entry: no RST), while new connections go through."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.mode = "open"  # open | cut | hang
        self.delay = 0.0
        self._generation = 0
        self._dead_below = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "cut":
                client.close()
                continue
            with self._lock:
                self._sockets.add(client)
            if self.mode == "hang":
                continue  # accepted, never answered
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets.add(upstream)
            generation = self._generation
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b, generation), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, generation: int) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data or self.mode == "cut":
                    break
                if self.mode == "hang" or generation < self._dead_below:
                    continue  # swallow: the peer waits for an answer that never comes
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            if generation >= self._dead_below:
                for s in (src, dst):
                    try:
                        s.close()
                    except OSError:
                        pass

    def _drop_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self) -> None:
        """Close every connection and refuse new ones."""
        self.mode = "cut"
        self._drop_all()

    def hang(self) -> None:
        """Existing connections go silent; new ones are accepted and never answered."""
        self.mode = "hang"

    def blackhole(self) -> None:
        """The connections open now go silent and stay open; new ones go through."""
        self._generation += 1
        self._dead_below = self._generation

    def restore(self) -> None:
        self._drop_all()
        self.mode = "open"

    def close(self) -> None:
        self._stop = True
        self._listener.close()
        self._drop_all()
