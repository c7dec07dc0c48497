"""`exec --isolate`: CMD in a bubblewrap sandbox whose only way out is the proxy.

bubblewrap gives CMD new user, network, process, IPC and UTS namespaces, no capabilities,
`no_new_privs`, a session of its own and the file-system view of addon/launcher/sandbox.py. Inside,
the network has only loopback; a helper (this module run as `python -m addon.launcher.isolate`)
listens there on the proxy's port, hands the listening socket out to exec through an
inherited socket pair, and becomes CMD. exec accepts on that socket from outside and puts
the session's Proxy-Authorization on each proxy request, so CMD's environment holds no
token, and only processes inside the sandbox can connect. Where the sandbox cannot be made,
exec stops before anything runs: never un-isolated.
"""

from __future__ import annotations

import array
import base64
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from addon.launcher import launchenv, sandbox, sandboxhelper
from addon.launcher.process import spawn, wait_forwarding
from addon.launcher.sandboxhelper import CRED

MAX_HEAD = 64 * 1024  # a proxy request's head, as read by the forwarder
MAX_CONNECTIONS = 256  # open through the forwarder at once; more are answered 503
HEAD_TIMEOUT = 30.0  # seconds for a proxy request's head to arrive
HANDOVER_TIMEOUT = 30.0  # seconds for the helper to hand its listening socket out


# -- outside: the forwarder in exec ----------------------------------------------------


def with_credentials(head: bytes, authorization: str) -> bytes | None:
    """The request head with the session's Proxy-Authorization in place of any sent;
    None when it is no HTTP/1 request head. Requests other than CONNECT get Connection:
    close, so that each one is read (and stamped) here."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not all(parts) or not parts[2].startswith(b"HTTP/1."):
        return None
    connect = parts[0] == b"CONNECT"
    dropped = {b"proxy-authorization"} | (
        set() if connect else {b"connection", b"proxy-connection"}
    )
    kept = [
        line for line in lines[1:] if line and line.split(b":", 1)[0].strip().lower() not in dropped
    ]
    kept.append(b"Proxy-Authorization: " + authorization.encode())
    if not connect:
        kept.append(b"Connection: close")
    return b"\r\n".join([lines[0], *kept]) + b"\r\n\r\n"


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def _read_head(sock: socket.socket) -> tuple[bytes, bytes] | None:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD:
            return None
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _forward(client: socket.socket, proxy: tuple[str, int], authorization: str) -> None:
    with client:
        client.settimeout(HEAD_TIMEOUT)
        try:
            read = _read_head(client)
        except OSError:
            return
        head = with_credentials(read[0], authorization) if read else None
        if read is None or head is None:
            _answer(client, b"400 Bad Request")
            return
        try:
            upstream = socket.create_connection(proxy, timeout=30)
        except OSError:
            _answer(client, b"502 Bad Gateway")
            return
        with upstream:
            client.settimeout(None)
            upstream.settimeout(None)
            upstream.sendall(head + read[1])
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join()


def _answer(client: socket.socket, status: bytes) -> None:
    try:
        client.sendall(
            b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
    except OSError:
        pass


def _serve(listener: socket.socket, proxy: tuple[str, int], authorization: str) -> None:
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def forward(client: socket.socket) -> None:
        try:
            _forward(client, proxy, authorization)
        finally:
            slots.release()

    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        if not slots.acquire(blocking=False):
            with client:
                _answer(client, b"503 Service Unavailable")
            continue
        threading.Thread(target=forward, args=(client,), daemon=True).start()


def _handover(control: socket.socket) -> tuple[socket.socket, int] | None:
    """The helper's listening socket and its pid as seen from here; None if it ended first."""
    control.settimeout(HANDOVER_TIMEOUT)
    try:
        _, ancillary, _, _ = control.recvmsg(1, socket.CMSG_SPACE(4) + socket.CMSG_SPACE(CRED.size))
    except OSError:
        return None
    fds: list[int] = []
    pid = None
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", data[: len(data) - len(data) % 4])
        elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = CRED.unpack(data[: CRED.size])[0]
    if len(fds) != 1 or pid is None:
        for fd in fds:
            os.close(fd)
        return None
    return socket.socket(fileno=fds[0]), pid


def run(
    command: Sequence[str],
    base: dict[str, str],
    session: launchenv.Session,
    mask: set[int | signal.Signals],
    view: sandbox.View,
    python: str,
    prefix: Sequence[str] = (),
) -> int:
    """Run CMD isolated (the sandbox started through `prefix`, which may switch the user);
    its exit status (128+N for a signal N)."""
    url = urlsplit(session.proxy_url)
    authorization = "Basic " + base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
    inside = replace(
        session,
        proxy_url=f"http://127.0.0.1:{session.proxy_port}",
        proxy_host="127.0.0.1",
    )
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        with theirs:
            for fd in (theirs.fileno(), *view.fds()):
                os.set_inheritable(fd, True)
            source = Path(sandboxhelper.__file__).read_text()
            helper = [python, "-I", "-c", source, str(theirs.fileno())]
            pid = spawn(
                [
                    *prefix,
                    sandbox.bwrap(),
                    *sandbox.arguments(view),
                    *sandbox.UNSHARE,
                    *helper,
                    str(session.proxy_port),
                    "--",
                    *command,
                ],
                launchenv.contained(base, inside),
                mask,
            )
        handed = _handover(ours)
    if handed is None:  # the sandbox or its helper ended first (bwrap said why) or hung
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("credproxy: error: --isolate: the sandbox did not start", file=sys.stderr)
        return 126
    listener, command_pid = handed
    with listener:
        threading.Thread(
            target=_serve,
            args=(listener, (session.proxy_host, session.proxy_port), authorization),
            daemon=True,
        ).start()
        # CMD has a session of its own: a terminal's ^C reaches exec alone, so it is passed on.
        return wait_forwarding(pid, target=command_pid, every_signal=True)
