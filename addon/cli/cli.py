"""The operator's CLI, `credproxy`: parse once, call one function, print one line or exit 2.

Each command's module (init.py, principals.py, credentials.py, grants.py, accessrequests.py,
keys.py, usage.py, consoletokens.py, policycmd.py, suggestcmd.py, demo.py; launcher's launch.py and
runtime's runner.py) has one `register(sub, common)` that adds its parsers and sets their
`func`; this module builds the parser from them, runs the one handler, and turns every error
into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
from collections.abc import Sequence

from addon.cli import (
    accessrequests,
    consoletokens,
    credentials,
    grants,
    init,
    keys,
    principals,
    report,
    usage,
)
from addon.cli.parsing import Handler, Parser, Version, common, global_options
from store.db import lite
from store.errors import CredproxyError, InvalidInput, StoreUnavailable
from store.rules.mintspec import OPTION_NAMES
from store.settings import Settings

# The store's messages name their inputs plainly; the operator reads them as these flags.
FLAGS = {
    "host": "--host",
    "method": "--method",
    "extension_method": "--extension-method",
    "credential": "--credential",
    "path": "--path",
    "header": "--header NAME",
    "param": "--param NAME",
    "scheme": "--scheme",
    "expires": "--expires",
    "encoded_slash": "--encoded-slash",
    "rate": "--rate",
    "burst": "--burst",
    "once": "--once",
    "max_uses": "--max-uses",
    "approval": "--approval",
    "hold": "--hold",
    "budget": "--budget",
    "cap_max_tokens": "--cap-max-tokens",
    "region": "--region",
    "service": "--service",
    "placeholder": "--placeholder",
    "position": "--position",
    "assume_role": "--assume-role",
    "external_id": "--external-id",
    "session_policy": "--session-policy",
    "placeholder_env": "--placeholder-env",
    **{name: "--" + name.replace("_", "-") for name in OPTION_NAMES},  # the minted schemes'
    "token_uri": "key file's token_uri",
}

# The commands whose modules are light; the others come from modules heavy to import
# (mitmproxy, cryptography's x509, the policy-file reader), which these commands never load.
LIGHT = (init, principals, credentials, grants, accessrequests, keys, usage, consoletokens)
_OWN = frozenset(module.COMMAND for module in LIGHT)
# Options before the command that take a value, so that the value is not read as the command.
_VALUED = ("--db", "--key-file", "--certs")


def _command(argv: Sequence[str]) -> str | None:
    """The command an argument list names, or None (none yet, or only options)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _VALUED:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `argv` naming a command of LIGHT, only those commands."""
    shared = common()
    parser = Parser(
        prog="credproxy",
        description="credproxy: an egress proxy that stamps granted credentials onto the "
        "requests of AI-agent sandboxes. Start with `credproxy init`, then `credproxy run`; "
        "`credproxy demo` shows it all on this machine.",
        epilog="`credproxy COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action=Version)
    global_options(parser, None)
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=Parser,
        metavar="COMMAND",
        title="commands",
        help="one of:",
    )
    for module in LIGHT:
        module.register(sub, shared)
    if argv is not None and _command(argv) in _OWN:
        return parser
    if argv is not None and _command(argv) == "run":
        from addon.runtime import runner  # not the demo's, the policy file's or exec's modules

        runner.register(sub, shared)
        return parser
    # Imported only for a command of their own, or for --help: see LIGHT.
    from addon.cli import demo, policycmd, suggestcmd
    from addon.launcher import launch
    from addon.runtime import runner

    policycmd.register(sub, shared)
    suggestcmd.register(sub, shared)
    launch.register(sub, shared)
    runner.register(sub, shared)  # mitmproxy is imported only when `run` runs
    demo.register(sub, shared, main=main)
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    as_json = report.wants_json(list(sys.argv[1:] if argv is None else argv))
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            parser.error(_unrecognized(args, extra))
        settings = Settings.resolve(args)
        if args.command not in ("init", "demo"):  # init makes the store, and says so itself
            _store_directory(settings.db)
        handler: Handler = args.func
        status = handler(args, settings)
        sys.stdout.flush()  # a closed pipe shows here, not at exit where it cannot be caught
        return status
    except BrokenPipeError:
        return _reader_gone()
    except report.UsageError as e:
        report.usage(e, as_json)
        return 2
    except CredproxyError as e:
        report.error(worded(e), report.code_of(e), as_json)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a traceback is a bug; its text may hold a secret
        report.error(f"unexpected {type(e).__name__} (a bug)", report.BUG, as_json)
        return 2


def _store_directory(db: str) -> None:
    """An SQLite store in a directory that does not exist: say so, before the key or the
    store itself is found missing."""
    path = lite.sqlite_file(db)
    if path is None and db.startswith("sqlite"):
        # Not at the top, where it would load SQLAlchemy for a plain sqlite:/// URL too; this
        # URL's Settings parsed it with SQLAlchemy already.
        from store.db.engine import sqlite_path

        path = sqlite_path(db)
    if path is not None and not path.parent.is_dir():
        raise StoreUnavailable(f"no store at {path}: the directory {path.parent} does not exist")


def _unrecognized(args: argparse.Namespace, extra: Sequence[str]) -> str:
    """argparse's complaint, except that a command reading a secret never echoes its arguments."""
    if not getattr(args, "reads_secret", False):
        return f"unrecognized arguments: {' '.join(extra)}"
    command = f"{args.command} {args.action}"
    return (
        "unrecognized arguments (not shown: they may hold a secret); "
        f'{command} reads the secret from stdin: printf %s "$SECRET" | credproxy {command} ...'
    )


def _reader_gone() -> int:
    """The reader of stdout has gone (`| head`): stop quietly, as a command killed by SIGPIPE."""
    # Python would flush stdout again at exit and complain: point it at /dev/null first.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE  # what a shell reports for `yes | head -1`


def worded(error: CredproxyError) -> str:
    """The error's message, naming its inputs as this CLI's flags."""
    return error.worded(FLAGS) if isinstance(error, InvalidInput) else str(error)


def main(argv: Sequence[str] | None = None) -> int:
    # Start-up builds only long-lived objects (modules, the compiled policy): cycle collections
    # would walk them again and again for nothing. `run` freezes them and turns the collector
    # back on once it listens.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return run(build_parser(sys.argv[1:] if argv is None else argv), argv)
    finally:
        if collecting:
            gc.enable()


if __name__ == "__main__":
    sys.exit(main())
