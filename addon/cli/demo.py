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
import functools
import signal
import tempfile
from pathlib import Path
from typing import Any

from addon.cli.demokeep import Keep
from addon.cli.demostage import Main, interrupt
from addon.cli.demotour import Tour
from store.errors import InvalidInput
from store.settings import Settings

KEEP_LISTEN = "127.0.0.1:8080"  # make run's: the walkthrough's addresses hold for either


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

    # Ctrl-C and SIGTERM alike stop the demo as interrupted, but never while it starts a child.
    previous = signal.signal(signal.SIGTERM, interrupt)
    previous_int = signal.signal(signal.SIGINT, interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="credproxy-demo-") as tmp:
            if args.keep:
                Keep(Path(tmp), main).keep(args.listen or KEEP_LISTEN)
            else:
                Tour(Path(tmp), main).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    return 0
