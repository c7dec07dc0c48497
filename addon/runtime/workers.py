"""`credproxy run --workers N`: a supervisor and N worker processes serving one port.

The supervisor reserves the port (a bound, never listening SO_REUSEPORT socket: the kernel
spreads connections over the workers' listeners on it), starts each worker as
`credproxy run` again with CREDPROXY_WORKER set, relays the workers' audit lines whole to its
own stdout with the worker's index, tells each worker its stream's state on the worker's
stdin (a worker refuses requests while the supervisor's stdout does not take lines), serves
the one admin listener from the workers' own (a Unix socket each), restarts a worker that
exits and drains them all on SIGTERM.

One module, about 450 lines: the supervisor's life (port, children, signals, merged metrics)
is one state machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from addon.observe import audit
from addon.observe.admin import AdminServer
from addon.observe.mergemetrics import merge
from addon.runtime.config import RunConfig, check_listen
from addon.runtime.greeting import greeting
from addon.runtime.workerrole import WORKER_ENV, Role
from store.ca import PUBLIC_CERT, check_ca
from store.errors import InvalidInput

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
# A worker that served this long before it exited is restarted without the backoff it had.
STABLE_SECONDS = 60.0
# Each read of a worker's audit pipe; a line longer than LINE_LIMIT is dropped and counted.
READ_CHUNK = 256 * 1024
LINE_LIMIT = 16 * 1024 * 1024
STATE_POLL = 0.05
ADMIN_TIMEOUT = 2.0
# A worker that has not said proxy.started by then is killed, and start-up fails.
START_TIMEOUT = 60.0
# A worker still running this long after --drain-timeout, once told to stop, is killed.
KILL_GRACE = 5.0


def supervise(config: RunConfig, argv: list[str]) -> int:
    # The ORM store costs start-up; the supervisor opens it once, here.
    from store.repository import Store

    store = Store(config.settings.db, config.settings.key())
    try:
        store.check_ready()
        shown_db = store.display_url
    finally:
        store.close()
    check_ca(config.settings.certs)
    check_listen(config.listen_host, config.listen_port)
    holders, port = reserve(config.listen_host, config.listen_port)
    audit.configure()
    try:
        listening = [f"{h.getsockname()[0]}:{port}" for h in holders]  # as a single process
        return asyncio.run(Supervisor(config, argv, port, shown_db, listening).run())
    finally:
        for holder in holders:
            holder.close()


def reserve(host: str, port: int) -> tuple[list[socket.socket], int]:
    """Bind (not listen) every address of `host` with SO_REUSEPORT: the port is ours."""
    where = f"--listen {host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise InvalidInput(f"cannot listen on {where}: {e.strerror}") from e
    holders: list[socket.socket] = []
    for family, kind, proto, _, address in dict.fromkeys(infos):
        holder = socket.socket(family, kind, proto)
        holders.append(holder)
        try:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                holder.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            holder.bind((address[0], port, *address[2:]))
        except OSError as e:
            for h in holders:
                h.close()
            raise InvalidInput(f"cannot listen on {where}: {e.strerror}") from e
        port = holder.getsockname()[1]
    return holders, port


@dataclass
class Worker:
    index: int
    role: Role
    process: asyncio.subprocess.Process | None = None
    started: bool = False  # its proxy.started line came
    since: float = 0.0
    backoff: float = BACKOFF_START
    restarts: int = 0
    relay: asyncio.Task[None] | None = None
    policy: dict[str, Any] = dataclasses.field(default_factory=dict)  # from its proxy.started


class Supervisor:
    def __init__(
        self,
        config: RunConfig,
        argv: list[str],
        port: int,
        db: str,
        listening: list[str] | None = None,
    ) -> None:
        self.listening = listening or []
        self.config = config
        self.db = db
        self.argv = argv
        self.port = port
        self.log = audit.logger()
        self.runtime = Path(tempfile.mkdtemp(prefix="credproxy-workers-"))
        self.workers: list[Worker] = []
        self.stopping = asyncio.Event()
        self.announced = False
        self.holding = True  # until our proxy.started, or start-up ends without it
        self.held: list[str] = []  # workers' lines meanwhile
        self.held_bytes = 0
        self.state = audit.OK
        self.signals = 0

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        admin = None
        admin_addr: list[tuple[str, int]] = []
        try:
            if self.config.admin is not None:
                host, port = self.config.admin
                admin = AdminServer(host, port, self.ready, self.metrics)
                try:
                    admin_addr.append(await admin.start())
                except OSError as e:
                    raise InvalidInput(
                        f"cannot listen on --admin {host}:{port}: {e.strerror}"
                    ) from e
            for index in range(1, self.config.workers + 1):
                role = Role(
                    index,
                    self.port,
                    str(self.runtime / f"worker-{index}.sock"),
                    tuple(admin_addr),
                    os.getpid(),
                )
                self.workers.append(Worker(index, role))
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.stop, sig)
            loop.add_signal_handler(signal.SIGHUP, self.reload)
            watchers = [loop.create_task(self.watch(w)) for w in self.workers]
            states = loop.create_task(self.tell_state())
            deadline = time.monotonic() + START_TIMEOUT
            while not all(w.started for w in self.workers):
                if self.stopping.is_set():
                    break
                if time.monotonic() > deadline:
                    stuck = [w for w in self.workers if not w.started]
                    for w in stuck:
                        self.kill(w, "start-up")
                    self.stopping.set()
                    self.release()
                    await self.terminate()
                    raise InvalidInput(
                        f"worker {stuck[0].index} did not start within {START_TIMEOUT:.0f} s"
                    )
                failed = [w for w in self.workers if w.process and w.process.returncode is not None]
                if failed:
                    self.stopping.set()
                    self.release()  # what the others served, and why this one failed
                    await self.terminate()
                    raise InvalidInput(
                        f"worker {failed[0].index} exited at start-up "
                        f"(status {failed[0].process.returncode if failed[0].process else '?'})"
                    )
                await asyncio.sleep(0.02)
            if not self.stopping.is_set():
                self.announce(admin_addr)
            self.release()  # stopped before every worker started: their lines still count
            await self.stopping.wait()
            await self.terminate()
            await asyncio.gather(*watchers, return_exceptions=True)
            states.cancel()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            if admin is not None:
                await admin.close()
            shutil.rmtree(self.runtime, ignore_errors=True)
        self.log.info("proxy.stopped", workers=len(self.workers))
        return 0

    def announce(self, admin_addr: list[tuple[str, int]]) -> None:
        admins = [f"{h}:{p}" for h, p in admin_addr]
        if sys.stdout.isatty():
            ca = self.config.settings.certs / PUBLIC_CERT
            print(greeting(self.listening, admins, self.db, ca), flush=True)
        self.log.info(
            "proxy.started",
            listen=self.listening,
            admin=admins,
            pid=os.getpid(),
            workers=[w.process.pid for w in self.workers if w.process],
            db=self.db,
            grants=min(int(w.policy.get("grants", 0)) for w in self.workers),
            counter=min(int(w.policy.get("counter", 0)) for w in self.workers),
            unreadable=sorted({u for w in self.workers for u in w.policy.get("unreadable", [])}),
        )
        self.announced = True
        self.release()

    def release(self) -> None:
        """Write the workers' lines held during start-up; from now on each goes straight out."""
        self.holding = False
        held, self.held, self.held_bytes = self.held, [], 0
        for line in held:
            audit.relay(line)

    def stop(self, sig: signal.Signals) -> None:
        self.signals += 1
        if self.signals == 1:
            self.log.info("proxy.stopping", signal=sig.name, workers=len(self.workers))
        self.stopping.set()
        self.forward(signal.SIGTERM)  # a second signal hurries the workers' drain

    def reload(self) -> None:
        """SIGHUP to the workers that have started: one still starting has no handler yet,
        and SIGHUP would end it (it loads the store's policy as it starts anyway)."""
        self.forward(signal.SIGHUP, started_only=True)

    def forward(self, sig: signal.Signals, started_only: bool = False) -> None:
        for w in self.workers:
            if started_only and not w.started:
                continue
            if w.process is not None and w.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.process.send_signal(sig)

    async def terminate(self) -> None:
        if self.signals == 0:  # not yet passed on by stop()
            self.forward(signal.SIGTERM)
        deadline = time.monotonic() + self.config.drain_timeout + KILL_GRACE
        for w in self.workers:
            if w.process is not None:
                try:
                    await asyncio.wait_for(w.process.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:  # hung: it would hold the port after we are gone
                    self.kill(w, "drain")
                    await w.process.wait()
            if w.relay is not None:
                await w.relay

    def kill(self, w: Worker, during: str) -> None:
        if w.process is None or w.process.returncode is not None:
            return
        self.log.warning("worker.killed", worker=w.index, pid=w.process.pid, during=during)
        with contextlib.suppress(ProcessLookupError):
            w.process.kill()

    async def spawn(self, w: Worker) -> None:
        # A worker killed before it could remove its temporary folder leaves it in ours.
        env = {**os.environ, WORKER_ENV: w.role.to_env(), "TMPDIR": str(self.runtime)}
        w.started = False
        w.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "addon.cli.cli",
            *self.argv,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # a terminal's ^C reaches the supervisor, which drains them
        )
        w.since = time.monotonic()
        if self.stopping.is_set():  # the signal came while it was being started
            w.process.send_signal(signal.SIGTERM)
        self.send_state(w, self.state)
        assert w.process.stdout is not None
        w.relay = asyncio.get_running_loop().create_task(self.relay(w, w.process.stdout))

    async def watch(self, w: Worker) -> None:
        """Run the worker; restart it when it exits unless we are stopping."""
        while True:
            await self.spawn(w)
            assert w.process is not None and w.relay is not None
            status = await w.process.wait()
            await w.relay
            if self.stopping.is_set():
                return
            served = time.monotonic() - w.since
            if served >= STABLE_SECONDS:
                w.backoff = BACKOFF_START
            delay = w.backoff
            w.backoff = min(w.backoff * 2, BACKOFF_MAX)
            w.restarts += 1
            self.log.warning(
                "worker.exited",
                worker=w.index,
                pid=w.process.pid,
                status=status,
                served_s=round(served, 3),
                restart_in_s=delay if self.announced else None,
                restarts=w.restarts,
            )
            if not self.announced:
                return  # start-up failed: run() stops
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
            if self.stopping.is_set():
                return

    async def relay(self, w: Worker, pipe: asyncio.StreamReader) -> None:
        """The worker's audit lines, whole, on our stdout, each with the worker's index."""
        prefix = f'{{"worker":{w.index},'
        partial = b""
        skipping = False  # inside a line over LINE_LIMIT: dropped up to its newline
        lost = 0
        while True:
            while self.behind() and not self.stopping.is_set():
                # Our stdout is behind: so are the workers, which refuse requests meanwhile.
                # Stopping, every line is taken: the writer queues or counts what it drops.
                await asyncio.sleep(STATE_POLL)
            data = await pipe.read(READ_CHUNK)
            if not data:
                break
            partial += data
            end = partial.rfind(b"\n")
            if end < 0:
                if len(partial) > LINE_LIMIT:
                    lost += 0 if skipping else 1
                    skipping, partial = True, b""
                continue
            lines, partial = partial[: end + 1], partial[end + 1 :]
            raws = lines.split(b"\n")[:-1]  # "\n" only: a "\r" inside is no line's end
            if skipping:
                skipping, raws = False, raws[1:]  # the over-long line's tail
            for raw in raws:
                self.pass_line(w, prefix, raw.decode("utf-8", "backslashreplace") + "\n")
        if partial and not skipping:
            lost += 1  # a worker killed mid-line: never half a line on stdout
        if lost:
            self.log.warning("audit.lines_lost", worker=w.index, count=lost)

    def behind(self) -> bool:
        """Our stdout is behind, or start-up has held a queue's worth of lines."""
        return not audit.writable() or (self.holding and self.held_bytes > audit.QUEUE_LIMIT)

    def pass_line(self, w: Worker, prefix: str, line: str) -> None:
        """Relay a worker's line (ending in its newline) if it is a JSON object, else only
        say that the worker printed something, and how much: never its text."""
        try:
            parsed = json.loads(line) if line.startswith("{") else None
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict) or not parsed:
            line = json.dumps({"event": "worker.output", "bytes": len(line)}) + "\n"
            parsed = None
        if not w.started and parsed is not None and parsed.get("event") == "proxy.started":
            w.started = True
            w.policy = parsed
        line = prefix + line[1:]
        if self.holding:
            self.held.append(line)
            self.held_bytes += len(line)
        else:
            audit.relay(line)

    def send_state(self, w: Worker, state: str) -> None:
        if w.process is None or w.process.stdin is None or w.process.returncode is not None:
            return
        with contextlib.suppress(OSError, RuntimeError):
            w.process.stdin.write(f"{state}\n".encode())

    async def tell_state(self) -> None:
        while True:
            state = audit.state()
            if state != self.state:
                self.state = state
                for w in self.workers:
                    self.send_state(w, state)
            await asyncio.sleep(STATE_POLL)

    async def ask(self, w: Worker, path: str) -> tuple[int, bytes]:
        """GET `path` from a worker's admin socket: (status, body); (0, b"") if it cannot answer."""
        if w.process is None or w.process.returncode is not None or not w.started:
            return 0, b""
        try:
            async with asyncio.timeout(ADMIN_TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(w.role.admin)
                writer.write(f"GET {path} HTTP/1.1\r\nhost: worker\r\n\r\n".encode())
                answer = await reader.read()
                writer.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            return int(head.split(b" ", 2)[1]), body
        except (OSError, TimeoutError, ValueError, IndexError):
            return 0, b""

    async def ready(self) -> tuple[bool, dict[str, object]]:
        answers = await asyncio.gather(*(self.ask(w, "/readyz") for w in self.workers))
        workers = []
        for w, (status, body) in zip(self.workers, answers, strict=True):
            detail: dict[str, object] = {}
            with contextlib.suppress(ValueError):
                detail = json.loads(body or b"{}")
            workers.append(
                {
                    "worker": w.index,
                    "pid": w.process.pid if w.process else None,
                    "ready": status == 200,
                    "store_up": detail.get("store_up", False),
                    "restarts": w.restarts,
                }
            )
        state = audit.state()
        ready = state == audit.OK and all(entry["ready"] for entry in workers)
        store_up = all(entry["store_up"] for entry in workers)
        return ready, {"store_up": store_up, "audit": state, "workers": workers}

    async def metrics(self) -> bytes:
        answers = await asyncio.gather(*(self.ask(w, "/metrics") for w in self.workers))
        texts = [body.decode() for status, body in answers if status == 200]
        alive = sum(1 for status, _ in answers if status == 200)
        own = (
            "# HELP credproxy_workers Worker processes configured\n"
            "# TYPE credproxy_workers gauge\n"
            f"credproxy_workers {len(self.workers)}\n"
            "# HELP credproxy_workers_answering Workers whose metrics are in this answer\n"
            "# TYPE credproxy_workers_answering gauge\n"
            f"credproxy_workers_answering {alive}\n"
            "# HELP credproxy_audit_queue_bytes Audit bytes waiting for stdout\n"
            "# TYPE credproxy_audit_queue_bytes gauge\n"
            f"credproxy_audit_queue_bytes {audit.queued_bytes()}\n"
            "# HELP credproxy_audit_write_failures_total Failed writes to stdout\n"
            "# TYPE credproxy_audit_write_failures_total counter\n"
            f"credproxy_audit_write_failures_total {audit.write_failures()}\n"
            "# HELP credproxy_worker_restarts_total Workers restarted after they exited\n"
            "# TYPE credproxy_worker_restarts_total counter\n"
            f"credproxy_worker_restarts_total {sum(w.restarts for w in self.workers)}\n"
        )
        return merge(texts, own)


__all__ = ["Role", "reserve", "supervise"]
