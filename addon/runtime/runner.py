"""`credproxy run`: its flags, and the choice between one process and a supervisor of workers.

addon/runtime/serve.py is the process itself: mitmproxy's Master embedded, with our addons.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from addon.core.argtypes import count, seconds
from addon.observe import otlp
from addon.proxy.dns import DEFAULT_TTL
from addon.proxy.limits import add_limit_flags
from addon.runtime import workers
from addon.runtime.config import RunConfig
from addon.runtime.workerrole import Role
from store.settings import Settings

MAX_SIGNED_BODY = 1024 * 1024 * 1024


def register(sub: Any, common: argparse.ArgumentParser) -> None:
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
        "--console",
        metavar="HOST:PORT",
        help="serve the approvers' console here (default: off); never through the proxy; "
        "operators sign in with tokens from `credproxy console token add` "
        "(or --console-token-file)",
    )
    p.add_argument(
        "--console-token-file",
        metavar="FILE",
        help="further console operators, NAME:TOKEN lines; - reads them from stdin",
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
        "--prices",
        metavar="FILE",
        help="the price table (TOML, US dollars per million tokens per model) that grants' "
        "spend limits are charged by; see docs/budgets.md",
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
    p.add_argument(
        "--upstream-proxy",
        metavar="URL",
        default=os.environ.get("CREDPROXY_UPSTREAM_PROXY"),
        help="reach upstreams through this corporate proxy, http://HOST:PORT, with a CONNECT "
        "by name and TLS end to end (default: $CREDPROXY_UPSTREAM_PROXY)",
    )
    p.add_argument(
        "--upstream-proxy-bypass",
        action="append",
        default=[],
        metavar="HOSTS",
        help="dial these directly: host names (and the names under them), addresses, CIDRs "
        "or *, comma-separated as in NO_PROXY (repeatable)",
    )
    p.add_argument(
        "--upstream-proxy-credential",
        metavar="NAME",
        help="send the corporate proxy this stored basic credential (bound to its HOST:PORT)",
    )
    p.add_argument(
        "--audit-format",
        choices=("json", "ocsf"),
        default="json",
        help="request lines as credproxy's JSON (default) or OCSF 1.5.0 HTTP Activity events",
    )
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="also export every audit line as an OTLP log record to URL/v1/logs (HTTP, "
        "protobuf; the otel extra); OTEL_EXPORTER_OTLP_HEADERS and the like apply "
        "(default: $OTEL_EXPORTER_OTLP_LOGS_ENDPOINT as it is, else "
        "$OTEL_EXPORTER_OTLP_ENDPOINT/v1/logs, else off)",
    )
    p.add_argument(
        "--otlp-queue",
        type=count(1, 1_000_000),
        default=otlp.QUEUE,
        metavar="N",
        help="records waiting for the collector beyond which they are dropped and counted "
        "(default %(default)s)",
    )
    _secret_flags(p)
    add_limit_flags(p)
    p.set_defaults(func=cmd_run)


def _secret_flags(p: argparse.ArgumentParser) -> None:
    """Credentials whose secret is held elsewhere (docs/secret-sources.md)."""
    p.add_argument(
        "--secret-ttl",
        type=seconds(),
        default=300.0,
        metavar="SECONDS",
        help="fetch a secret held in AWS or Vault again this often (default %(default)g); "
        "a file is looked at every second",
    )
    p.add_argument(
        "--secret-max-stale",
        type=seconds(),
        default=300.0,
        metavar="SECONDS",
        help="stamp a secret's last good value this long once its source fails, then refuse "
        "(default %(default)g)",
    )
    p.add_argument(
        "--require-all-secrets",
        action="store_true",
        help="refuse to start while any credential's secret source cannot be read",
    )


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    config = RunConfig.from_args(args, settings)
    if config.otlp is not None:
        otlp.start(config.otlp)  # each process exports its own lines, workers and supervisor
    if config.workers > 1:
        role = Role.from_env()
        if role is None:
            return workers.supervise(config, sys.argv[1:])
        role.bind_to_supervisor()
        config = dataclasses.replace(
            config, listen_port=role.port, admin=None, workers=1, worker=role
        )
    # Imported here, not at the top: the chain's modules take about a second to import, and
    # `exec` and the policy commands, which build this command's parser too, need none of them.
    from addon.mitm import addonpackage

    addonpackage.defer()  # before mitmproxy's addons are imported: see the module
    from addon.proxy.sources import SourceSettings
    from addon.runtime import serve

    held = SourceSettings(ttl=args.secret_ttl, max_stale=args.secret_max_stale)
    return serve.main(config, held, args.require_all_secrets)
