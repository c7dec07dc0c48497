"""The stage of `credproxy demo` and `demo --keep`: the demo's directory, its store through
the CLI, its `credproxy run`, and the terminal both print to."""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from addon.cli.demoupstream import HOST, Upstream, leaf
from store.errors import CredproxyError

START_TIMEOUT = 30.0


_held = {"depth": 0, "pending": False}


def interrupt(signum: int, frame: FrameType | None) -> None:
    """The demo's Ctrl-C and SIGTERM: KeyboardInterrupt, unless a child is being started."""
    if _held["depth"]:
        _held["pending"] = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold `interrupt` for the block; raise it at its end if one came meanwhile."""
    _held["depth"] += 1
    try:
        yield
    finally:
        _held["depth"] -= 1
    if not _held["depth"] and _held["pending"]:
        _held["pending"] = False
        raise KeyboardInterrupt


class DemoFailed(CredproxyError):
    """The demo did not see what it shows."""


# The CLI's own entry point, which the demo calls in this process for each command it shows.
Main = Callable[[Sequence[str]], int]


class Stage:
    """What both demos share: a temporary directory with the demo's own store, key and CA;
    the upstream; `credproxy` commands run in this process and `credproxy run` as a child;
    and the terminal, where the secret and the token are shown masked."""

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
    def upstream(self) -> Iterator[tuple[Upstream, Path]]:
        """The upstream, serving, and its CA; with the demo's own store, key and CA, never
        the operator's (CREDPROXY_* would point the commands elsewhere)."""
        for name in [name for name in os.environ if name.startswith("CREDPROXY_")]:
            del os.environ[name]
        chain, upstream_ca = leaf(self.root / "upstream-ca")
        upstream = Upstream(chain)
        serving = threading.Thread(target=upstream.serve_forever, daemon=True)
        serving.start()
        try:
            yield upstream, upstream_ca
        finally:
            upstream.shutdown()
            upstream.server_close()

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

    @contextlib.contextmanager
    def proxy(self, argv: list[str]) -> Iterator[dict[str, Any]]:
        """`credproxy run` on the demo's store; yields its proxy.started line."""
        process = None
        try:
            # A Ctrl-C or SIGTERM while Popen starts the child would leave it running, unknown
            # to the finally below: it is held until the child is ours to stop.
            with uninterrupted():
                with self.audit_file.open("wb") as out, self.error_file.open("wb") as err:
                    process = self.process = subprocess.Popen(  # noqa: S603 - our own argv
                        [sys.executable, "-m", "addon.cli.cli", *self.flags, *argv],
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        cwd=self.root,
                    )
            started = self._wait(
                lambda e: e.get("event") == "proxy.started", START_TIMEOUT, process
            )
            self.proxy_port = int(started["listen"][0].rpartition(":")[2])
            yield started
        finally:
            if process is not None:
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


def run_argv(listen: str, upstream_ca: Path, upstream_port: int) -> list[str]:
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
