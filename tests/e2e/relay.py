"""A TCP relay between the proxy and PostgreSQL that a test can cut, hang and restore.

This is a real network fault, not a mock: the proxy's database connections go through it.
"""

from __future__ import annotations

import socket
import threading


class Relay:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.mode = "open"  # open | cut | hang
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
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data or self.mode == "cut":
                    break
                if self.mode == "hang":
                    continue  # swallow: the peer waits for an answer that never comes
                dst.sendall(data)
        except OSError:
            pass
        finally:
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

    def restore(self) -> None:
        self._drop_all()
        self.mode = "open"

    def close(self) -> None:
        self._stop = True
        self._listener.close()
        self._drop_all()
