"""`credproxy run`'s process: the store and the policy opened, mitmproxy patched, the chain
served until a signal stops it."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from addon.mitm import patches, reuse
from addon.observe import audit, ocsf
from addon.observe.admin import AdminServer
from addon.observe.recent import Recent
from addon.proxy import signing
from addon.proxy.chain import REQUIRED_OPTIONS
from addon.proxy.corporate import ProxyCredential
from addon.proxy.forward import Forward
from addon.proxy.live import LivePolicy, abandoned
from addon.proxy.sources import DEFAULTS, OK, SourceSettings, describe
from addon.proxy.trail import Trail
from addon.runtime import master as masters
from addon.runtime.config import RunConfig, check_listen
from addon.runtime.console import Console
from addon.runtime.greeting import greeting
from addon.runtime.stopping import CLOSE_TIMEOUT, Stopping, settle
from addon.runtime.wiring import build_chain
from store.ca import PUBLIC_CERT, check_ca
from store.errors import CredproxyError, InvalidInput
from store.repository import Store


def main(
    config: RunConfig, held: SourceSettings = DEFAULTS, require_all_secrets: bool = False
) -> int:
    """Serve until stopped; the exit status. `held`: how secrets held elsewhere are read."""
    audit.configure(shape=ocsf.shape if config.audit_format == "ocsf" else None)
    code = asyncio.run(serve(config, held=held, require_all_secrets=require_all_secrets))
    if abandoned():
        # Threads stuck on dead database connections would be joined at exit, forever.
        audit.drain()
        os._exit(code)
    return code


async def serve(
    config: RunConfig,
    started: asyncio.Event | None = None,
    held: SourceSettings = DEFAULTS,
    require_all_secrets: bool = False,
) -> int:
    settings = config.settings
    store = Store(settings.db, settings.key())
    try:
        store.check_ready()
        check_ca(settings.certs)
        live = LivePolicy(
            store, max_stale=config.max_stale, reload_key=settings.key, source_settings=held
        )
        policy = live.load()
        _report_sources(live, require_all_secrets)
        proxy = config.upstream_proxy
        if proxy is not None and proxy.credential is not None:
            ProxyCredential(live, proxy).check(policy)
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
    log = audit.logger()
    settings = config.settings
    master = masters.build()
    masters.raise_on_start_error(master)
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
        config.upstream_proxy,
        config.prices,
    )
    master.addons.add(chain)
    reuse.activate(chain.part(reuse.Reuse))
    forward, trail = chain.part(Forward), chain.part(Trail)

    loop = asyncio.get_running_loop()
    stopping = Stopping(master, trail, config.drain_timeout, log)
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
        forward.guard = forward.guard.listening_on(listening + own)
        addrs = [f"{host}:{port}" for host, port in listening]
        if config.worker is None and sys.stdout.isatty():
            admins = [f"{host}:{port}" for host, port in admin_addr]
            ca = settings.certs / PUBLIC_CERT
            print(greeting(addrs, admins, store.display_url, ca), flush=True)
        log.info(
            "proxy.started",
            listen=addrs,
            admin=[f"{host}:{port}" for host, port in admin_addr],
            # Only with --console: the line's shape stays the same without it.
            **({"console": [f"{h}:{p}" for h, p in console_addr]} if console_addr else {}),
            pid=os.getpid(),
            db=store.display_url,
            grants=policy.grant_count,
            counter=policy.counter,
            unreadable=list(policy.unreadable),
        )
        if started is not None:
            started.set()
        gc.enable()  # main() kept the collector off for start-up

    admin, admin_addr = await _start_admin(config, live, trail)
    console, console_addr = await _start_console(config, live, trail)
    if config.worker is not None:
        admin_addr.extend(config.worker.avoid)  # the supervisor's admin listener
        config.worker.follow(stopping.begin)
    own = admin_addr + console_addr  # the guard keeps the proxy's own listeners out of reach
    forward.guard = forward.guard.listening_on(own)

    announcer = loop.create_task(announce())
    # What start-up built lives as long as the process: out of every later collection's scan.
    # The start-up objects already garbage are kept too: cheaper than the full collection
    # that would find them.
    gc.freeze()
    try:
        await master.run()
    except masters.StartFailed as e:
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
        if console is not None:
            await console.close()
        await settle(CLOSE_TIMEOUT)
        live.close()
        log.info("proxy.stopped", cut=stopping.cut)
    return 0


def _report_sources(live: LivePolicy, required: bool) -> None:
    """Each credential whose secret source cannot be read at start: one audit line each (its
    state and the error's class); with --require-all-secrets, no start."""
    unread = [r for r in live.sources.report() if r[2] != OK]
    for (name, ref, state, error), line in zip(unread, describe(unread), strict=True):
        audit.logger().warning(
            "secret_source.unresolved",
            credential=name,
            ref=ref,
            state=state,
            error=error,
            message=line,
        )
    if unread and required:
        live.close()
        names = ", ".join(r[0] for r in unread)
        raise InvalidInput(f"--require-all-secrets: secrets that cannot be read: {names}")


async def _start_admin(
    config: RunConfig, live: LivePolicy, trail: Trail
) -> tuple[AdminServer | None, list[tuple[str, int]]]:
    """The --admin listener (a worker's: its socket for the supervisor), and the addresses
    the proxy must never dial because they are its own."""
    admin_path = None if config.worker is None else config.worker.admin
    if config.admin is None and admin_path is None:
        return None, []

    def ready() -> tuple[bool, dict[str, object]]:
        current, audit_state = live.current(), audit.state()
        serving = current is not None and audit_state == audit.OK
        fields: dict[str, object] = {"store_up": live.store_up, "audit": audit_state}
        sources = getattr(live, "sources", None)
        if sources is not None:
            # Named, not counted against readiness: the other credentials still serve.
            fields["secret_sources_failing"] = [
                name for name, _, state, _ in sources.report() if state in ("failing", "pending")
            ]
        return serving, fields

    host, port = config.admin or ("", 0)
    admin = AdminServer(host, port, ready, trail.metrics.render, admin_path)
    try:
        address = await admin.start()
    except OSError as e:
        live.close()
        raise InvalidInput(f"cannot listen on --admin {host}:{port}: {e.strerror}") from e
    return admin, [] if admin_path is not None else [address]


async def _start_console(
    config: RunConfig, live: LivePolicy, trail: Trail
) -> tuple[Console | None, list[tuple[str, int]]]:
    """The --console listener, and its address for the guard."""
    if config.console is None:
        return None, []
    if config.operators is None:
        if not await live.call(live.store.live_console_tokens):
            live.close()
            raise InvalidInput(
                "--console: no live console token; run credproxy console token add NAME "
                "(or give --console-token-file)"
            )
    trail.recent = Recent()
    host, port = config.console
    console = Console(host, port, config.operators, live, trail.recent)
    try:
        address = await console.start()
    except OSError as e:
        live.close()
        raise InvalidInput(f"cannot listen on --console {host}:{port}: {e.strerror}") from e
    return console, [address]
