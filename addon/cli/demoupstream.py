"""The demo's upstream: a TLS server for HOST, with a CA of its own, that records what it got
and answers with JSON (quoting the request back on /v1/echo, as a careless API would)."""

from __future__ import annotations

import datetime
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from store.ca import PRIVATE_BUNDLE, PUBLIC_CERT, ensure_ca

HOST = "api.demo.test"


def leaf(directory: Path) -> tuple[Path, Path]:
    """A certificate for HOST signed by a CA of the upstream's own (made as `init` makes one)."""
    ensure_ca(directory)
    bundle = (directory / PRIVATE_BUNDLE).read_bytes()
    ca_key = serialization.load_pem_private_key(bundle, None)
    ca_cert = x509.load_pem_x509_certificate(bundle)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(HOST)]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    chain = directory / "upstream.pem"
    chain.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        + cert.public_bytes(serialization.Encoding.PEM)
    )
    return chain, directory / PUBLIC_CERT


@dataclass
class Seen:
    method: str
    path: str
    authorization: str | None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        authorization = self.headers.get("authorization")
        seen = Seen(self.command, self.path, authorization)
        self.server.seen.append(seen)
        if self.server.heard is not None:
            self.server.heard(seen)
        if self.path.startswith("/v1/echo"):
            # A careless API that quotes the request back: credproxy redacts the secret.
            payload: dict[str, Any] = {"you_sent": {"authorization": authorization}}
        else:
            payload = {"ok": True, "path": self.path}
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


class Upstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, chain: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[Seen] = []
        self.heard: Callable[[Seen], None] | None = None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(chain)
        self.socket = context.wrap_socket(self.socket, server_side=True)
