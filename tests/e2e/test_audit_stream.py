"""The audit stream end to end: a real `credproxy run` whose stdout is a pipe the test stops
reading, or a file on a tmpfs that fills up. Serving must never block on it, requests are
refused with `audit-unavailable` while lines cannot get out, and no line is lost or doubled."""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import pytest
import trustme

from store.crypto import Secret
from store.repository import Store
from tests.e2e.conftest import CREDPROXY, Proxy, _env, _load_key
from tests.e2e.raw import connect, proxy_auth
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

PAD = "a" * 12000  # long paths: about a hundred requests fill the pipe and the 1 MiB queue
TIMEOUT = 10.0  # a request or an admin call that takes longer is hanging: the bug


@dataclass
class Running:
    process: subprocess.Popen[bytes]
    port: int
    admin: str
    home: Path

    def client(self) -> httpx.Client:
        import ssl

        context = ssl.create_default_context(cafile=str(self.home / "certs" / "credproxy-ca.pem"))
        return httpx.Client(
            proxy=f"http://agent:{(self.home / 'token').read_text()}@127.0.0.1:{self.port}",
            verify=context,
            timeout=TIMEOUT,
        )

    def get_admin(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=TIMEOUT) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


def _home(tmp_path: Path, template: Path, upstream_ca: trustme.CA) -> tuple[Path, dict[str, str]]:
    home = tmp_path / "home"
    shutil.copytree(template, home)
    upstream_ca.cert_pem.write_to_path(str(home / "upstream-ca.pem"))
    env = _env(home)
    env.pop("PYTHONUNBUFFERED")  # the writer must not depend on how sys.stdout buffers
    store = Store(env["CREDPROXY_DB"], _load_key(home))
    try:
        (home / "token").write_text(store.add_principal("agent"))
        store.add_credential("cred", "bearer", ["api.test"], Secret(b"sk-audit-stream"))
        store.add_grant("agent", ["GET"], credential="cred", paths=["/v1/"])
    finally:
        store.close()
    return home, env


def _start(home: Path, env: dict[str, str], upstream: Upstream, stdout: int | IO[bytes]):
    args = [
        *CREDPROXY,
        "run",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--upstream-ca",
        str(home / "upstream-ca.pem"),
        "--resolve",
        f"api.test=127.0.0.1:{upstream.port}",
    ]
    stderr = (home / "stderr").open("wb")
    return subprocess.Popen(args, env=env, cwd=home, stdout=stdout, stderr=stderr)


def _started(text: bytes, process: subprocess.Popen[bytes], home: Path) -> Running | None:
    for line in text.splitlines():
        if b'"proxy.started"' in line:
            started = json.loads(line)
            port = int(started["listen"][0].rsplit(":", 1)[1])
            return Running(process, port, started["admin"][0], home)
    return None


class Pipe:
    """The read end of the proxy's stdout, read only when the test says so."""

    def __init__(self) -> None:
        self.read_end, self.write_end = os.pipe()
        self.data = bytearray()
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.read_end)

    def read_available(self, wait: float = 0.0) -> int:
        got = 0
        if self.closed:
            time.sleep(wait)
            return 0
        while select.select([self.read_end], [], [], wait)[0]:
            chunk = os.read(self.read_end, 1 << 16)
            if not chunk:
                break
            self.data += chunk
            got += len(chunk)
            wait = 0.0
        return got


@pytest.fixture
def piped(
    tmp_path: Path, initialised_home: Path, upstream_ca: trustme.CA, shared_upstream: Upstream
) -> Iterator[tuple[Running, Pipe]]:
    home, env = _home(tmp_path, initialised_home, upstream_ca)
    pipe = Pipe()
    process = _start(home, env, shared_upstream, pipe.write_end)
    os.close(pipe.write_end)
    deadline = time.monotonic() + 15
    running = None
    while running is None and time.monotonic() < deadline and process.poll() is None:
        pipe.read_available(0.1)
        running = _started(bytes(pipe.data), process, home)
    try:
        assert running is not None, "credproxy did not start"
        yield running, pipe
    finally:
        process.terminate()
        deadline = time.monotonic() + 15
        while process.poll() is None and time.monotonic() < deadline:
            pipe.read_available(0.1)  # shutdown writes what is queued
        process.kill()
        process.wait()
        pipe.close()


def _request_lines(data: bytes) -> list[dict[str, object]]:
    complete = data[: data.rfind(b"\n") + 1]  # a line still on its way is not counted yet
    lines = [json.loads(line) for line in complete.splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == "request"]


def _request_paths(data: bytes) -> Counter[object]:
    return Counter(line["path"] for line in _request_lines(data))


def _assert_each_once(data: bytes, allowed: list[str], refused: int) -> None:
    """Every request has exactly one line: allowed ones by path, refused ones (refused before
    the path is read) by count; no request id twice."""
    lines = _request_lines(data)
    counts = _request_paths(data)
    assert [path for path in allowed if counts[path] != 1] == []
    assert sum(line.get("reason") == "audit-unavailable" for line in lines) == refused
    assert len(lines) == len(allowed) + refused
    assert len({line["request_id"] for line in lines}) == len(lines)


def test_a_stalled_reader_refuses_requests_and_never_hangs_then_every_line_arrives_once(
    piped: tuple[Running, Pipe],
) -> None:
    running, pipe = piped
    sent: list[str] = []
    refused = None
    with running.client() as client:
        for n in range(2_000):  # the pipe (64 KiB) and the queue (1 MiB) fill long before
            path = f"/v1/{n}-{PAD}"
            reply = client.get(f"https://api.test{path}")  # a hang raises ReadTimeout
            if reply.status_code != 200:
                refused = reply
                break
            sent.append(path)
        assert refused is not None, "never refused: the queue has no bound"
        assert refused.status_code == 503
        assert refused.headers["x-credproxy-reason"] == "audit-unavailable"
        assert refused.json()["reason"] == "audit-unavailable"
        # Everyone else is refused too, quickly; the admin listener keeps answering.
        again = client.get(f"https://api.test/v1/again-{PAD}")
        assert again.headers["x-credproxy-reason"] == "audit-unavailable"
        assert running.get_admin("/healthz")[0] == 200
        status, body = running.get_admin("/readyz")
        assert status == 503
        assert json.loads(body)["audit"] == "backlog"
        metrics = running.get_admin("/metrics")[1].decode()
        queued = [
            float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("credproxy_audit_queue_bytes ")
        ]
        assert queued and queued[0] > 1024 * 1024
        assert "credproxy_audit_writable 0.0" in metrics

        # The reader comes back: serving resumes.
        deadline = time.monotonic() + 30
        while running.get_admin("/readyz")[0] != 200:
            assert time.monotonic() < deadline, "serving did not resume"
            pipe.read_available(0.05)
        resumed = client.get(f"https://api.test/v1/resumed-{PAD}")
        sent.append(f"/v1/resumed-{PAD}")
        assert resumed.status_code == 200
    deadline = time.monotonic() + 10
    while _request_paths(bytes(pipe.data))[sent[-1]] == 0:
        assert time.monotonic() < deadline, "the last line never arrived"
        pipe.read_available(0.05)
    _assert_each_once(bytes(pipe.data), sent, refused=2)


def test_a_closed_pipe_refuses_every_request_and_the_admin_listener_says_why(
    piped: tuple[Running, Pipe],
) -> None:
    running, pipe = piped
    pipe.close()  # the reader is gone: EPIPE (Python ignores SIGPIPE)
    with running.client() as client:
        reasons = []
        for n in range(20):
            reasons.append(client.get(f"https://api.test/v1/{n}").headers.get("x-credproxy-reason"))
            if reasons[-1] is not None:
                break
            time.sleep(0.05)  # let the line's write fail
        assert reasons[-1] == "audit-unavailable"
        again = client.get("https://api.test/v1/again")
        assert again.headers["x-credproxy-reason"] == "audit-unavailable"
    assert running.get_admin("/healthz")[0] == 200
    status, body = running.get_admin("/readyz")
    assert (status, json.loads(body)["audit"]) == (503, "failing")


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB tmpfs; skipped where this machine does not allow mounting one."""
    directory = Path(tempfile.mkdtemp(prefix="credproxy-tmpfs-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        directory.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=False)
        directory.rmdir()


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_refuses_requests_like_a_closed_pipe_until_there_is_room(
    tmp_path: Path,
    initialised_home: Path,
    upstream_ca: trustme.CA,
    shared_upstream: Upstream,
    small_disk: Path,
) -> None:
    home, env = _home(tmp_path, initialised_home, upstream_ca)
    out_path = small_disk / "audit.log"
    with out_path.open("wb") as out:
        process = _start(home, env, shared_upstream, out)
    try:
        deadline = time.monotonic() + 15
        running = None
        while running is None and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
            running = _started(out_path.read_bytes(), process, home)
        assert running is not None, "credproxy did not start"
        filler = _fill(small_disk)
        sent: list[str] = []
        with running.client() as client:
            # The first line that cannot be written refuses every later request (the file's
            # last page still takes a line or two).
            refused = None
            for n in range(50):
                path = f"/v1/full-{n}-{PAD}"
                reply = client.get(f"https://api.test{path}")
                if reply.status_code != 200:
                    refused = reply
                    break
                sent.append(path)
                time.sleep(0.05)  # let the line's write fail
            assert sent, "the first request is forwarded: its line is held, never dropped"
            assert refused is not None and refused.status_code == 503
            assert refused.headers["x-credproxy-reason"] == "audit-unavailable"
            again = client.get(f"https://api.test/v1/again-{PAD}")
            assert again.headers["x-credproxy-reason"] == "audit-unavailable"
            status, body = running.get_admin("/readyz")
            assert (status, json.loads(body)["audit"]) == (503, "failing")
            metrics = running.get_admin("/metrics")[1].decode()
            assert "credproxy_audit_write_failures_total 0.0" not in metrics
            assert "credproxy_audit_write_failures_total" in metrics
            filler.unlink()  # room again: the next retry (every second) succeeds
            deadline = time.monotonic() + 15
            while running.get_admin("/readyz")[0] != 200:
                assert time.monotonic() < deadline, "serving did not resume"
                time.sleep(0.1)
            sent.append("/v1/after")
            assert client.get(f"https://api.test{sent[-1]}").status_code == 200
        deadline = time.monotonic() + 10
        while _request_paths(out_path.read_bytes())["/v1/after"] == 0:
            assert time.monotonic() < deadline, "the last line never arrived"
            time.sleep(0.05)
        _assert_each_once(out_path.read_bytes(), sent, refused=2)
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- what a client sends never reaches the audit stream ------------------------------------


# mitmproxy's 'Cannot parse ClientHello' warning hex-dumps the client's raw bytes: it never
# reaches the audit stream, where anyone unauthenticated could write.
@pytest.mark.parametrize(
    "where",
    [
        pytest.param("proxy", id="bytes sent to the proxy itself reach the audit stream as hex"),
        pytest.param("tunnel", id="bytes sent inside a tunnel reach the audit stream as hex"),
    ],
)
def test_raw_client_bytes_never_reach_the_audit_stream(rproxy: Proxy, raw_agent, where: str):
    marker = b"query-value-" + os.urandom(8).hex().encode()  # 28 bytes
    record = b"\x16\x03\x01" + (len(marker) + 4).to_bytes(2, "big")
    hello = b"\x01" + len(marker).to_bytes(3, "big") + marker
    if where == "proxy":
        sock = socket.create_connection(("127.0.0.1", rproxy.port), timeout=5)
    else:
        sock, reply = connect(rproxy.port, "raw.test:443", proxy_auth(*raw_agent))
        assert reply.status == 200
    with sock:
        sock.sendall(record + hello)
        try:
            sock.recv(100)
        except OSError:
            pass
    out = rproxy.output()
    dumped = marker.hex() in out or marker.decode() in out
    assert not dumped, "the client's raw bytes are in the audit stream"
