"""A local TLS model provider that answers like OpenAI and Anthropic: JSON and SSE, with usage.

POST /v1/chat/completions (OpenAI) and /v1/messages (Anthropic). The request's model picks
a behaviour: `no-usage` leaves usage out, `cut` stops a stream midway and drops the
connection, `gated` sends its first events, then waits for `gate` before the rest, `long`
writes as much as the request's output limit lets it (LONG without one). Every answer reports
INPUT tokens in and OUTPUT tokens out (`long`: its limit; Anthropic's split as the API splits
them: cache reads beside input_tokens, output_tokens cumulative in message_delta).
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.e2e.upstream import context_for

NAMES = ["api.openai.test", "api.anthropic.test"]
INPUT, OUTPUT = 100, 20
LONG = 1000  # what `long` writes when the request sets no output limit
WORDS = ["Budgets ", "are ", "read ", "from ", "the ", "answers."]
COMPLETION = "".join(WORDS)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        with self.server.lock:
            self.server.received.append((self.path, body))
        model = body.get("model", "")
        if self.path == "/v1/chat/completions":
            events = _openai(model, body)
        elif self.path == "/v1/messages":
            events = _anthropic(model, body)
        else:
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        if not body.get("stream"):
            payload = json.dumps(next(events)).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i, event in enumerate(events):
            if model == "cut" and i == 3:
                self.wfile.flush()
                self.connection.close()  # no last chunk: a cut stream
                return
            if model == "gated" and i == 2 and not self.server.gate.wait(10):
                return
            data = event if isinstance(event, bytes) else _frame(event)
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _frame(event: dict[str, Any]) -> bytes:
    named = f"event: {event['type']}\n" if "type" in event else ""
    return f"{named}data: {json.dumps(event)}\n\n".encode()


def _written(model: str, body: dict[str, Any], *keys: str) -> int:
    """What the model writes: OUTPUT, or for `long` as much as the request lets it."""
    if model != "long":
        return OUTPUT
    return min([body[k] for k in keys if body.get(k) is not None] or [LONG])


def _openai(model: str, body: dict[str, Any]) -> Iterator[Any]:
    written = _written(model, body, "max_completion_tokens", "max_tokens")
    usage = (
        None
        if model == "no-usage"
        else {
            "prompt_tokens": INPUT,
            "completion_tokens": written,
            "total_tokens": INPUT + written,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    )
    if not body.get("stream"):
        message = {"role": "assistant", "content": COMPLETION}
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }
        yield answer | ({"usage": usage} if usage else {})
        return
    include = bool(body.get("stream_options", {}).get("include_usage")) and usage is not None
    for word in WORDS:
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}],
        }
        yield chunk | ({"usage": None} if include else {})
    if include:
        yield {"id": "chatcmpl-1", "model": model, "choices": [], "usage": usage}
    yield b"data: [DONE]\n\n"


def _anthropic(model: str, body: dict[str, Any]) -> Iterator[Any]:
    written = _written(model, body, "max_tokens")
    usage = {"input_tokens": INPUT - 30, "cache_read_input_tokens": 30, "output_tokens": written}
    if not body.get("stream"):
        answer = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": COMPLETION}],
            "stop_reason": "end_turn",
        }
        yield answer | ({} if model == "no-usage" else {"usage": usage})
        return
    start = {"id": "msg_1", "type": "message", "role": "assistant", "model": model, "content": []}
    if model != "no-usage":
        start["usage"] = usage | {"output_tokens": 1}
    yield {"type": "message_start", "message": start}
    yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    for word in WORDS:
        delta = {"type": "text_delta", "text": word}
        yield {"type": "content_block_delta", "index": 0, "delta": delta}
    yield {"type": "content_block_stop", "index": 0}
    last = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}
    yield last | ({} if model == "no-usage" else {"usage": {"output_tokens": written}})
    yield {"type": "message_stop"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    context: ssl.SSLContext
    lock: threading.Lock
    received: list[tuple[str, dict[str, Any]]]
    gate: threading.Event

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        # The handshake runs in the handler's thread, on first read.
        return self.context.wrap_socket(
            sock, server_side=True, do_handshake_on_connect=False, suppress_ragged_eofs=True
        ), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class FakeModels:
    """Serves NAMES over TLS with a certificate from `ca` (trustme) on 127.0.0.1."""

    def __init__(self, ca: Any) -> None:
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.context = context_for(ca, NAMES, lambda _: None)
        self.server.lock = threading.Lock()
        self.server.received = []
        self.server.gate = threading.Event()
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def received(self) -> list[tuple[str, dict[str, Any]]]:
        return self.server.received

    @property
    def gate(self) -> threading.Event:
        return self.server.gate

    def __enter__(self) -> FakeModels:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
