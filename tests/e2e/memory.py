"""The proxy's resident memory, sampled while a test pushes against it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
MEMORY_BOUND = 32 * MIB  # what the proxy may grow by while a test pushes against it
BIG = 64 * MIB  # a body larger than the memory bound


def rss(pid: int) -> int:
    """The process's resident memory in bytes, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


class Peak:
    """Samples a process's VmRSS every 20 ms in a thread; `growth` is peak minus start."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = self.peak = rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss(self.pid))

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.start
