"""`exec --isolate`: CMD in new user and network namespaces whose only way out is the proxy.

Inside, the network has only loopback. The proxy address there is a loopback listener (this
module run as `python -m addon.isolate`, CMD's parent) that passes each connection through a
Unix socket to a forwarder in exec, outside; the forwarder puts the session's
Proxy-Authorization on each proxy request, so CMD's environment holds no token.
Where namespaces cannot be made, exec stops before anything runs: never un-isolated.
"""

from __future__ import annotations

import base64
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from addon import launchenv
from store.errors import CredproxyError

MAX_HEAD = 64 * 1024  # a proxy request's head, as read by the forwarder
MAX_CONNECTIONS = 256  # open through the forwarder at once; more are answered 503
HEAD_TIMEOUT = 30.0  # seconds for a proxy request's head to arrive
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


class IsolationUnavailable(CredproxyError):
    pass


def _unshare() -> list[str]:
    tool = shutil.which("unshare")
    if tool is None:
        raise IsolationUnavailable("--isolate needs unshare (util-linux), which is not installed")
    # A user namespace also when root: CMD's capabilities then stop at its own namespaces.
    return [tool, "--user", "--map-root-user", "--net", "--"]


def check() -> None:
    """Raise IsolationUnavailable unless user and network namespaces can be made here."""
    done = subprocess.run(  # noqa: S603 - a fixed argument list, no shell
        [*_unshare(), "true"], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["unknown reason"])[-1]
        raise IsolationUnavailable(f"--isolate cannot create namespaces here: {why}")


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


def _peer_pid(client: socket.socket) -> int:
    pid, _uid, _gid = struct.unpack(
        "3i", client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    )
    return int(pid)


def _serve(
    listener: socket.socket, proxy: tuple[str, int], authorization: str, helper: list[int]
) -> None:
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
        try:
            ours = bool(helper) and _peer_pid(client) == helper[0]
        except OSError:  # no credentials to read: not known to be the helper
            ours = False
        if not ours:
            # Another process of this user (another sandbox): the session's credentials are
            # this command's alone.
            client.close()
            continue
        if not slots.acquire(blocking=False):
            with client:
                _answer(client, b"503 Service Unavailable")
            continue
        threading.Thread(target=forward, args=(client,), daemon=True).start()


def run(
    command: Sequence[str],
    base: dict[str, str],
    session: launchenv.Session,
    mask: set[int | signal.Signals],
) -> int:
    """Run CMD isolated; its exit status (128+N for a signal N)."""
    from addon.launch import spawn, wait_forwarding

    url = urlsplit(session.proxy_url)
    authorization = "Basic " + base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
    inside = replace(
        session,
        proxy_url=f"http://127.0.0.1:{session.proxy_port}",
        proxy_host="127.0.0.1",
    )
    with tempfile.TemporaryDirectory(prefix="credproxy-isolate-") as tmp:
        path = str(Path(tmp) / "proxy.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with listener:
            listener.bind(path)
            listener.listen(64)
            helper: list[int] = []  # the one process whose connections are forwarded
            threading.Thread(
                target=_serve,
                args=(listener, (session.proxy_host, session.proxy_port), authorization, helper),
                daemon=True,
            ).start()
            inner = [sys.executable, "-m", "addon.isolate", path, str(session.proxy_port), "--"]
            pid = spawn([*_unshare(), *inner, *command], launchenv.contained(base, inside), mask)
            helper.append(pid)  # unshare execs the helper: it keeps this pid
            return wait_forwarding(pid)


# -- inside: CMD's parent, in the new namespaces ---------------------------------------


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def _bridge(client: socket.socket, path: str) -> None:
    with client:
        out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            out.connect(path)
        except OSError:
            return
        with out:
            back = threading.Thread(target=_pump, args=(out, client), daemon=True)
            back.start()
            _pump(client, out)
            back.join()


def _accept(listener: socket.socket, path: str) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_bridge, args=(client, path), daemon=True).start()


def main(argv: Sequence[str]) -> int:
    from addon.launch import WATCHED, CommandFailed, spawn, wait_forwarding

    path, port, _, *command = argv
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    _loopback_up()
    listener = socket.create_server(("127.0.0.1", int(port)), backlog=64)
    threading.Thread(target=_accept, args=(listener, path), daemon=True).start()
    try:
        pid = spawn(command, dict(os.environ), mask)
    except CommandFailed as e:
        print(f"credproxy: error: {e}", file=sys.stderr)
        return e.status
    return wait_forwarding(pid)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
