"""How the CLI reports an error: one line on stderr, plain or, with --json, a JSON object."""

from __future__ import annotations

import json
import re
import sys

from store.errors import CredproxyError

BUG = "bug"
USAGE = "usage"


class UsageError(CredproxyError):
    """argparse's complaint about the command line, in the words of the parser `prog`."""

    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


def code_of(e: CredproxyError) -> str:
    """The error's class in snake case: not_found, invalid_input, master_key, policy_file..."""
    name = type(e).__name__.removesuffix("Error")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def error(message: str, code: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"error": message, "code": code}), file=sys.stderr)
    else:
        print(f"credproxy: error: {message}", file=sys.stderr)


def usage(e: UsageError, as_json: bool) -> None:
    if as_json:
        error(f"{e} (see {e.prog} --help)", USAGE, True)
    else:
        print(f"{e.prog}: error: {e} (see --help)", file=sys.stderr)


def wants_json(argv: list[str]) -> bool:
    """Whether --json is among the options, which are all before any `--`."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in options
