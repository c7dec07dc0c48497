"""addon/mitm/bounds.py: a client's first bytes count as read while mitmproxy's next_layer hook
runs (the CI flake of a burst of 40 CONNECTs: a connection whose head waited in NextLayer was
displaced as silent)."""

from __future__ import annotations

from typing import Any

import pytest
from mitmproxy import options
from mitmproxy.proxy import context, events, layer
from mitmproxy.test import tflow

from addon.mitm import bounds


def test_bytes_a_next_layer_holds_count_as_a_head_read(monkeypatch: pytest.MonkeyPatch) -> None:
    bounds.install()
    client = tflow.tclient_conn()
    server = tflow.tserver_conn()
    read: list[Any] = []
    monkeypatch.setattr(bounds, "on_head_read", [read.append])
    for conn, data in ((server, b"an upstream's"), (client, b"CONNECT a:443 HTTP/1.1\r\n")):
        nxt = layer.NextLayer(context.Context(client, options.Options()))
        list(nxt.handle_event(events.DataReceived(conn, data)))  # asks the next_layer hook
    assert read == [client]
