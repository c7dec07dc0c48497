"""addon/mitm/refusals.py replaces what it says, once."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpStream

from addon.mitm import refusals


def test_install_wraps_the_request_head_state_once() -> None:
    refusals.install()
    wrapped = HttpStream.state_wait_for_request_headers
    assert getattr(wrapped, "_credproxy_refusals", False)
    refusals.install()
    assert HttpStream.state_wait_for_request_headers is wrapped
