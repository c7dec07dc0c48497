"""What every command's parser shares: the parser class, the global options, --version, and
the flags more than one command takes."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from addon.cli import report
from addon.core.argtypes import count
from store.rules import validation
from store.settings import DEFAULT_CERTS, DEFAULT_DB, DEFAULT_KEY_FILE, Settings

# What a command's parser sets as `func`: it returns the exit status.
Handler = Callable[[argparse.Namespace, Settings], int]

identifier = count(1)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise report.UsageError(message, self.prog)


def global_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """The options every command takes, before or after its name.

    The top level gives the defaults; a subcommand's SUPPRESS keeps a value given before it.
    """
    group = parser.add_argument_group("global options (before or after the command)")
    group.add_argument(
        "--db",
        metavar="URL",
        default=default,
        help=f"database URL: sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DB "
        f"[CREDPROXY_DB, default {DEFAULT_DB}]",
    )
    group.add_argument(
        "--key-file",
        metavar="FILE",
        default=default,
        help=f"master key file [CREDPROXY_KEY_FILE, default {DEFAULT_KEY_FILE}]",
    )
    group.add_argument(
        "--certs",
        metavar="DIR",
        default=default,
        help=f"CA directory [CREDPROXY_CERTS, default {DEFAULT_CERTS}]",
    )
    group.add_argument(
        "--json",
        action="store_true",
        default=False if default is None else default,
        help="machine-readable output (`run` writes JSON lines either way)",
    )


def common() -> Parser:
    """The parent of every command's parser: the global options, after the command."""
    parser = Parser(add_help=False)
    global_options(parser, argparse.SUPPRESS)
    return parser


def group(sub: Any, name: str, help: str, dest: str = "action") -> Any:
    """A command of several actions (`principal add`, `principal list`...): their subparsers."""
    return sub.add_parser(name, help=help).add_subparsers(
        dest=dest, required=True, parser_class=Parser, metavar="ACTION", help="one of:"
    )


class Version(argparse.Action):
    """--version, its text looked up only when asked for (importlib.metadata is slow)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        print(version())
        parser.exit()


def version() -> str:
    # Imported on --version only: importlib.metadata costs every other command's start-up.
    import platform
    from importlib import metadata

    try:
        return (
            f"credproxy {metadata.version('credproxy')} (mitmproxy "
            f"{metadata.version('mitmproxy')}, Python {platform.python_version()})"
        )
    except metadata.PackageNotFoundError:
        return "credproxy (not installed: no version)"


def rate_flags(parser: argparse.ArgumentParser, scope: str) -> None:
    parser.add_argument("--rate", metavar="N/UNIT", help=f"N/s, N/m, N/h or N/d, {scope}")
    parser.add_argument(
        "--burst",
        type=count(1, validation.MAX_BURST),
        metavar="N",
        help="requests allowed at once, with --rate (default: the rate's N)",
    )
