"""addon/mitm/websocket.py replaces mitmproxy's WebSocket layer, once, and checks its shape."""

from __future__ import annotations

import pytest
from mitmproxy.proxy.layers import websocket as ws_layer

from addon.mitm import websocket


def test_install_makes_upgrades_use_the_redacting_layer_once() -> None:
    websocket.install()
    assert ws_layer.WebsocketLayer is websocket.RedactingWebsocketLayer
    assert issubclass(websocket.RedactingWebsocketLayer, websocket._Base)
    assert ws_layer.Fragmentizer.FRAGMENT_SIZE == 2**62  # a redacted message goes as one frame
    websocket.install()
    assert ws_layer.WebsocketLayer is websocket.RedactingWebsocketLayer


def test_install_fails_at_start_when_mitmproxy_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ws_layer.Fragmentizer, "FRAGMENT_SIZE", None)
    with pytest.raises(RuntimeError, match="WebSocket layer changed"):
        websocket.install.__wrapped__()  # type: ignore[attr-defined]  # the shape check, unguarded
