"""The --isolate forwarder's head rewrite: the session's Proxy-Authorization, never the agent's."""

from __future__ import annotations

import socket
import threading

import pytest

from addon.launcher.isolate import with_credentials

AUTH = "Basic YWdlbnQ6dG9r"


def test_connect_gets_the_sessions_credentials_in_place_of_any_sent() -> None:
    head = b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\nProxy-Authorization: Basic eA=="
    assert with_credentials(head, AUTH) == (
        b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n"
        b"Proxy-Authorization: Basic YWdlbnQ6dG9r\r\n\r\n"
    )


def test_a_plain_request_is_stamped_and_closed_after_its_answer() -> None:
    head = (
        b"GET http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\nConnection: keep-alive\r\n"
        b"PROXY-AUTHORIZATION: Basic eA==\r\nProxy-Connection: keep-alive"
    )
    out = with_credentials(head, AUTH)
    assert out is not None
    lines = out.split(b"\r\n")
    assert lines[0] == b"GET http://plain.test/ HTTP/1.1"
    assert [
        line for line in lines if b"uthorization" in line.lower() or b"onnection" in line.lower()
    ] == [
        b"Proxy-Authorization: Basic YWdlbnQ6dG9r",
        b"Connection: close",
    ]


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b"\x16\x03\x01\x02\x00", id="TLS to the proxy port"),
        pytest.param(b"GET / HTTP/2.0", id="not HTTP/1"),
        pytest.param(b"GET  HTTP/1.1", id="a malformed request line"),
    ],
)
def test_anything_else_is_refused(head: bytes) -> None:
    assert with_credentials(head, AUTH) is None


@pytest.fixture
def forwarder(monkeypatch):
    """The forwarder accepting on a listener (the sandbox's, handed out), in front of a TCP
    server that records what it gets."""
    from addon.launcher import isolate

    monkeypatch.setattr(isolate, "MAX_CONNECTIONS", 2)
    received: list[bytes] = []
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                received.append(data)
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(
        target=isolate._serve, args=(listener, server.getsockname(), AUTH), daemon=True
    ).start()

    def connect() -> socket.socket:
        return socket.create_connection(listener.getsockname(), timeout=10)

    yield connect, received
    listener.close()
    server.close()


def _status(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n")[0]


def test_the_forwarder_stamps_what_it_passes_on(forwarder) -> None:
    connect, received = forwarder
    with connect() as sock:
        sock.sendall(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
        assert _status(sock) == b"HTTP/1.1 200 Connection established"
    assert received == [
        b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n"
        b"Proxy-Authorization: Basic YWdlbnQ6dG9r\r\n\r\n"
    ]


def test_a_head_past_64_kib_is_refused_unread(forwarder) -> None:
    connect, received = forwarder
    with connect() as sock:
        sock.sendall(b"CONNECT api.test:443 HTTP/1.1\r\nX: " + b"a" * (70 * 1024))
        assert _status(sock) == b"HTTP/1.1 400 Bad Request"
    assert received == []


def test_connections_past_the_cap_are_refused(forwarder) -> None:
    connect, _ = forwarder
    held = [connect(), connect()]  # each waits for its head: both slots taken
    try:
        with connect() as third:
            assert _status(third) == b"HTTP/1.1 503 Service Unavailable"
    finally:
        for sock in held:
            sock.close()


def test_the_helper_hands_out_its_listener_and_its_pid() -> None:
    """What exec receives from the sandbox's helper: one listening socket, and the helper's
    pid as the kernel translates it (the command's, once the helper has become it)."""
    import subprocess
    import sys

    from addon.launcher import isolate

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    port = socket.create_server(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "addon.launcher.sandboxhelper",
            str(theirs.fileno()),
            str(free),
            "--",
            "true",
        ],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    handed = isolate._handover(ours)
    assert handed is not None
    listener, pid = handed
    assert pid == process.pid
    assert listener.getsockname() == ("127.0.0.1", free)
    assert process.wait(timeout=30) == 0
    listener.close()
    ours.close()
