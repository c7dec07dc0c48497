"""Heavy work in a thread keeps the event loop responsive (addon/core/responsive.py)."""

from __future__ import annotations

import gc
import sys

import pytest

from addon.core.responsive import SWITCH_INTERVAL, responsive


def test_work_in_a_thread_pauses_the_cyclic_collector_and_restores_it() -> None:
    interval, collecting = sys.getswitchinterval(), gc.isenabled()
    gc.enable()
    try:
        with responsive():
            with responsive():  # the periodic read and a forced one, overlapping
                assert not gc.isenabled()
            assert not gc.isenabled()
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)
        assert gc.isenabled() and sys.getswitchinterval() == pytest.approx(interval)
        gc.disable()  # start-up: the runner turns it on once it listens
        with responsive():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable() if collecting else gc.disable()
