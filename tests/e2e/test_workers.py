"""`credproxy run --workers 2`: a real supervisor, two real workers on one port, real clients."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from store.crypto import Secret
from tests.e2e.conftest import CREDPROXY, NAMES, Proxy, start_proxy, stop_proxy
from tests.e2e.raw import connect, proxy_auth
from tests.e2e.relay import pg_database
from tests.e2e.test_audit_stream import (
    PAD,
    Pipe,
    _assert_each_once,
    _home,
    _request_lines,
    _request_paths,
    _started,
)
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e


def _args(upstream: Upstream) -> list[str]:
    return [f"{n}=127.0.0.1:{upstream.port}" for n in NAMES if n != "localhost"]


@pytest.fixture(scope="module")
def workers(
    tmp_path_factory: pytest.TempPathFactory,
    shared_upstream: Upstream,
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    home = tmp_path_factory.mktemp("workers")
    extra = ["--workers", "2", "--admin", "127.0.0.1:0", "--allow-private", "127.0.0.0/8"]
    running = start_proxy(
        home, upstream_ca, _args(shared_upstream), extra=extra, template=initialised_home
    )
    yield running
    stop_proxy(running)


def admin(proxy: Proxy) -> str:
    return str(proxy.audit()[0]["admin"][0])


def get_admin(proxy: Proxy, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{admin(proxy)}{path}", timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_reload_all(proxy: Proxy, timeout: float = 5.0) -> None:
    """Wait until every worker has loaded the store's current change counter."""
    target = proxy.store.change_counter()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen: dict[int, int] = {}
        for line in proxy.audit():
            if line.get("event") in ("policy.reloaded", "proxy.started") and "worker" in line:
                seen[line["worker"]] = line.get("counter", -1)
        if len(seen) == 2 and min(seen.values()) >= target:
            return
        time.sleep(0.05)
    raise AssertionError("the workers did not reload within the timeout")


def eventually(check: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.fixture
def grant(workers: Proxy, names) -> Callable[..., tuple[str, str]]:
    def make(**kw: Any) -> tuple[str, str]:
        agent, cred = names("agent"), names("cred")
        token = workers.store.add_principal(agent)
        workers.store.add_credential(cred, "bearer", ["api.test"], Secret(b"sk-workers-secret"))
        workers.store.add_grant(agent, ["GET"], credential=cred, **kw)
        wait_reload_all(workers)
        return agent, token

    return make


def one_request(proxy: Proxy, agent: str, token: str, path: str) -> int:
    """A new client connection per request: the kernel picks the worker."""
    with proxy.client(agent, token, timeout=15) as client:
        return client.get(f"https://api.test{path}").status_code


def one_request_as(port: int, home: Path, token: str) -> None:
    context = ssl.create_default_context(cafile=str(home / "certs" / "credproxy-ca.pem"))
    with httpx.Client(proxy=f"http://agent:{token}@127.0.0.1:{port}", verify=context) as client:
        client.get("https://api.test/v1/line")


def readyz(proxy: Proxy) -> tuple[int, dict[str, Any]]:
    status, body = get_admin(proxy, "/readyz")
    return status, json.loads(body)


def test_requests_spread_over_both_workers_and_every_line_is_whole(workers, grant):
    agent, token = grant()
    with ThreadPoolExecutor(16) as pool:
        statuses = list(
            pool.map(lambda n: one_request(workers, agent, token, f"/v1/{n}"), range(64))
        )
    assert statuses == [200] * 64
    text = workers.output()
    lines = [json.loads(line) for line in text.splitlines()]  # every line whole JSON
    assert lines[0]["event"] == "proxy.started" and "worker" not in lines[0]
    mine = [line for line in lines if line.get("principal") == agent]
    assert len(mine) == 64
    assert {line["worker"] for line in mine} == {1, 2}
    assert "sk-workers-secret" not in text


def test_readyz_and_metrics_are_the_workers_together(workers, grant):
    status, ready = readyz(workers)
    assert status == 200 and ready["status"] == "ready"
    assert [w["ready"] for w in ready["workers"]] == [True, True]
    agent, token = grant()
    for n in range(8):
        assert one_request(workers, agent, token, f"/v1/m{n}") == 200

    def allowed() -> int:
        status, body = get_admin(workers, "/metrics")
        assert status == 200
        for line in body.decode().splitlines():
            if line.startswith("credproxy_principal_requests_total{") and agent in line:
                if 'decision="allow"' in line:
                    return int(float(line.rsplit(" ", 1)[1]))
        return 0

    assert eventually(lambda: allowed() == 8)
    _, body = get_admin(workers, "/metrics")
    assert "credproxy_workers 2.0" in body.decode()
    assert "credproxy_store_up 1.0" in body.decode()


def _race_once(proxy: Proxy, agent: str, token: str, upstream: Upstream) -> None:
    barrier = threading.Barrier(16)

    def one(_: int) -> int:
        with proxy.client(agent, token, timeout=15) as client:
            barrier.wait()
            return client.get("https://api.test/v1/once").status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(one, range(16)))
    assert statuses.count(200) == 1
    assert statuses.count(403) == 15
    assert len([r for r in upstream.log.requests if r.target == "/v1/once"]) == 1


def test_a_once_grant_is_used_once_from_16_parallel_connections(workers, grant, upstream):
    agent, token = grant(once=True)
    _race_once(workers, agent, token, upstream)


def test_a_once_grant_is_used_once_over_workers_on_postgresql(
    tmp_path: Path, initialised_home: Path, upstream_ca: trustme.CA, upstream: Upstream
):
    with pg_database("credproxy_workers_") as url:
        home = tmp_path / "home"
        shutil.copytree(initialised_home, home)
        env = {
            **os.environ,
            "CREDPROXY_DB": url,
            "CREDPROXY_KEY_FILE": str(home / "credproxy.key"),
            "CREDPROXY_CERTS": str(home / "certs"),
        }
        subprocess.run([*CREDPROXY, "init"], env=env, cwd=home, check=True, capture_output=True)
        proxy = start_proxy(home, upstream_ca, _args(upstream), extra=["--workers", "2"], db=url)
        try:
            token = proxy.store.add_principal("racer")
            proxy.store.add_credential("rc", "bearer", ["api.test"], Secret(b"sk-pg-race"))
            proxy.store.add_grant("racer", ["GET"], credential="rc", once=True)
            wait_reload_all(proxy)
            _race_once(proxy, "racer", token, upstream)
        finally:
            stop_proxy(proxy)


def test_the_supervisors_admin_listener_is_no_destination(workers, names):
    port = int(admin(workers).rsplit(":", 1)[1])
    agent = names("agent")
    token = workers.store.add_principal(agent)
    workers.store.add_grant(agent, ["*"], hosts=[f"localhost:{port}"])
    wait_reload_all(workers)
    for _ in range(4):  # new connections: each worker is asked
        with workers.client(agent, token, timeout=15) as client:
            answer = client.get(f"http://localhost:{port}/metrics")
        assert answer.status_code == 403
        assert answer.headers["x-credproxy-reason"] == "destination-forbidden"


def test_a_killed_worker_is_restarted_and_audited_while_the_other_serves(workers, grant):
    agent, token = grant()
    _, ready = readyz(workers)
    victim = ready["workers"][0]
    os.kill(victim["pid"], signal.SIGKILL)

    def exited() -> bool:
        return any(
            line.get("event") == "worker.exited" and line.get("pid") == victim["pid"]
            for line in workers.audit()
        )

    assert eventually(exited)
    for n in range(8):  # the other worker serves meanwhile; new connections avoid the dead one
        assert one_request(workers, agent, token, f"/v1/k{n}") == 200
    exit_line = next(line for line in workers.audit() if line.get("event") == "worker.exited")
    assert exit_line["worker"] == 1 and exit_line["status"] == -signal.SIGKILL
    assert exit_line["restart_in_s"] > 0

    def restarted() -> bool:
        status, now = readyz(workers)
        first = now["workers"][0]
        return status == 200 and first["pid"] != victim["pid"] and first["restarts"] == 1

    assert eventually(restarted)
    wait_reload_all(workers)
    _, body = get_admin(workers, "/metrics")
    assert "credproxy_worker_restarts_total 1.0" in body.decode()


def test_sigterm_drains_every_worker(
    tmp_path: Path, initialised_home: Path, upstream_ca: trustme.CA, shared_upstream: Upstream
):
    proxy = start_proxy(
        tmp_path / "home",
        upstream_ca,
        _args(shared_upstream),
        extra=["--workers", "2"],
        template=initialised_home,
    )
    try:
        token = proxy.store.add_principal("drainer")
        proxy.store.add_credential("dc", "bearer", ["api.test"], Secret(b"sk-drain"))
        proxy.store.add_grant("drainer", ["GET"], credential="dc")
        wait_reload_all(proxy)
        got: list[bytes] = []

        def stream() -> None:
            with proxy.client("drainer", token, timeout=15) as client:
                with client.stream("GET", "https://api.test/sse") as answer:
                    for chunk in answer.iter_bytes():
                        got.append(chunk)

        proxy.process.send_signal(signal.SIGHUP)  # passed on to every worker

        def reloaded() -> bool:
            lines = proxy.audit()
            asked = {
                line.get("worker") for line in lines if line["event"] == "proxy.reload_requested"
            }
            return asked == {1, 2}

        assert eventually(reloaded)
        reader = threading.Thread(target=stream)
        reader.start()
        assert eventually(lambda: bool(got), 5)
        proxy.process.send_signal(signal.SIGTERM)
        reader.join(15)
        assert proxy.process.wait(15) == 0
        assert b"event-2" in b"".join(got)  # the in-flight stream finished
        lines = proxy.audit()
        stopped = [line.get("worker") for line in lines if line["event"] == "proxy.stopped"]
        assert sorted(stopped, key=str) == [1, 2, None]
        assert lines[-1]["event"] == "proxy.stopped" and "worker" not in lines[-1]
        assert any(line.get("path") == "/sse" and line["status"] == 200 for line in lines)
    finally:
        stop_proxy(proxy)


def test_a_closed_stdout_refuses_requests_in_every_worker(
    tmp_path: Path, initialised_home: Path, upstream_ca: trustme.CA, shared_upstream: Upstream
):
    home, env = _home(tmp_path, initialised_home, upstream_ca)
    token = (home / "token").read_text()
    pipe = Pipe()
    args = [
        *CREDPROXY,
        "run",
        "--workers",
        "2",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--upstream-ca",
        str(home / "upstream-ca.pem"),
        "--resolve",
        f"api.test=127.0.0.1:{shared_upstream.port}",
    ]
    process = subprocess.Popen(args, env=env, cwd=home, stdout=pipe.write_end)
    os.close(pipe.write_end)
    try:
        running = None
        deadline = time.monotonic() + 15
        while running is None and time.monotonic() < deadline:
            pipe.read_available(0.1)
            running = _started(bytes(pipe.data), process, home)
        assert running is not None
        port = running.port
        pipe.close()  # the reader is gone: the supervisor's writes fail with EPIPE

        def refused() -> bool:
            # A request whose audit line the supervisor fails to write (EPIPE)...
            with contextlib.suppress(httpx.HTTPError):
                one_request_as(port, home, token)
            reasons = []
            for _ in range(4):  # ...then every worker refuses at CONNECT
                sock, reply = connect(port, "api.test:443", proxy_auth("agent", token))
                sock.close()
                reasons.append((reply.status, reply.reason))
            return reasons == [(503, "audit-unavailable")] * 4

        assert eventually(refused)
        status, body = running.get_admin("/readyz")
        assert (status, json.loads(body)["audit"]) == (503, "failing")
        metrics = running.get_admin("/metrics")[1].decode()
        failures = [
            float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("credproxy_audit_write_failures_total ")
        ]
        assert failures and failures[0] > 0  # the supervisor's own, counted
        assert "credproxy_audit_writable 0.0" in metrics
    finally:
        process.terminate()
        process.wait(20)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # exited, not yet reaped by its new parent


def test_workers_stop_when_their_supervisor_is_killed(
    tmp_path: Path, initialised_home: Path, upstream_ca: trustme.CA, shared_upstream: Upstream
):
    proxy = start_proxy(
        tmp_path / "home",
        upstream_ca,
        _args(shared_upstream),
        extra=["--workers", "2"],
        template=initialised_home,
    )
    try:
        pids = proxy.audit()[0]["workers"]
        assert len(pids) == 2
        proxy.process.kill()
        assert eventually(lambda: all(_gone(pid) for pid in pids), 20)
    finally:
        stop_proxy(proxy)


def test_a_hung_worker_dies_with_its_killed_supervisor(
    tmp_path: Path, initialised_home: Path, upstream_ca: trustme.CA, shared_upstream: Upstream
):
    """A worker that cannot read the end of its stdin (stopped, or its event loop stuck) is
    still killed when the supervisor is: it must not hold the port on its own."""
    proxy = start_proxy(
        tmp_path / "home",
        upstream_ca,
        _args(shared_upstream),
        extra=["--workers", "2"],
        template=initialised_home,
    )
    try:
        pids = proxy.audit()[0]["workers"]
        os.kill(pids[0], signal.SIGSTOP)
        proxy.process.kill()
        assert eventually(lambda: all(_gone(pid) for pid in pids), 20)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stop_proxy(proxy)


def test_a_worker_that_does_not_drain_is_killed_and_the_supervisor_exits(
    tmp_path: Path, initialised_home: Path, upstream_ca: trustme.CA, shared_upstream: Upstream
):
    proxy = start_proxy(
        tmp_path / "home",
        upstream_ca,
        _args(shared_upstream),
        extra=["--workers", "2", "--drain-timeout", "1"],
        template=initialised_home,
    )
    try:
        pids = proxy.audit()[0]["workers"]
        os.kill(pids[1], signal.SIGSTOP)
        proxy.process.send_signal(signal.SIGTERM)
        assert proxy.process.wait(30) == 0
        assert all(_gone(pid) for pid in pids)
        [killed] = [e for e in proxy.audit() if e.get("event") == "worker.killed"]
        assert (killed["worker"], killed["during"]) == (2, "drain")
        assert proxy.audit()[-1]["event"] == "proxy.stopped"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stop_proxy(proxy)


def test_a_stalled_reader_refuses_in_every_worker_then_every_line_arrives_once(
    tmp_path: Path, initialised_home: Path, upstream_ca: trustme.CA, shared_upstream: Upstream
):
    home, env = _home(tmp_path, initialised_home, upstream_ca)
    pipe = Pipe()
    args = [
        *CREDPROXY,
        "run",
        "--workers",
        "2",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--upstream-ca",
        str(home / "upstream-ca.pem"),
        "--resolve",
        f"api.test=127.0.0.1:{shared_upstream.port}",
    ]
    process = subprocess.Popen(args, env=env, cwd=home, stdout=pipe.write_end)
    os.close(pipe.write_end)
    try:
        running = None
        deadline = time.monotonic() + 15
        while running is None and time.monotonic() < deadline:
            pipe.read_available(0.1)
            running = _started(bytes(pipe.data), process, home)
        assert running is not None
        token = (home / "token").read_text()
        sent: list[str] = []
        refused = None
        with running.client() as client:
            for n in range(4_000):  # two workers' pipes and queues, and the supervisor's
                path = f"/v1/{n}-{PAD}"
                reply = client.get(f"https://api.test{path}")  # a hang raises ReadTimeout
                if reply.status_code != 200:
                    refused = reply
                    break
                sent.append(path)
            assert refused is not None, "never refused: the queues have no bound"
            assert refused.headers["x-credproxy-reason"] == "audit-unavailable"
            status, body = running.get_admin("/readyz")
            assert (status, json.loads(body)["audit"]) == (503, "backlog")
            for _ in range(4):  # new connections: every worker refuses
                sock, answer = connect(running.port, "api.test:443", proxy_auth("agent", token))
                sock.close()
                assert (answer.status, answer.reason) == (503, "audit-unavailable")

            deadline = time.monotonic() + 30
            while running.get_admin("/readyz")[0] != 200:
                assert time.monotonic() < deadline, "serving did not resume"
                pipe.read_available(0.05)
            resumed = client.get(f"https://api.test/v1/resumed-{PAD}")
            sent.append(f"/v1/resumed-{PAD}")
            assert resumed.status_code == 200
        # Two workers' lines interleave: the other worker's refusals may follow the last line.
        deadline = time.monotonic() + 10
        while not _arrived(bytes(pipe.data), sent[-1], refused=5):
            assert time.monotonic() < deadline, "the last lines never arrived"
            pipe.read_available(0.05)
        _assert_each_once(bytes(pipe.data), sent, refused=5)
    finally:
        process.terminate()
        deadline = time.monotonic() + 20
        while process.poll() is None and time.monotonic() < deadline:
            pipe.read_available(0.1)
        process.kill()
        process.wait()
        pipe.close()


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(child) for child in text.split()]


def _runs_credproxy(pid: int) -> bool:
    """Past its exec: a worker's environment, not its parent's (a vfork child's)."""
    try:
        return b"CREDPROXY_WORKER=" in Path(f"/proc/{pid}/environ").read_bytes()
    except FileNotFoundError:
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_lines_of_requests_served_before_every_worker_started_survive_a_stop(
    tmp_path: Path, initialised_home: Path, upstream_ca: trustme.CA, shared_upstream: Upstream
):
    """One worker hangs at start-up (stopped), the other serves; SIGTERM then: the served
    request's audit line must reach stdout, not die in the supervisor's start-up hold."""
    home, env = _home(tmp_path, initialised_home, upstream_ca)
    token = (home / "token").read_text()
    port = _free_port()
    args = [
        *CREDPROXY,
        "run",
        "--workers",
        "2",
        "--listen",
        f"127.0.0.1:{port}",
        "--upstream-ca",
        str(home / "upstream-ca.pem"),
        "--resolve",
        f"api.test=127.0.0.1:{shared_upstream.port}",
    ]
    out = (home / "stdout").open("wb")
    err = (home / "stderr").open("wb")
    process = subprocess.Popen(args, env=env, cwd=home, stdout=out, stderr=err)
    hung = None
    try:
        deadline = time.monotonic() + 15
        while hung is None and time.monotonic() < deadline:
            children = [c for c in _children(process.pid) if _runs_credproxy(c)]
            if children:  # exec'd (a vfork child stopped before exec would stop its parent)
                hung = children[0]
                os.kill(hung, signal.SIGSTOP)  # before it imported mitmproxy: never listens
            time.sleep(0.005)
        assert hung is not None

        def served() -> bool:
            try:
                one_request_as(port, home, token)
            except httpx.HTTPError:
                return False  # the other worker is not listening yet
            return True

        assert eventually(served, 30)
        supervisors = [
            line for line in (home / "stdout").read_bytes().splitlines() if b'"worker"' not in line
        ]
        assert supervisors == []  # it has not announced: one worker never started
        process.send_signal(signal.SIGTERM)
        os.kill(hung, signal.SIGCONT)
        assert process.wait(30) == 0
    finally:
        if hung is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)
        if process.poll() is None:
            process.kill()
            process.wait()
        out.close()
        err.close()
    assert (home / "stderr").read_bytes() == b""
    lines = [json.loads(line) for line in (home / "stdout").read_bytes().splitlines()]
    assert shared_upstream.log.requests, "the request reached the upstream"
    served_lines = [line for line in lines if line.get("path") == "/v1/line"]
    assert len(served_lines) == 1 and served_lines[0]["decision"] == "allow"
    assert lines[-1]["event"] == "proxy.stopped" and "worker" not in lines[-1]


def test_a_sighup_while_the_workers_start_neither_kills_one_nor_the_supervisor(
    tmp_path: Path, initialised_home: Path, upstream_ca: trustme.CA, shared_upstream: Upstream
):
    home, env = _home(tmp_path, initialised_home, upstream_ca)
    args = [*CREDPROXY, "run", "--workers", "2", "--listen", "127.0.0.1:0"]
    out = (home / "stdout").open("wb")
    err = (home / "stderr").open("wb")
    process = subprocess.Popen(args, env=env, cwd=home, stdout=out, stderr=err)
    try:
        assert eventually(
            lambda: len([c for c in _children(process.pid) if _runs_credproxy(c)]) == 2, 15
        )
        process.send_signal(signal.SIGHUP)  # a reload asked for while they still import

        def started() -> bool:
            return b'"proxy.started"' in (home / "stdout").read_bytes().split(b"\n")[0]

        assert eventually(started, 30), (home / "stderr").read_text()
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        out.close()
        err.close()
    lines = [json.loads(line) for line in (home / "stdout").read_bytes().splitlines()]
    assert not [line for line in lines if line["event"] == "worker.exited"]


def _arrived(data: bytes, last: str, refused: int) -> bool:
    lines = _request_lines(data)
    return _request_paths(data)[last] > 0 and (
        sum(line.get("reason") == "audit-unavailable" for line in lines) >= refused
    )
