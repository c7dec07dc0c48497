"""`credproxy run`: mitmproxy's Master embedded in our own process, with our addons."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from addon.core.argtypes import count, seconds
from addon.core.guard import DestinationGuard
from addon.core.hosts import ResolveMap
from addon.observe import audit
from addon.observe.admin import AdminServer
from addon.proxy.dns import DEFAULT_TTL
from addon.proxy.limits import LimitSettings, add_limit_flags
from addon.proxy.notify import Webhook
from addon.runtime.config import RunConfig, check_listen
from store.errors import CredproxyError, InvalidInput
from store.repository import Store
from store.settings import Settings

if TYPE_CHECKING:
    from addon.proxy.chain import Chain
    from addon.proxy.live import LivePolicy

DRAIN_POLL = 0.05
MAX_SIGNED_BODY = 1024 * 1024 * 1024
# After the drain deadline, how long closing the remaining connections may take.
CLOSE_TIMEOUT = 2.0


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[common], help="run the proxy")
    p.add_argument(
        "--listen", default="127.0.0.1:8080", help="HOST:PORT to listen on (default %(default)s)"
    )
    p.add_argument("--upstream-ca", help="extra CA certificates (PEM) trusted for upstream TLS")
    p.add_argument(
        "--resolve",
        action="append",
        default=[],
        metavar="NAME[:PORT]=ADDRESS[:PORT]",
        help="dial ADDRESS for NAME; SNI, Host and verification keep NAME (repeatable)",
    )
    p.add_argument(
        "--allow-private",
        action="append",
        default=[],
        metavar="CIDR",
        help="let upstream names resolve into this non-public range (repeatable)",
    )
    p.add_argument(
        "--admin",
        metavar="HOST:PORT",
        help="serve /healthz and /readyz here (default: off); never through the proxy",
    )
    p.add_argument(
        "--alert-streak",
        type=count(1),
        default=20,
        metavar="N",
        help="alert once when a principal is denied N times in a row (default 20)",
    )
    p.add_argument(
        "--max-stale",
        type=seconds(),
        default=30.0,
        help="seconds to serve the last policy while the store is unreachable (default 30)",
    )
    p.add_argument(
        "--drain-timeout",
        type=seconds(),
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, let in-flight requests finish this long (default 10)",
    )
    p.add_argument(
        "--dns-ttl",
        type=seconds(),
        default=DEFAULT_TTL,
        metavar="SECONDS",
        help="reuse a vetted name lookup this long, then refresh it (default %(default)g)",
    )
    p.add_argument(
        "--max-signed-body",
        type=count(0, MAX_SIGNED_BODY),
        metavar="BYTES",
        help="hold and sign AWS request bodies up to this size (default 8388608, 8 MiB)",
    )
    p.add_argument(
        "--notify",
        metavar="URL",
        default=os.environ.get("CREDPROXY_NOTIFY"),
        help="post new access requests and held requests to this https webhook "
        "(default: $CREDPROXY_NOTIFY; prefer it for a URL that holds a token)",
    )
    p.add_argument(
        "--shared-rates",
        action="store_true",
        help="keep --rate buckets in the store: exact across replicas, one store call a request",
    )
    p.add_argument(
        "--workers",
        type=count(1, 64),
        default=1,
        metavar="N",
        help="serve the port from N worker processes under one supervisor (default 1)",
    )
    p.add_argument(
        "--upstream-idle",
        type=seconds(),
        default=4.0,
        metavar="SECONDS",
        help="keep an idle upstream connection this long for the principal's next client "
        "connection to the same host; 0: never (default %(default)g)",
    )
    add_limit_flags(p)
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    config = RunConfig.from_args(args, settings)
    if config.workers > 1:
        from addon.runtime.workerrole import Role

        role = Role.from_env()
        if role is None:
            from addon.runtime import workers

            return workers.supervise(config, sys.argv[1:])
        role.bind_to_supervisor()
        config = dataclasses.replace(
            config, listen_port=role.port, admin=None, workers=1, worker=role
        )
    audit.configure()
    code = asyncio.run(serve(config))
    from addon.proxy import live

    if live.abandoned():
        # Threads stuck on dead database connections would be joined at exit, forever.
        audit.drain()
        os._exit(code)
    return code


def build_chain(
    live: LivePolicy,
    resolve: ResolveMap,
    guard: DestinationGuard,
    alert_streak: int = 20,
    limits: LimitSettings | None = None,
    dns_ttl: float = DEFAULT_TTL,
    max_signed_body: int | None = None,
    notify: Webhook | None = None,
    cafile: str | None = None,
    shared_rates: bool = False,
    upstream_idle: float = 4.0,
) -> Chain:
    """credproxy's addons, in the order they run for each hook."""
    import time

    from addon.mitm.reuse import Reuse
    from addon.observe.metrics import Metrics, StreakAlerts
    from addon.proxy.access import AccessEndpoint, AccessRequests
    from addon.proxy.approval import Holds, HoldSettings
    from addon.proxy.auth import Auth
    from addon.proxy.chain import Chain, Lifecycle
    from addon.proxy.forward import Forward
    from addon.proxy.gate import Gate
    from addon.proxy.limits import Limits
    from addon.proxy.notify import Notifier
    from addon.proxy.pinning import Pinning
    from addon.proxy.ratelimit import Limiter, SharedLimiter
    from addon.proxy.responses import Responses
    from addon.proxy.signing import Signing
    from addon.proxy.state import Clients
    from addon.proxy.trail import Trail
    from addon.schemes.assume import SESSIONS
    from addon.schemes.mint import TOKENS

    log = audit.logger()
    metrics = Metrics(
        snapshot_age=lambda: time.monotonic() - getattr(live, "last_ok", 0.0),
        store_up=lambda: bool(getattr(live, "store_up", False)),
    )
    live.on_reload = metrics.reloads.inc
    trail = Trail(metrics, StreakAlerts(alert_streak, log))
    clients = Clients()
    access = AccessRequests(live, log)
    limiter = SharedLimiter(live) if shared_rates else Limiter()
    signing = Signing(trail) if max_signed_body is None else Signing(trail, max_signed_body)
    limits = limits or LimitSettings()
    holds = Holds(live, metrics, HoldSettings(limits.max_holds, limits.max_held))
    forward = Forward(
        live,
        resolve,
        guard,
        clients,
        trail,
        metrics,
        dns_ttl,
        limiter=limiter,
        signing=signing,
        holds=holds,
    )
    deadlines = Limits(limits, clients, trail)
    holds.on_hold = deadlines.hold
    notifier = None
    if notify is not None:
        notifier = Notifier(notify, forward.dial, metrics, cafile)
        holds.notify = access.notify = notifier.post
    SESSIONS.dial = forward.dial  # AssumeRole calls go out as the requests do
    TOKENS.dial = forward.dial  # and so do token endpoint calls
    TOKENS.vault = getattr(live, "store", None)
    TOKENS.count = lambda credential, outcome: metrics.token_mints.labels(credential, outcome).inc()
    return Chain(
        [
            Lifecycle(live),  # configure, running, done: the options and the policy poller
            Auth(live, clients, trail),  # http_connect, requestheaders: who, and the tunnel
            Pinning(clients),  # tls_clienthello, tls_start_client, server_connect
            # running, configure, responseheaders, done: parked upstream connections
            Reuse(clients, upstream_idle, limits.connect_timeout),
            Gate(access, trail, limiter),  # requestheaders: the principal's rate, the verdict
            # requestheaders: the scheme's checks, the grant's rate, vet the address, use a
            # once- or counted grant, stamp
            forward,
            AccessEndpoint(access, trail),  # request: credproxy.internal
            signing,  # request: sign a held body (sigv4) once it is whole
            Responses(),  # responseheaders, response, websocket_message: redaction
            trail,  # response, error: the audit line
            holds,  # done: the poller of held requests' decisions
            # caps and deadlines, last: it sees what the others did
            deadlines,
            *([notifier] if notifier is not None else []),  # running, done: the sender
        ],
    )


async def serve(config: RunConfig, started: asyncio.Event | None = None) -> int:
    # Heavy imports here, so that the store commands of the same CLI start quickly.
    from addon.mitm import patches
    from addon.proxy import signing
    from addon.proxy.live import LivePolicy
    from store.ca import check_ca

    settings = config.settings
    store = Store(settings.db, settings.key())
    try:
        store.check_ready()
        check_ca(settings.certs)
        live = LivePolicy(store, max_stale=config.max_stale, reload_key=settings.key)
        policy = live.load()
    except CredproxyError:
        store.close()
        raise
    try:
        if config.worker is None:
            check_listen(config.listen_host, config.listen_port)
        else:
            config.worker.share_port()  # the supervisor holds the port
    except InvalidInput:
        store.close()
        raise
    # Where mitmproxy has no hook: its error pages, head limits, refused bodies, WebSocket
    # control frames, a connect reset mid-setup, held bodies. Each raises here if mitmproxy
    # changed shape: never open later.
    patches.install_all(signing.install)
    # However start-up or serving ends (an --admin address taken, say), the folder goes.
    runtime = Path(tempfile.mkdtemp(prefix="credproxy-"))
    try:
        return await _serve(config, store, live, policy, runtime, started)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


async def _serve(
    config: RunConfig,
    store: Store,
    live: LivePolicy,
    policy: Any,
    runtime: Path,
    started: asyncio.Event | None,
) -> int:
    from addon.mitm import reuse
    from addon.proxy.chain import REQUIRED_OPTIONS
    from addon.proxy.forward import Forward
    from addon.proxy.trail import Trail
    from addon.runtime.master import build as build_master

    log = audit.logger()
    settings = config.settings
    master = build_master()
    _quiet_errorcheck(master)
    update: dict[str, Any] = {
        "listen_host": config.listen_host,
        "listen_port": config.listen_port,
        "confdir": str(settings.certs),
        "block_global": False,
        "http2": True,
        "websocket": True,
        # The options of onboarding and proxyauth do not exist here (their addons are not
        # loaded): nothing can turn them on. Any other required option that is missing fails
        # the start (KeyError), never skipped.
        **{k: v for k, v in REQUIRED_OPTIONS.items() if k not in ("onboarding", "proxyauth")},
    }
    if config.upstream_ca is not None:
        update["ssl_verify_upstream_trusted_ca"] = str(config.upstream_ca.bundle(runtime))
        from addon.schemes.assume import SESSIONS

        SESSIONS.cafile = update["ssl_verify_upstream_trusted_ca"]
        from addon.schemes.mint import TOKENS

        TOKENS.cafile = SESSIONS.cafile
    master.options.update(**update)
    chain = build_chain(
        live,
        config.resolve,
        config.guard,
        config.alert_streak,
        config.limits,
        config.dns_ttl,
        config.max_signed_body,
        config.notify,
        update.get("ssl_verify_upstream_trusted_ca"),
        config.shared_rates,
        config.upstream_idle,
    )
    master.addons.add(chain)
    reuse.activate(chain.part(reuse.Reuse))
    forward, trail = chain.part(Forward), chain.part(Trail)

    loop = asyncio.get_running_loop()
    stopping = _Stopping(master, trail, config.drain_timeout, log)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.begin, sig)
    loop.add_signal_handler(signal.SIGHUP, stopping.reload, live)

    async def announce() -> None:
        proxyserver: Any = master.addons.get("proxyserver")
        while not proxyserver.listen_addrs():
            if master.should_exit.is_set():
                return
            await asyncio.sleep(0.02)
        listening = [(str(a[0]), int(a[1])) for a in proxyserver.listen_addrs()]
        forward.guard = forward.guard.listening_on(listening + admin_addr)
        addrs = [f"{host}:{port}" for host, port in listening]
        if config.worker is None and sys.stdout.isatty():
            admins = [f"{host}:{port}" for host, port in admin_addr]
            from store.ca import PUBLIC_CERT

            ca = settings.certs / PUBLIC_CERT
            print(greeting(addrs, admins, store.display_url, ca), flush=True)
        log.info(
            "proxy.started",
            listen=addrs,
            admin=[f"{host}:{port}" for host, port in admin_addr],
            pid=os.getpid(),
            db=store.display_url,
            grants=policy.grant_count,
            counter=policy.counter,
            unreadable=list(policy.unreadable),
        )
        if started is not None:
            started.set()
        gc.enable()  # main() kept the collector off for start-up

    admin = None
    admin_addr: list[tuple[str, int]] = []
    admin_path = None if config.worker is None else config.worker.admin
    if config.admin is not None or admin_path is not None:

        def ready() -> tuple[bool, dict[str, object]]:
            current, audit_state = live.current(), audit.state()
            serving = current is not None and audit_state == audit.OK
            return serving, {"store_up": live.store_up, "audit": audit_state}

        host, port = config.admin or ("", 0)
        admin = AdminServer(host, port, ready, trail.metrics.render, admin_path)
        try:
            address = await admin.start()
        except OSError as e:
            live.close()
            raise InvalidInput(f"cannot listen on --admin {host}:{port}: {e.strerror}") from e
        if admin_path is None:
            admin_addr.append(address)
    if config.worker is not None:
        admin_addr.extend(config.worker.avoid)  # the supervisor's admin listener
        config.worker.follow(stopping.begin)
    forward.guard = forward.guard.listening_on(admin_addr)

    announcer = loop.create_task(announce())
    # What start-up built lives as long as the process: out of every later collection's scan.
    # The start-up objects already garbage are kept too: cheaper than the full collection
    # that would find them.
    gc.freeze()
    try:
        await master.run()
    except _StartFailed as e:
        if master.addons.get("proxyserver").listen_addrs():
            raise InvalidInput("mitmproxy logged an error at start-up: see the output") from e
        # The listener failed after the probe above: a port taken meanwhile.
        check_listen(config.listen_host, config.listen_port)
        raise InvalidInput(
            f"cannot listen on --listen {config.listen_host}:{config.listen_port}"
        ) from e
    finally:
        announcer.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        if admin is not None:
            await admin.close()
        await _settle(CLOSE_TIMEOUT)
        live.close()
        log.info("proxy.stopped", cut=stopping.cut)
    return 0


def greeting(listen: list[str], admin: list[str], db: str, ca: Path) -> str:
    """The one line a person at the terminal reads before the JSON lines."""
    admin_part = f" (admin {', '.join(admin)})" if admin else ""
    return (
        f"credproxy listening on {', '.join(listen)}{admin_part}; store {db}; "
        f"clients must trust {ca}; Ctrl-C stops it. JSON lines follow."
    )


async def _settle(timeout: float) -> None:
    """Cancel what still runs (pollers, a connection past the close deadline) and let it end.

    asyncio.run would cancel these after serve() returns, when their hooks' lines would come
    after proxy.stopped and find the store closed; here they end first.
    """
    current = asyncio.current_task()
    pending = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=timeout)


class _StartFailed(Exception):
    """mitmproxy logged an error while starting (a listener that failed, say)."""


def _quiet_errorcheck(master: Any) -> None:
    """Raise where mitmproxy's errorcheck would print its own line and exit 1.

    The error itself is already in the output, as a log line; its advice names mitmproxy's
    flags, not credproxy's, so serve() says what failed in one line of its own.
    """
    errorcheck = master.addons.get("errorcheck")

    async def refuse() -> None:
        await asyncio.sleep(0)  # as errorcheck does: let pending log records arrive
        if errorcheck.logger.has_errored:
            raise _StartFailed

    errorcheck.shutdown_if_errored = refuse


class _Stopping:
    """SIGTERM/SIGINT: stop accepting, drain in-flight requests, then stop. SIGHUP: reload."""

    def __init__(self, master: Any, trail: Any, drain_timeout: float, log: Any) -> None:
        self.master = master
        self.trail = trail
        self.drain_timeout = drain_timeout
        self.log = log
        self.cut = 0  # requests still in flight at the deadline
        self._draining = False
        self._hurry = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def begin(self, sig: signal.Signals) -> None:
        if self._draining:
            self._hurry.set()  # a second signal: stop waiting
            return
        self._draining = True
        self.log.info(
            "proxy.stopping",
            signal=sig.name,
            in_flight=self.trail.open,
            drain_timeout_s=self.drain_timeout,
        )
        self._spawn(self._drain(), "drain")

    def reload(self, live: Any) -> None:
        self.log.info("proxy.reload_requested", signal="SIGHUP")
        self._spawn(live.poll(force=True), "reload")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        try:
            proxyserver: Any = self.master.addons.get("proxyserver")
            for server in list(proxyserver.servers):
                if server.is_running:
                    await server.stop()
            await self._wait(lambda: not self.trail.open, self.drain_timeout)
            self.cut = self.trail.open
            # Idle keep-alives, open tunnels and WebSockets, and whatever missed the deadline:
            # closed here, so their audit lines are written before proxy.stopped.
            for handler in list(proxyserver.connections.values()):
                io = handler.transports.get(handler.client)
                if io is not None and io.handler is not None:
                    io.handler.cancel("credproxy is stopping")
            # Not cut short by a second signal: the handlers are already cancelled, and their
            # own lines (audit, disconnects) must come before proxy.stopped.
            await self._wait(lambda: not proxyserver.connections, CLOSE_TIMEOUT, hurry=False)
        finally:
            self.master.shutdown()

    async def _wait(self, done: Any, timeout: float, hurry: bool = True) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done() and loop.time() < deadline and not (hurry and self._hurry.is_set()):
            await asyncio.sleep(DRAIN_POLL)
