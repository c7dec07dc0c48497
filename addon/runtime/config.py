"""`credproxy run`'s configuration: its options parsed and checked once, frozen."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from addon.core.guard import DestinationGuard
from addon.core.hosts import ResolveMap
from addon.core.prices import MAX_FILE as MAX_PRICE_FILE
from addon.core.prices import PriceError, Prices
from addon.mitm.via import UpstreamProxy
from addon.observe.otlp import OtlpSettings
from addon.proxy.dns import DEFAULT_TTL
from addon.proxy.limits import LimitSettings
from addon.proxy.notify import Webhook
from addon.runtime.consoleauth import Operators
from addon.runtime.upstreamca import UpstreamCA
from store.errors import InvalidInput
from store.rules.grammar import parse_authority
from store.settings import Settings

if TYPE_CHECKING:
    from addon.runtime.workerrole import Role


@dataclass(frozen=True)
class RunConfig:
    """`credproxy run`'s options, parsed and checked once at start."""

    settings: Settings
    listen_host: str
    listen_port: int
    upstream_ca: UpstreamCA | None
    resolve: ResolveMap
    guard: DestinationGuard
    max_stale: float
    admin: tuple[str, int] | None
    alert_streak: int
    drain_timeout: float = 10.0
    limits: LimitSettings = LimitSettings()
    dns_ttl: float = DEFAULT_TTL
    max_signed_body: int = 8 * 1024 * 1024
    notify: Webhook | None = None
    shared_rates: bool = False
    workers: int = 1
    upstream_idle: float = 4.0  # addon/mitm/reuse.py: seconds an idle upstream connection is kept
    upstream_proxy: UpstreamProxy | None = None  # addon/mitm/via.py: the corporate proxy
    audit_format: str = "json"  # or "ocsf": addon/observe/ocsf.py
    otlp: OtlpSettings | None = None  # addon/observe/otlp.py: the audit's OTLP export
    worker: Role | None = None  # set in a worker process of `--workers N`
    console: tuple[str, int] | None = None  # addon/runtime/console.py: the approvers' console
    operators: Operators | None = None  # who may sign in to it
    prices: Prices | None = None  # addon/core/prices.py: for grants' spend limits

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Settings) -> RunConfig:
        host, port = parse_listen(args.listen, "--listen")
        upstream_ca = UpstreamCA.read(Path(args.upstream_ca)) if args.upstream_ca else None
        try:
            resolve = ResolveMap.parse(args.resolve)
        except ValueError as e:
            raise InvalidInput(str(e)) from e
        try:
            guard = DestinationGuard.parse(args.allow_private)
        except ValueError as e:
            raise InvalidInput(str(e)) from e
        admin = parse_listen(args.admin, "--admin") if args.admin else None
        upstream_proxy = parse_upstream_proxy(args)
        console, operators = parse_console(args)
        prices = read_prices(args.prices) if args.prices else None
        return cls(
            settings,
            host,
            port,
            upstream_ca,
            resolve,
            guard,
            args.max_stale,
            admin,
            args.alert_streak,
            args.drain_timeout,
            LimitSettings.from_args(args),
            args.dns_ttl,
            args.max_signed_body if args.max_signed_body is not None else cls.max_signed_body,
            Webhook.parse(args.notify) if args.notify else None,
            args.shared_rates,
            args.workers,
            args.upstream_idle,
            upstream_proxy=upstream_proxy,
            audit_format=args.audit_format,
            otlp=OtlpSettings.configured(args.otlp_endpoint, args.otlp_queue, os.environ),
            console=console,
            operators=operators,
            prices=prices,
        )


def read_prices(path: str) -> Prices:
    """--prices FILE, read and checked once; InvalidInput in one line."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PRICE_FILE + 1)
    except OSError as e:
        raise InvalidInput(f"--prices: cannot read {path}: {e.strerror}") from e
    try:
        return Prices.parse(data, f"--prices {path}")
    except PriceError as e:
        raise InvalidInput(str(e)) from e


def parse_console(args: argparse.Namespace) -> tuple[tuple[str, int] | None, Operators | None]:
    """--console and its operators' tokens (never on the command line)."""
    if not args.console:
        if args.console_token_file:
            raise InvalidInput("--console-token-file needs --console")
        return None, None
    if args.workers > 1:
        raise InvalidInput("--console serves one process: it cannot go with --workers")
    console = parse_listen(args.console, "--console")
    # Without a file, only the store's tokens (`credproxy console token add`) sign in.
    return console, Operators.read(args.console_token_file) if args.console_token_file else None


def parse_upstream_proxy(args: argparse.Namespace) -> UpstreamProxy | None:
    """--upstream-proxy and its companions; the names --resolve maps are dialled directly."""
    if not args.upstream_proxy:
        if args.upstream_proxy_bypass or args.upstream_proxy_credential:
            raise InvalidInput(
                "--upstream-proxy-bypass and --upstream-proxy-credential need --upstream-proxy"
            )
        return None
    try:
        proxy = UpstreamProxy.parse(
            args.upstream_proxy, args.upstream_proxy_bypass, args.upstream_proxy_credential
        )
    except ValueError as e:
        raise InvalidInput(str(e)) from e
    # Already checked by ResolveMap.parse.
    resolved = frozenset(parse_authority(spec.partition("=")[0])[0] for spec in args.resolve)
    return dataclasses.replace(proxy, resolved=resolved)


def parse_listen(text: str, flag: str) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    digits = port_text.isascii() and port_text.isdigit()
    if not sep or not host or not digits:
        raise InvalidInput(f"invalid {flag} {text!r}: use HOST:PORT")
    if not 0 <= int(port_text) < 65536:
        raise InvalidInput(
            f"invalid {flag} {text!r}: port {port_text} is out of range (0 to 65535)"
        )
    return host, int(port_text)


def check_listen(host: str, port: int) -> None:
    """One line and status 2 for an address mitmproxy could not listen on, not its exit 1.

    Every address the host stands for is tried, as mitmproxy listens on each of them.
    """
    where = f"--listen {host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise InvalidInput(f"cannot listen on {where}: {e.strerror}") from e
    for family, kind, proto, _, address in dict.fromkeys(infos):
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                shown = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
                raise InvalidInput(
                    f"cannot listen on {where}: {shown}:{port} is already in use"
                ) from e
            raise InvalidInput(f"cannot listen on {where}: {e.strerror}") from e
