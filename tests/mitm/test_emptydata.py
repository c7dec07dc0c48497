"""addon/mitm/emptydata.py: an empty piece of a streamed body never reaches a stream function
as b"", the marker of the body's end."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from mitmproxy.proxy.layers.http import HttpStream
from mitmproxy.proxy.layers.http._events import (
    RequestData,
    RequestEndOfMessage,
    ResponseData,
    ResponseEndOfMessage,
)

from addon.mitm import emptydata, patches
from addon.proxy import signing


def _stream(calls: list[bytes]) -> Any:
    def stream(chunk: bytes) -> bytes:
        calls.append(chunk)
        return chunk

    return stream


def _layer(calls: list[bytes]) -> Any:
    message = SimpleNamespace(stream=_stream(calls), trailers=None, timestamp_end=None)
    return SimpleNamespace(
        flow=SimpleNamespace(request=message, response=message),
        stream_id=1,
        context=SimpleNamespace(client=object(), server=object()),
        send_response=lambda already_streamed=False: iter(()),
        server_state=None,
        state_done=None,
    )


@pytest.mark.parametrize(
    ("state", "data", "end"),
    [
        ("state_stream_response_body", ResponseData, ResponseEndOfMessage),
        ("state_stream_request_body", RequestData, RequestEndOfMessage),
    ],
)
def test_only_the_end_calls_the_stream_with_nothing(state: str, data: Any, end: Any) -> None:
    patches.install_all(signing.install)
    calls: list[bytes] = []
    layer = _layer(calls)
    run = getattr(HttpStream, state)
    sent = [*run(layer, data(1, b"se")), *run(layer, data(1, b"")), *run(layer, data(1, b"cret"))]
    assert calls == [b"se", b"cret"]
    assert len(sent) == 2
    if end is ResponseEndOfMessage:
        list(run(layer, end(1)))
        assert calls == [b"se", b"cret", b""]


def test_a_changed_body_state_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def state_stream_response_body(self: Any, event: Any) -> Any:
        yield from ()

    monkeypatch.setattr(HttpStream, "state_stream_response_body", state_stream_response_body)
    with pytest.raises(RuntimeError, match="mitmproxy changed"):
        emptydata.install.__wrapped__()  # type: ignore[attr-defined]
