"""addon/mitm/refusals.py replaces what it says, once."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpStream

from addon.mitm import installed, refusals


def test_install_wraps_the_request_head_state_once() -> None:
    refusals.install()
    wrapped = HttpStream.state_wait_for_request_headers
    assert wrapped.__module__ == refusals.__name__
    assert refusals.__name__ in installed()
    refusals.install()
    assert HttpStream.state_wait_for_request_headers is wrapped
