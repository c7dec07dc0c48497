"""The operator's CLI: `credproxy init | principal | credential | grant | request | key | run`."""

from __future__ import annotations

import argparse
import gc
import getpass
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from addon.cli import bodyflags, report
from addon.core.argtypes import count
from store.crypto import KEY_ENV, MasterKey, Secret, write_key_file
from store.db import lite
from store.errors import CredproxyError, InvalidInput, MasterKeyError, StoreUnavailable
from store.records import (
    ACCESS,
    APPROVED,
    DENIED,
    REQUEST_STATES,
    AccessRequestEntry,
    CredentialEntry,
    GrantEntry,
)
from store.rules import aws, validation
from store.rules.grammar import check_registered_method, parse_expiry, validate_name
from store.rules.mintspec import GITHUB_API, MINTED
from store.rules.validation import SCHEMES
from store.settings import DEFAULT_CERTS, DEFAULT_DB, DEFAULT_KEY_FILE, Settings

MAX_SECRET = 64 * 1024
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
    "region": "--region",
    "service": "--service",
    "placeholder": "--placeholder",
    "position": "--position",
    "assume_role": "--assume-role",
    "external_id": "--external-id",
    "session_policy": "--session-policy",
    "placeholder_env": "--placeholder-env",
    "token_url": "--token-url",
    "scope": "--scope",
    "audience": "--audience",
    "client_auth": "--client-auth",
    "token_prefix": "--token-prefix",
    "subject": "--subject",
    "installation": "--installation",
    "repository": "--repository",
    "permission": "--permission",
    "api_url": "--api-url",
    "token_uri": "key file's token_uri",
}

Handler = Callable[[argparse.Namespace, Settings], int]


identifier = count(1)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise report.UsageError(message, self.prog)


def _global_options(parser: argparse.ArgumentParser, default: Any) -> None:
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


def _common() -> _Parser:
    common = _Parser(add_help=False)
    _global_options(common, argparse.SUPPRESS)
    return common


class _Version(argparse.Action):
    """--version, its text looked up only when asked for (importlib.metadata is slow)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        print(_version())
        parser.exit()


def _version() -> str:
    import platform
    from importlib import metadata

    try:
        return (
            f"credproxy {metadata.version('credproxy')} (mitmproxy "
            f"{metadata.version('mitmproxy')}, Python {platform.python_version()})"
        )
    except metadata.PackageNotFoundError:
        return "credproxy (not installed: no version)"


def _rate_flags(parser: argparse.ArgumentParser, scope: str) -> None:
    parser.add_argument("--rate", metavar="N/UNIT", help=f"N/s, N/m, N/h or N/d, {scope}")
    parser.add_argument(
        "--burst",
        type=count(1, validation.MAX_BURST),
        metavar="N",
        help="requests allowed at once, with --rate (default: the rate's N)",
    )


# Options before the command that take a value, so that the value is not read as the command.
_VALUED = ("--db", "--key-file", "--certs")
# The commands this module defines; the others come from modules heavy to import (mitmproxy,
# cryptography's x509, the policy-file reader), which a command of this module never loads.
_OWN = frozenset({"init", "principal", "credential", "grant", "request", "key"})


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
    """The whole parser; with `argv` naming one of _OWN, only the commands of this module."""
    common = _common()
    parser = _Parser(
        prog="credproxy",
        description="credproxy: an egress proxy that stamps granted credentials onto the "
        "requests of AI-agent sandboxes. Start with `credproxy init`, then `credproxy run`; "
        "`credproxy demo` shows it all on this machine.",
        epilog="`credproxy COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action=_Version)
    _global_options(parser, None)
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=_Parser,
        metavar="COMMAND",
        title="commands",
        help="one of:",
    )

    p = sub.add_parser("init", parents=[common], help="create or upgrade the store, key and CA")
    p.set_defaults(func=cmd_init)

    principal = sub.add_parser(
        "principal", help="sandboxes and agents (who connects)"
    ).add_subparsers(
        dest="action", required=True, parser_class=_Parser, metavar="ACTION", help="one of:"
    )
    p = principal.add_parser("add", parents=[common], help="create; prints the token once")
    p.add_argument("name", help="[a-z0-9][a-z0-9._-]{0,62}")
    _rate_flags(p, "over all of this principal's requests")
    p.set_defaults(func=cmd_principal_add)
    p = principal.add_parser("update", parents=[common], help="change its rate limit")
    p.add_argument("name", help="the principal")
    _rate_flags(p, "over all of this principal's requests")
    p.add_argument("--no-rate", action="store_true", help="remove its rate limit")
    p.set_defaults(func=cmd_principal_update)
    p = principal.add_parser("list", parents=[common], help="live principals")
    p.set_defaults(func=cmd_principal_list)
    p = principal.add_parser("remove", parents=[common], help="disable and revoke its grants")
    p.add_argument("name", help="the principal")
    p.set_defaults(func=cmd_principal_remove)
    token = principal.add_parser("token", help="further tokens: sessions").add_subparsers(
        dest="token_action", required=True, parser_class=_Parser, metavar="ACTION", help="one of:"
    )
    p = token.add_parser("add", parents=[common], help="prints the token once")
    p.add_argument("name", help="the principal")
    p.add_argument("--expires", help="30s, 10m, 2h, 7d or an ISO-8601 time (default: never)")
    p.add_argument("--note", help="what the token is for")
    p.set_defaults(func=cmd_token_add)
    p = token.add_parser("list", parents=[common], help="in every state; never the tokens")
    p.add_argument("name", nargs="?", help="only this principal's")
    p.set_defaults(func=cmd_token_list)
    p = token.add_parser("revoke", parents=[common], help="by id")
    p.add_argument("id", type=identifier, help="the token's id (principal token list)")
    p.set_defaults(func=cmd_token_revoke)

    credential = sub.add_parser(
        "credential", help="secrets and the hosts they may go to"
    ).add_subparsers(
        dest="action", required=True, parser_class=_Parser, metavar="ACTION", help="one of:"
    )
    p = credential.add_parser("add", parents=[common], help="the secret is read from stdin")
    p.add_argument("name", help="[a-z0-9][a-z0-9._-]{0,62}")
    p.add_argument("--scheme", required=True, choices=SCHEMES, help="how the secret is stamped")
    p.add_argument(
        "--host", action="append", required=True, help="HOST[:PORT] it may be sent to, repeatable"
    )
    p.add_argument("--header", help="header name, with --scheme header or a minted-token scheme")
    p.add_argument("--param", help="query parameter name, with --scheme query")
    p.add_argument("--region", help="AWS region, with --scheme sigv4 (default: from the host)")
    p.add_argument(
        "--service", help="AWS signing name, with --scheme sigv4 (default: from the host)"
    )
    p.add_argument("--assume-role", metavar="ARN", help="sign as this role (STS), with sigv4")
    p.add_argument("--external-id", help="with --assume-role")
    p.add_argument("--session-policy", metavar="FILE", help="JSON policy, with --assume-role")
    p.add_argument("--placeholder", help="what the agent sends in its place, with --scheme path")
    p.add_argument(
        "--position",
        action="append",
        default=[],
        help="path prefix where the placeholder goes, e.g. /bot{}, with --scheme path",
    )
    p.add_argument("--placeholder-env", help="a variable `credproxy exec` sets to a placeholder")
    _mint_flags(p)
    p.set_defaults(func=cmd_credential_add, reads_secret=True)
    p = credential.add_parser("list", parents=[common], help="credentials (never secrets)")
    p.set_defaults(func=cmd_credential_list)
    p = credential.add_parser("remove", parents=[common], help="destroy; revokes its grants")
    p.add_argument("name", help="the credential")
    p.set_defaults(func=cmd_credential_remove)
    p = credential.add_parser("rotate", parents=[common], help="new secret from stdin")
    p.add_argument("name", help="the credential")
    p.set_defaults(func=cmd_credential_rotate, reads_secret=True)

    grant = sub.add_parser("grant", help="who may send what, where").add_subparsers(
        dest="action", required=True, parser_class=_Parser, metavar="ACTION", help="one of:"
    )
    p = grant.add_parser("add", parents=[common], help="let a principal send some requests")
    p.add_argument("principal", help="the principal")
    p.add_argument("--credential", help="stamp this credential (default: pass-through)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="HOST[:PORT], repeatable (default: the credential's hosts)",
    )
    p.add_argument("--method", action="append", required=True, help="GET, POST, ... or '*'")
    p.add_argument(
        "--extension-method",
        action="store_true",
        help="allow --method names outside IANA's HTTP method registry",
    )
    p.add_argument("--path", action="append", default=[], help="path pattern (default /)")
    p.add_argument("--once", action="store_true", help="usable by exactly one request")
    p.add_argument("--websocket", action="store_true", help="allow Upgrade requests")
    p.add_argument(
        "--encoded-slash",
        action="store_true",
        help="let a '*' path segment match one holding %%2F too (npm's @scope%%2Fname)",
    )
    p.add_argument("--expires", help="30s, 10m, 2h, 7d or an ISO-8601 time")
    p.add_argument("--purpose", help="a note for operators, shown by grant list")
    _rate_flags(p, "for requests this grant lets through, per proxy replica")
    p.add_argument(
        "--max-uses",
        type=count(1, validation.MAX_BURST),
        metavar="N",
        help="usable by exactly N requests across replicas (--once is --max-uses 1)",
    )
    p.add_argument(
        "--approval",
        choices=validation.APPROVALS,
        help="hold each request, or the first of each kind, until an owner approves it",
    )
    p.add_argument(
        "--hold",
        metavar="DURATION",
        help=f"how long a request waits for approval: 90s, 2m (default "
        f"{validation.DEFAULT_HOLD}s, at most {validation.MAX_HOLD}s)",
    )
    bodyflags.add_flags(p)
    p.set_defaults(func=cmd_grant_add)
    p = grant.add_parser("list", parents=[common], help="grants in every state")
    p.add_argument("--principal", help="only this principal's")
    p.set_defaults(func=cmd_grant_list)
    p = grant.add_parser("revoke", parents=[common], help="revoke one grant")
    p.add_argument("id", type=identifier, help="the grant's id")
    p.set_defaults(func=cmd_grant_revoke)

    request = sub.add_parser("request", help="access requests from agents").add_subparsers(
        dest="action", required=True, parser_class=_Parser, metavar="ACTION", help="one of:"
    )
    p = request.add_parser("list", parents=[common], help="access requests, by id")
    p.add_argument("--state", choices=REQUEST_STATES, help="only those in this state")
    p.set_defaults(func=cmd_request_list)
    p = request.add_parser(
        "approve", parents=[common], help="turn it into a grant, or let a held request go on"
    )
    p.add_argument("id", type=identifier, help="the request's id")
    p.add_argument("--credential", help="stamp this credential (its hosts must cover the host)")
    p.add_argument("--path", help="path pattern, instead of the requested path")
    lifetime = p.add_mutually_exclusive_group()
    lifetime.add_argument("--once", action="store_true", help="usable by exactly one request")
    lifetime.add_argument("--expires", help="30s, 10m, 2h, 7d or an ISO-8601 time")
    cover = p.add_mutually_exclusive_group()
    cover.add_argument(
        "--next",
        type=count(1, validation.MAX_BURST),
        metavar="N",
        help="a held request of an approval-first grant: approve the next N of its kind too",
    )
    cover.add_argument(
        "--for",
        dest="cover_for",
        metavar="DURATION",
        help="a held request of an approval-first grant: approve its kind for 30s, 10m, 2h, 7d",
    )
    p.set_defaults(func=cmd_request_approve)
    p = request.add_parser("deny", parents=[common], help="refuse it")
    p.add_argument("id", type=identifier, help="the request's id")
    p.add_argument("--reason", help="a note the agent can read")
    p.set_defaults(func=cmd_request_deny)

    key = sub.add_parser("key", help="the master key").add_subparsers(
        dest="action", required=True, parser_class=_Parser, metavar="ACTION", help="one of:"
    )
    p = key.add_parser("rotate", parents=[common], help="re-seal every secret under a new key")
    p.set_defaults(func=cmd_key_rotate)
    if argv is not None and _command(argv) in _OWN:
        return parser
    from addon.cli import demo, policycmd
    from addon.launcher import launch
    from addon.runtime import runner

    policycmd.add_commands(sub, common)
    launch.add_commands(sub, common)
    runner.add_command(sub, common)  # mitmproxy is imported only when `run` runs
    demo.add_command(sub, main)
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
        from store.db.engine import sqlite_path  # loaded already: Settings parsed the URL

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


# -- output --------------------------------------------------------------------------


def _emit(settings: Settings, data: Any, lines: Sequence[str]) -> None:
    if settings.json:
        print(json.dumps(data, default=str))
    else:
        for line in lines:
            print(line)


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> list[str]:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, list):
            return ",".join(str(x) for x in v)
        return str(v)

    cells = [[cell(row[c]) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*columns).rstrip()] + [fmt.format(*r).rstrip() for r in cells]


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def read_secret() -> Secret:
    """The secret from stdin, one trailing newline stripped; a prompt without echo on a tty."""
    if sys.stdin.isatty():
        raw = getpass.getpass("secret (not echoed): ").encode()
    else:
        raw = sys.stdin.buffer.read(MAX_SECRET + 3)  # room for the newline that is stripped
        if raw.endswith(b"\r\n"):
            raw = raw[:-2]
        elif raw.endswith(b"\n"):
            raw = raw[:-1]
        if len(raw) > MAX_SECRET:
            raise InvalidInput("the secret is longer than 64 KiB")
    if not raw:
        raise InvalidInput("the secret is empty (it is read from standard input)")
    return Secret(raw)


# -- commands ------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace, settings: Settings) -> int:
    from store.repository import Store

    store = Store(settings.db, None, create=True)
    store.migrate()
    revision = store.schema_revision()
    created_key = False
    if os.environ.get(KEY_ENV) or settings.key_file.exists():
        key = settings.key()
    else:
        if store.stored_key_id() is not None:
            raise MasterKeyError(
                f"{store.display_url} already has a master key; "
                f"its key file {settings.key_file} is missing"
            )
        key = MasterKey.generate(f"key file {settings.key_file}")
        write_key_file(settings.key_file, key)
        created_key = True
    store.key = key
    store.check_key(adopt=True)
    from store.ca import PUBLIC_CERT, ensure_ca

    created_ca = ensure_ca(settings.certs)
    store.restrict_file()
    store.close()
    ca = settings.certs / PUBLIC_CERT
    _emit(
        settings,
        {
            "db": store.display_url,
            "schema": revision,
            "key_id": key.key_id,
            "key_source": key.source,
            "key_created": created_key,
            "ca": str(ca),
            "ca_created": created_ca,
        },
        [
            f"database  {store.display_url} (schema {revision})",
            f"key       {key.source}, id {key.key_id}{' (created)' if created_key else ''}",
            f"ca        {ca}{' (created)' if created_ca else ''}",
        ],
    )
    return 0


def cmd_principal_add(args: argparse.Namespace, settings: Settings) -> int:
    limits = validation.limits(args.rate, args.burst)
    token = settings.quick().add_principal(args.name, limits)
    url = f"http://{args.name}:{token}@{settings.advertise}"
    _emit(
        settings,
        {"name": args.name, "token": token, "proxy_url": url},
        [
            f"principal  {args.name}",
            f"token      {token}",
            f"proxy_url  {url}",
            "The token is shown once; it is stored only as a hash.",
        ],
    )
    return 0


def cmd_principal_update(args: argparse.Namespace, settings: Settings) -> int:
    if args.no_rate == (args.rate is not None):
        raise InvalidInput("give --rate N/UNIT [--burst N] or --no-rate")
    limits = validation.limits(args.rate, args.burst)
    settings.store().set_principal_limits(args.name, limits)
    _emit(
        settings,
        {"name": args.name, "rate": args.rate},
        [f"principal {args.name}: rate {args.rate or 'none'}"],
    )
    return 0


def cmd_principal_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = [
        {
            "name": p.name,
            "created_at": p.created_at.isoformat(timespec="seconds"),
            "rate": p.rate,
            "burst": p.burst,
        }
        for p in settings.reader().list_principals()
    ]
    _emit(settings, rows, _table(rows, ["name", "created_at", "rate", "burst"]))
    return 0


def cmd_principal_remove(args: argparse.Namespace, settings: Settings) -> int:
    revoked = settings.store().remove_principal(args.name)
    _emit(
        settings,
        {"name": args.name, "revoked_grants": revoked},
        [f"removed principal {args.name}; revoked {revoked} grant(s)"],
    )
    return 0


def cmd_token_add(args: argparse.Namespace, settings: Settings) -> int:
    expires = parse_expiry(args.expires) if args.expires else None
    token_id, token = settings.store().add_token(args.name, expires, args.note)
    url = f"http://{args.name}:{token}@{settings.advertise}"
    _emit(
        settings,
        {
            "id": token_id,
            "name": args.name,
            "token": token,
            "proxy_url": url,
            "expires_at": expires.isoformat() if expires else None,
        },
        [
            f"principal  {args.name}",
            f"id         {token_id}",
            f"token      {token}",
            f"proxy_url  {url}",
            "The token is shown once; it is stored only as a hash.",
        ],
    )
    return 0


def cmd_token_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = [
        {
            "id": t.id,
            "principal": t.principal,
            "note": t.note,
            "created_at": t.created_at.isoformat(timespec="seconds"),
            "expires_at": t.expires_at.isoformat() if t.expires_at else None,
            "revoked_at": t.revoked_at.isoformat() if t.revoked_at else None,
            "state": t.state,
        }
        for t in settings.store().list_tokens(args.name)
    ]
    columns = ["id", "principal", "created_at", "expires_at", "state", "note"]
    _emit(settings, rows, _table(rows, columns))
    return 0


def cmd_token_revoke(args: argparse.Namespace, settings: Settings) -> int:
    settings.store().revoke_token(args.id)
    _emit(settings, {"id": args.id, "state": "revoked"}, [f"revoked token {args.id}"])
    return 0


def cmd_credential_add(args: argparse.Namespace, settings: Settings) -> int:
    # Arguments before input: a wrong --host is the error to show, not the empty secret after it.
    validate_name("credential", args.name)
    validation.credential_hosts(args.host)
    store = settings.store()
    secret = read_secret()
    options = {
        "region": args.region,
        "service": args.service,
        "assume_role": args.assume_role,
        "external_id": args.external_id,
        "session_policy": _policy_file(args.session_policy),
        "placeholder": args.placeholder,
        "position": args.position,
        "placeholder_env": args.placeholder_env,
        **{name: getattr(args, name) for name in MINT_OPTIONS},
    }
    fp = store.add_credential(
        args.name, args.scheme, args.host, secret, args.header, args.param, options
    )
    _emit(
        settings,
        {"name": args.name, "scheme": args.scheme, "fingerprint": fp},
        [f"added credential {args.name} ({args.scheme}, {fp})"],
    )
    return 0


MINT_OPTIONS = (
    "token_url",
    "scope",
    "audience",
    "client_auth",
    "token_prefix",
    "subject",
    "installation",
    "repository",
    "permission",
    "api_url",
)


def _mint_flags(p: argparse.ArgumentParser) -> None:
    """The minted-token schemes' flags (oauth2-client, oauth2-refresh, google-service-account,
    github-app)."""
    p.add_argument("--token-url", metavar="URL", help="https token endpoint, with oauth2-*")
    p.add_argument(
        "--scope",
        action="append",
        default=[],
        help="a scope to ask for, repeatable, with oauth2-* and google-service-account",
    )
    p.add_argument("--audience", help="the audience parameter, with oauth2-client")
    p.add_argument(
        "--client-auth",
        choices=("basic", "post", "none"),
        help="how the client authenticates, with oauth2-* (default: basic; none without a "
        "client_secret)",
    )
    p.add_argument(
        "--token-prefix",
        metavar="TEXT",
        help="what goes before the token in the header (default: 'Bearer ')",
    )
    p.add_argument(
        "--subject", metavar="EMAIL", help="the user to act as, with google-service-account"
    )
    p.add_argument("--installation", metavar="ID", help="installation id, with github-app")
    p.add_argument(
        "--repository",
        action="append",
        default=[],
        metavar="NAME",
        help="narrow the token to this repository, repeatable, with github-app",
    )
    p.add_argument(
        "--permission",
        action="append",
        default=[],
        metavar="NAME=read|write",
        help="narrow the token to this permission, repeatable, with github-app",
    )
    p.add_argument(
        "--api-url",
        metavar="URL",
        help="GitHub API base, with github-app (default https://api.github.com)",
    )


def _credential_row(c: CredentialEntry) -> dict[str, Any]:
    return {
        "name": c.name,
        "scheme": c.scheme,
        "header": c.header_name,
        "param": c.param_name,
        "hosts": c.hosts,
        **_scheme_columns(c),
        "fingerprint": c.fingerprint,
        "created_at": c.created_at.isoformat(timespec="seconds"),
        "rotated_at": c.rotated_at.isoformat(timespec="seconds") if c.rotated_at else None,
        "placeholder_env": c.options.get("placeholder_env"),
    }


def _policy_file(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(64 * 1024)
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"cannot read --session-policy {path!r}") from e


def _scheme_columns(c: CredentialEntry) -> dict[str, Any]:
    """A sigv4 credential's region, service and masked key id; a path one's placeholder."""
    if c.scheme == "sigv4":
        service, region = c.options.get("service"), c.options.get("region")
        scopes = [aws.scope_of(aws.representative(h), service, region) for h in c.hosts]
        return {
            "region": ",".join(sorted({s.region for s in scopes if s})) or None,
            "service": ",".join(sorted({s.service for s in scopes if s})) or None,
            "access_key_id": c.options.get("access_key_id"),
            "assume_role": c.options.get("assume_role"),
        }
    if c.scheme == "path":
        return {
            "placeholder": c.options.get("placeholder"),
            "positions": c.options.get("positions"),
        }
    if c.scheme in MINTED:
        return {"token_url": _token_endpoint(c), "scope": c.options.get("scope")}
    return {}


def _token_endpoint(c: CredentialEntry) -> str | None:
    """Where a minted credential's tokens come from."""
    if c.scheme == "github-app":
        api = c.options.get("api_url", GITHUB_API)
        return f"{api}/app/installations/{c.options.get('installation')}/access_tokens"
    found: str | None = c.options.get("token_url") or c.options.get("token_uri")
    return found


def cmd_credential_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = [_credential_row(c) for c in settings.reader().list_credentials()]
    columns = ["name", "scheme", "header", "param", "hosts"]
    extras = ("region", "service", "access_key_id", "assume_role", "placeholder", "positions")
    for extra in (*extras, "token_url", "scope"):
        if any(extra in row for row in rows):
            columns.append(extra)
    columns += ["fingerprint", "rotated_at"]
    _emit(settings, rows, _table([{c: row.get(c) for c in columns} for row in rows], columns))
    return 0


def cmd_credential_remove(args: argparse.Namespace, settings: Settings) -> int:
    revoked = settings.store().remove_credential(args.name)
    _emit(
        settings,
        {"name": args.name, "revoked_grants": revoked},
        [f"removed credential {args.name}; revoked {revoked} grant(s)"],
    )
    return 0


def cmd_credential_rotate(args: argparse.Namespace, settings: Settings) -> int:
    store = settings.store()
    fp = store.rotate_credential(args.name, read_secret())
    _emit(settings, {"name": args.name, "fingerprint": fp}, [f"rotated {args.name} ({fp})"])
    return 0


def cmd_grant_add(args: argparse.Namespace, settings: Settings) -> int:
    if not args.extension_method:
        for method in args.method:
            check_registered_method(method)
    expires = parse_expiry(args.expires) if args.expires else None
    limits = validation.limits(
        args.rate, args.burst, args.max_uses, args.once, args.approval, args.hold
    )
    body = bodyflags.rule_from(args)
    grant_id = settings.quick().add_grant(
        args.principal,
        args.method,
        credential=args.credential,
        hosts=args.host,
        paths=args.path,
        once=args.once,
        websocket=args.websocket,
        expires_at=expires,
        purpose=args.purpose,
        encoded_slash=args.encoded_slash,
        limits=limits,
        body=body,
    )
    _emit(
        settings,
        {
            "id": grant_id,
            "principal": args.principal,
            "credential": args.credential,
            "expires_at": expires.isoformat() if expires else None,
        },
        [f"added grant {grant_id} for {args.principal}"],
    )
    return 0


def _grant_row(g: GrantEntry) -> dict[str, Any]:
    return {
        "id": g.id,
        "principal": g.principal,
        "credential": g.credential,
        "hosts": g.hosts,
        "methods": g.methods,
        "paths": g.paths,
        "once": g.once,
        "websocket": g.websocket,
        "encoded_slash": g.encoded_slash,
        "expires_at": g.expires_at.isoformat() if g.expires_at else None,
        "purpose": g.purpose,
        "created_at": g.created_at.isoformat(),
        "state": g.state,
        "key": g.key,
        "rate": g.rate,
        "burst": g.burst,
        "max_uses": g.max_uses,
        "uses": g.uses,
        "approval": g.approval,
        "hold": g.hold,
        "body": g.body,
    }


def cmd_grant_list(args: argparse.Namespace, settings: Settings) -> int:
    store = settings.quick(key=False)
    grants = store.list_grants(args.principal)
    rows = [_grant_row(g) for g in grants]
    if settings.json:  # scripts read it by the thousand: no table to build
        _emit(settings, rows, [])
        return 0
    # The table says what a grant reaches: a grant without hosts of its own has its
    # credential's. --json keeps null there, as stored.
    their_hosts = store.credential_hosts()
    shown = [
        row
        | {
            "hosts": g.hosts or their_hosts.get(g.credential or ""),
            "once": _yes(g.once),
            "encoded_slash": _yes(g.encoded_slash),
        }
        for row, g in zip(rows, grants, strict=True)
    ]
    columns = ["id", "principal", "credential", "hosts", "methods", "paths", "once", "expires_at"]
    if any(g.body for g in grants):  # the column only where some grant decides bodies
        columns.insert(columns.index("paths") + 1, "body")
    _emit(settings, rows, _table(shown, columns + ["encoded_slash", "state", "purpose"]))
    return 0


def cmd_grant_revoke(args: argparse.Namespace, settings: Settings) -> int:
    if settings.store().revoke_grant(args.id):
        _emit(settings, {"id": args.id, "state": "revoked"}, [f"revoked grant {args.id}"])
    else:
        said = f"grant {args.id} was already revoked"
        _emit(settings, {"id": args.id, "state": "revoked", "already_revoked": True}, [said])
    return 0


def _request_row(r: AccessRequestEntry) -> dict[str, Any]:
    return {
        "id": r.id,
        "principal": r.principal,
        "host": r.host,
        "port": r.port,
        "method": r.method,
        "path": r.path,
        "purpose": r.purpose,
        "source": r.source,
        "state": r.state,
        "count": r.count,
        "first_seen": r.first_seen.isoformat(),
        "last_seen": r.last_seen.isoformat(),
        "decided_at": r.decided_at.isoformat() if r.decided_at else None,
        "decision_reason": r.decision_reason,
        "grant_id": r.grant_id,
        "kind": r.kind,
        "hold_until": r.hold_until.isoformat() if r.hold_until else None,
        "cover_until": r.cover_until.isoformat() if r.cover_until else None,
        "cover_uses": r.cover_uses,
        "covered": r.covered,
    }


def cmd_request_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = [_request_row(r) for r in settings.reader().list_access_requests(args.state)]
    columns = ["id", "principal", "method", "host", "port", "path", "source", "state", "count"]
    _emit(settings, rows, _table(rows, columns + ["last_seen", "grant_id", "kind", "purpose"]))
    return 0


def cmd_request_approve(args: argparse.Namespace, settings: Settings) -> int:
    expires = parse_expiry(args.expires) if args.expires else None
    until = None
    if args.cover_for:
        try:
            until = parse_expiry(args.cover_for)
        except InvalidInput as e:
            raise InvalidInput(f"invalid --for {args.cover_for!r}: use 30s, 10m, 2h or 7d") from e
    kind, grant_id = settings.store().approve_request(
        args.id,
        credential=args.credential,
        path=args.path,
        once=args.once,
        expires_at=expires,
        next_uses=args.next,
        cover_until=until,
    )
    said = f"added grant {grant_id}" if kind == ACCESS else f"it goes on under grant {grant_id}"
    _emit(
        settings,
        {"id": args.id, "grant_id": grant_id, "state": APPROVED, "kind": kind},
        [f"approved request {args.id}; {said}"],
    )
    return 0


def cmd_request_deny(args: argparse.Namespace, settings: Settings) -> int:
    settings.store().deny_access_request(args.id, args.reason)
    _emit(settings, {"id": args.id, "state": DENIED}, [f"denied request {args.id}"])
    return 0


def cmd_key_rotate(args: argparse.Namespace, settings: Settings) -> int:
    if os.environ.get(KEY_ENV):
        raise MasterKeyError(
            f"the key comes from {KEY_ENV}: unset it to rotate into --key-file, "
            "then set it from the new file"
        )
    store = settings.store()
    new = MasterKey.generate(f"key file {settings.key_file}")
    pending = settings.key_file.with_name(settings.key_file.name + ".new")
    # Write the new key before the secrets are re-sealed under it, so a crash never leaves
    # secrets sealed under a key that exists nowhere.
    pending.unlink(missing_ok=True)
    write_key_file(pending, new)
    try:
        resealed = store.rotate_key(new)
    except BaseException:
        pending.unlink(missing_ok=True)
        raise
    os.replace(pending, settings.key_file)
    _emit(
        settings,
        {"key_id": new.key_id, "resealed": resealed},
        [f"rotated the master key to id {new.key_id}; re-sealed {resealed} secret(s)"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
