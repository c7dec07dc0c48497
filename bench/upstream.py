"""The upstream: a small TLS HTTP/1.1 keep-alive server, run in a process of its own.

`python -m bench.upstream CERT KEY` prints `{"port": N}` on stdout once listening. Every
path answers an 11-byte JSON body, except `/bench/blob/KIND/N`: N bytes of KIND (see
`bench.bodies`) with a Content-Length, for the download mode.
"""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import sys

from bench.bodies import body

BLOB = b"/bench/blob/"
BODY = b'{"ok":true}'
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
)


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> None:
    """Consume a request body so the next request on the connection parses cleanly."""
    lowered = head.lower()
    if b"transfer-encoding: chunked" in lowered:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return
    for line in lowered.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":", 1)[1]))
            return


def _answer(head: bytes) -> bytes:
    target = head.split(b" ", 2)[1]
    if not target.startswith(BLOB):
        return RESPONSE
    kind, size = target[len(BLOB) :].decode().split("/")
    blob = body(kind, int(size))
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
        b"content-length: " + str(len(blob)).encode() + b"\r\n\r\n" + blob
    )


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            await _read_body(reader, head)
            writer.write(_answer(head))
            await writer.drain()
            if b"connection: close" in head.lower():
                break
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def main(cert: str, key: str) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["http/1.1"])
    server = await asyncio.start_server(_serve, "127.0.0.1", 0, ssl=context, backlog=1024)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    async with server:
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
