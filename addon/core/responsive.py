"""Heavy work in a thread (a full store read, compiling a redaction set) without starving the
event loop: while any runs, a shorter switch interval and no cyclic collection.

Meanwhile the event loop waits for the GIL at every socket call, up to the switch interval
(5 ms) each time, and the cyclic collector, set off by the allocations, walks the whole heap
with the GIL held: requests then wait hundreds of ms (bench/README.md, the full reload).
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SWITCH_INTERVAL = 0.0005
_workers = 0
_lock = threading.Lock()
_interval = sys.getswitchinterval()
_collecting = True


@contextmanager
def responsive() -> Iterator[None]:
    """Around work in a thread; nests, and overlaps with other threads' (the last restores)."""
    global _workers, _interval, _collecting
    with _lock:
        if _workers == 0:
            _interval, _collecting = sys.getswitchinterval(), gc.isenabled()
            sys.setswitchinterval(SWITCH_INTERVAL)
            gc.disable()
        _workers += 1
    try:
        yield
    finally:
        with _lock:
            _workers -= 1
            if _workers == 0:
                sys.setswitchinterval(_interval)
                if _collecting:
                    gc.enable()
