"""`credproxy demo`: the whole path of a request on this machine, without the internet.

In a temporary directory: a TLS upstream with a CA of its own, a store with a principal, a
credential holding a fake secret and two grants, and a real `credproxy run` that dials the
upstream through --resolve and trusts it through --upstream-ca. A few requests go through it;
each shows what the agent sent, what the upstream received and what the agent got back.
The secret is fake, and still printed only masked: a demo teaches what to paste elsewhere.

With --keep it sends nothing: the upstream and a proxy on an empty store stay up until Ctrl-C,
and an env file says where, for the walkthrough (docs/tutorial.md) to run on them offline.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import functools
import http.client
import io
import json
import os
import secrets
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from store.ca import PRIVATE_BUNDLE, PUBLIC_CERT, ensure_ca
from store.errors import CredproxyError, InvalidInput
from store.settings import Settings

HOST = "api.demo.test"
START_TIMEOUT = 30.0
AUDIT_TIMEOUT = 5.0
KEEP_LISTEN = "127.0.0.1:8080"  # make run's: the walkthrough's addresses hold for either


class DemoFailed(CredproxyError):
    """The demo did not see what it shows."""


Main = Callable[[Sequence[str]], int]


def register(sub: Any, common: argparse.ArgumentParser, *, main: Main) -> None:
    """`credproxy demo`; `main` is the CLI's own entry point, which the demo calls in this
    process for each command it shows (passed in: the CLI imports the demo). The demo makes a
    store of its own, so it takes none of `common`'s options."""
    p = sub.add_parser(
        "demo",
        help="a trial on this machine, offline: five requests shown",
        description=__doc__,
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="send nothing: keep the upstream and a proxy on an empty store running until "
        "Ctrl-C, for the walkthrough (docs/tutorial.md)",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"with --keep: where the proxy listens (default {KEEP_LISTEN})",
    )
    p.set_defaults(func=functools.partial(cmd_demo, main=main))


def cmd_demo(args: argparse.Namespace, settings: Settings, *, main: Main) -> int:
    if args.listen is not None and not args.keep:
        raise InvalidInput("--listen goes with --keep: the demo's own proxy takes any free port")

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with tempfile.TemporaryDirectory(prefix="credproxy-demo-") as tmp:
            demo = Demo(Path(tmp), main)
            if args.keep:
                demo.keep(args.listen or KEEP_LISTEN)
            else:
                demo.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


# -- the upstream ------------------------------------------------------------------------


def _leaf(directory: Path) -> tuple[Path, Path]:
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
    server: _Upstream

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


class _Upstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, chain: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[Seen] = []
        self.heard: Callable[[Seen], None] | None = None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(chain)
        self.socket = context.wrap_socket(self.socket, server_side=True)


# -- the run -----------------------------------------------------------------------------


@dataclass
class Exchange:
    title: str
    sent: list[str]
    received: list[str]
    got: list[str]
    audit: str
    status: int = 0
    reason: str | None = None
    body: bytes = b""
    seen: list[Seen] = field(default_factory=list)


class Demo:
    def __init__(self, root: Path, main: Main) -> None:
        self.root = root
        self.main = main
        self.secret = f"demo-sk-{secrets.token_hex(12)}"
        self.flags = [
            "--db",
            f"sqlite:///{root / 'credproxy.db'}",
            "--key-file",
            str(root / "credproxy.key"),
            "--certs",
            str(root / "certs"),
        ]
        self.token = ""
        self.proxy_port = 0
        self.audit_file = root / "audit.jsonl"
        self.error_file = root / "run.err"
        self.process: subprocess.Popen[bytes] | None = None
        self.printing = threading.Lock()  # the upstream's thread and the audit's print too

    def mask(self, text: str) -> str:
        text = text.replace(self.secret, f"{self.secret[:8]}…")
        return text.replace(self.token, "…") if self.token else text

    def say(self, text: str = "") -> None:
        with self.printing:
            print(self.mask(text), flush=True)

    @contextlib.contextmanager
    def upstream(self) -> Iterator[tuple[_Upstream, Path]]:
        """The upstream, serving, and its CA; with the demo's own store, key and CA, never
        the operator's (CREDPROXY_* would point the commands elsewhere)."""
        for name in [name for name in os.environ if name.startswith("CREDPROXY_")]:
            del os.environ[name]
        chain, upstream_ca = _leaf(self.root / "upstream-ca")
        upstream = _Upstream(chain)
        serving = threading.Thread(target=upstream.serve_forever, daemon=True)
        serving.start()
        try:
            yield upstream, upstream_ca
        finally:
            upstream.shutdown()
            upstream.server_close()

    def run(self) -> None:
        with self.upstream() as (upstream, upstream_ca):
            self.say(f"credproxy demo, in {self.root} (removed at the end)")
            self.say(f"the fake secret {self.secret[:8]}… is shown masked, the token not at all")
            self.say(f"upstream: https://{HOST} on 127.0.0.1:{upstream.server_address[1]}")
            self.say()
            self.setup()
            argv = _run_argv("127.0.0.1:0", upstream_ca, upstream.server_address[1])
            self.say(f"$ credproxy {' '.join(argv)}")
            with self.proxy(argv):
                self.say(f"  listening on 127.0.0.1:{self.proxy_port}")
                self.say()
                self.show(upstream)

    def keep(self, listen: str) -> None:
        """The upstream and a proxy on an empty store, until Ctrl-C: what the walkthrough
        needs, and an env file for the operator's other terminal."""
        with self.upstream() as (upstream, upstream_ca):
            port = upstream.server_address[1]
            argv = _run_argv(listen, upstream_ca, port)
            self.say(f"credproxy demo --keep, in {self.root} (removed when it stops)")
            self.say(f"upstream  https://{HOST} on 127.0.0.1:{port}, with a CA of its own")
            self.say(f"proxy     credproxy {' '.join(argv)}")
            self.cli("init", shown=False)
            with self._following() as follow, self.proxy(argv) as started:
                certs = self.root / "certs"
                settings = {
                    "CREDPROXY_DB": f"sqlite:///{self.root / 'credproxy.db'}",
                    "CREDPROXY_KEY_FILE": str(self.root / "credproxy.key"),
                    "CREDPROXY_CERTS": str(certs),
                    "CREDPROXY_ADVERTISE": started["listen"][0],
                    "DEMO_SECRET": self.secret,
                }
                env_file = self.root / "env"
                env_file.touch(0o600)
                env_file.write_text(
                    "".join(f"export {k}={shlex.quote(v)}\n" for k, v in settings.items())
                )
                self.say(f"store     {settings['CREDPROXY_DB']}, empty")
                self.say(f"In another terminal, `source {env_file}` sets:")
                for name, value in settings.items():
                    self.say(f"  {name}={value}")
                self.say("DEMO_SECRET is a fake secret, for credential add; it is shown masked.")
                self.say(
                    f"Clients must trust {certs / PUBLIC_CERT} ($CREDPROXY_CERTS/{PUBLIC_CERT}). "
                    "Ctrl-C stops it all."
                )
                self.say("A line for each request the upstream gets; JSON lines follow.")
                upstream.heard = self._heard
                follow()
                self._serve()

    def _heard(self, seen: Seen) -> None:
        authorization = f"Authorization: {seen.authorization}" if seen.authorization else "none"
        line = f"upstream got {seen.method} {seen.path} with {authorization}"
        # What a client sent, on the operator's terminal: no escape sequence gets through.
        self.say("".join(c if c.isprintable() else "?" for c in line))

    @contextlib.contextmanager
    def _following(self) -> Iterator[Callable[[], None]]:
        """Yields what starts copying the proxy's lines to our stdout, from its first; the
        lines it writes as it stops are copied on the way out."""
        offset = 0
        done = threading.Event()
        follower = None

        def read() -> None:
            nonlocal offset
            with self.audit_file.open("rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n")
            offset += end + 1
            for line in data[: end + 1].decode(errors="replace").splitlines():
                self.say(line)

        def copy() -> None:
            while not done.wait(0.05):
                read()

        def start() -> None:
            nonlocal follower
            follower = threading.Thread(target=copy, daemon=True)
            follower.start()

        try:
            yield start
        finally:
            done.set()
            if follower is not None:
                follower.join()
                read()

    def _serve(self) -> None:
        try:
            while self.process is not None and self.process.poll() is None:
                time.sleep(0.1)
        except KeyboardInterrupt:
            return  # the way to stop it: exit 0, as `credproxy run` does
        raise DemoFailed(f"credproxy run exited: {self._errors()}")

    def cli(self, *argv: str, stdin: bytes = b"", shown: bool = True) -> str:
        """A `credproxy` command in this process, shown as the operator would type it."""
        if shown:
            self.say(f"$ credproxy {' '.join(argv)}" + (" < fake secret" if stdin else ""))
        out, err = io.StringIO(), io.StringIO()
        real_stdin = sys.stdin
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = self.main([*self.flags, *argv])
        finally:
            sys.stdin = real_stdin
        if code == 130:  # main() caught a Ctrl-C (or SIGTERM): stop as the later steps do
            raise KeyboardInterrupt
        if code != 0:
            raise DemoFailed(f"credproxy {argv[0]} failed: {err.getvalue().strip()}")
        return out.getvalue()

    def setup(self) -> None:
        self.cli("init")
        self.token = json.loads(self.cli("principal", "add", "agent", "--json"))["token"]
        self.cli(
            "credential",
            "add",
            "demo",
            "--scheme",
            "bearer",
            "--host",
            HOST,
            stdin=self.secret.encode(),
        )
        self.cli(
            "grant", "add", "agent", "--credential", "demo", "--method", "GET", "--path", "/v1/"
        )
        self.cli(
            "grant",
            "add",
            "agent",
            "--credential",
            "demo",
            "--method",
            "POST",
            "--path",
            "/v1/messages",
            "--once",
        )
        for line in self.cli("grant", "list").splitlines():
            self.say(f"  {line}")
        self.say()

    @contextlib.contextmanager
    def proxy(self, argv: list[str]) -> Iterator[dict[str, Any]]:
        """`credproxy run` on the demo's store; yields its proxy.started line."""
        with self.audit_file.open("wb") as out, self.error_file.open("wb") as err:
            self.process = subprocess.Popen(  # noqa: S603 - our own entry point, our own argv
                [sys.executable, "-m", "addon.cli.cli", *self.flags, *argv],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
            )
        process = self.process
        try:
            started = self._wait(
                lambda e: e.get("event") == "proxy.started", START_TIMEOUT, process
            )
            self.proxy_port = int(started["listen"][0].rpartition(":")[2])
            yield started
        finally:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _errors(self) -> str:
        """What the proxy wrote on stderr, but for its own `credproxy: error: ` prefix."""
        text = self.error_file.read_text(errors="replace").strip()
        return text.removeprefix("credproxy: error: ") or str(self.process and self.process.poll())

    def _audit(self) -> list[dict[str, Any]]:
        lines = self.audit_file.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def _wait(
        self, match: Any, timeout: float, process: subprocess.Popen[bytes] | None = None
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self._audit() if match(e)]
            if found:
                return found[-1]
            if process is not None and process.poll() is not None:
                raise DemoFailed(f"credproxy run exited: {self._errors()}")
            time.sleep(0.05)
        raise DemoFailed("no audit line in time")

    def send(self, upstream: _Upstream, title: str, method: str, path: str) -> Exchange:
        context = ssl.create_default_context(cafile=str(self.root / "certs" / PUBLIC_CERT))
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.proxy_port, context=context, timeout=10
        )
        auth = base64.b64encode(f"agent:{self.token}".encode()).decode()
        conn.set_tunnel(HOST, 443, headers={"Proxy-Authorization": f"Basic {auth}"})
        before_seen, before_audit = len(upstream.seen), len(self._requests())
        body = b'{"text": "hello"}' if method == "POST" else None
        conn.request(method, path, body=body, headers={"Authorization": "Bearer placeholder"})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        line = self._next_request(before_audit)
        seen = upstream.seen[before_seen:]
        reason = response.getheader("x-credproxy-reason")
        received = [
            part
            for s in seen
            for part in (f"{s.method} {s.path}", f"Authorization: {s.authorization}")
        ] or ["(nothing)"]
        got = [f"{response.status} {response.reason}"]
        if reason:
            got.append(f"X-Credproxy-Reason: {reason}")
        got.append(_summary(data))
        audit = " ".join(
            f"{k}={line[k]}" for k in ("decision", "reason", "grant_id", "status") if line.get(k)
        )
        return Exchange(
            title,
            [f"{method} https://{HOST}{path}", "Authorization: Bearer placeholder"],
            received,
            got,
            audit,
            response.status,
            reason,
            data,
            seen,
        )

    def _requests(self) -> list[dict[str, Any]]:
        return [e for e in self._audit() if e.get("event") == "request"]

    def _next_request(self, before: int) -> dict[str, Any]:
        """The audit line of the request just sent: written just after its response."""
        deadline = time.monotonic() + AUDIT_TIMEOUT
        while time.monotonic() < deadline:
            lines = self._requests()
            if len(lines) > before:
                return lines[before]
            time.sleep(0.05)
        raise DemoFailed("no audit line for the request in time")

    def show(self, upstream: _Upstream) -> None:
        stamped = f"Bearer {self.secret}"
        checks: list[tuple[Exchange, bool]] = []

        def step(title: str, method: str, path: str, expect: Any) -> None:
            exchange = self.send(upstream, title, method, path)
            self.table(exchange)
            checks.append((exchange, bool(expect(exchange))))

        step(
            "1. a stamped request (grant 1: GET /v1/)",
            "GET",
            "/v1/models",
            lambda x: x.status == 200 and [s.authorization for s in x.seen] == [stamped],
        )
        step(
            "2. a path no grant allows: refused, the upstream sees nothing",
            "GET",
            "/admin/users",
            lambda x: x.status == 403 and x.reason == "path-not-allowed" and not x.seen,
        )
        step(
            "3. an upstream that echoes the secret: redacted on the way back",
            "GET",
            "/v1/echo",
            lambda x: x.status == 200 and b"[REDACTED]" in x.body and x.seen,
        )
        step(
            "4. a once-grant (grant 2: POST /v1/messages), first use",
            "POST",
            "/v1/messages",
            lambda x: x.status == 200 and len(x.seen) == 1,
        )
        step(
            "5. the same once-grant, used again",
            "POST",
            "/v1/messages",
            lambda x: x.status == 403 and x.reason == "grant-consumed" and not x.seen,
        )
        leaked = [x.title for x, _ in checks if self.secret.encode() in x.body]
        if leaked:
            raise DemoFailed(f"the secret reached the agent in: {', '.join(leaked)}")
        failed = [x.title for x, ok in checks if not ok]
        if failed:
            raise DemoFailed(f"unexpected answers in: {', '.join(failed)}")
        self.say("The agent never held the secret; every request is one audit line.")

    def table(self, x: Exchange) -> None:
        width = max(24, min(44, (shutil.get_terminal_size((110, 24)).columns - 4) // 3))
        columns = [
            ["agent sent", *x.sent],
            ["upstream received", *x.received],
            ["agent got back", *x.got],
        ]
        wrapped = [
            [part for text in column for part in _wrap(self.mask(text), width)]
            for column in columns
        ]
        self.say(f"── {x.title}")
        for row in range(max(len(c) for c in wrapped)):
            cells = [c[row] if row < len(c) else "" for c in wrapped]
            self.say("  ".join(cell.ljust(width) for cell in cells).rstrip())
        self.say(f"audit: {x.audit}")
        self.say()


def _run_argv(listen: str, upstream_ca: Path, upstream_port: int) -> list[str]:
    """`credproxy run` wired to the upstream: dial it for HOST, trust its CA."""
    return [
        "run",
        "--listen",
        listen,
        "--upstream-ca",
        str(upstream_ca),
        "--resolve",
        f"{HOST}=127.0.0.1:{upstream_port}",
    ]


def _wrap(text: str, width: int) -> Sequence[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=True) or [""]


def _summary(body: bytes) -> str:
    """A refusal's reason and detail (its other fields elided), any other body as it came."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")
    if isinstance(data, dict) and "reason" in data:
        shown = {k: data[k] for k in ("reason", "detail") if k in data}
        return json.dumps(shown)[:-1] + (", …}" if len(shown) < len(data) else "}")
    return json.dumps(data)
