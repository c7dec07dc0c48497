"""`credproxy credential`: the secrets, read from stdin, and the hosts they may go to."""

from __future__ import annotations

import argparse
import getpass
import hmac
import sys
from typing import Any

from addon.cli.output import emit, table
from addon.cli.parsing import group
from store.crypto import MasterKey, Secret
from store.errors import CredproxyError, InvalidInput
from store.records import NO_SECRET, CredentialEntry, CredentialRecord
from store.rules import aws, secretref, validation
from store.rules.grammar import validate_name
from store.rules.mintspec import GITHUB_API, MINTED, OPTION_NAMES
from store.rules.validation import SCHEMES
from store.settings import Settings

COMMAND = "credential"
MAX_SECRET = 64 * 1024
MINT_OPTIONS = OPTION_NAMES  # store/rules/mintspec.py names them once


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Its `add` and `rotate` read a secret: `reads_secret` keeps their arguments out of errors."""
    credential = group(sub, COMMAND, "secrets and the hosts they may go to")
    p = credential.add_parser(
        "add", parents=[common], help="the secret is read from stdin, or held at --secret-ref"
    )
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
    _pkcs12_flag(p)
    _ref_flag(p)
    _mint_flags(p)
    p.set_defaults(func=cmd_credential_add, reads_secret=True)
    p = credential.add_parser("list", parents=[common], help="credentials (never secrets)")
    p.set_defaults(func=cmd_credential_list)
    p = credential.add_parser("remove", parents=[common], help="destroy; revokes its grants")
    p.add_argument("name", help="the credential")
    p.set_defaults(func=cmd_credential_remove)
    p = credential.add_parser(
        "rotate", parents=[common], help="new secret from stdin, or held at --secret-ref"
    )
    p.add_argument("name", help="the credential")
    _pkcs12_flag(p)
    _ref_flag(p)
    p.set_defaults(func=cmd_credential_rotate, reads_secret=True)


def _pkcs12_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pkcs12",
        action="store_true",
        help="with --scheme mtls: stdin is the passphrase (or an empty line), a newline, then "
        "a PKCS#12 file",
    )


def _ref_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-ref",
        metavar="REF",
        help="keep no secret: the proxy reads it from file:/PATH, aws-sm:SECRET_ID[#KEY], "
        "aws-ssm:NAME or vault:MOUNT/PATH#FIELD (see docs/secret-sources.md); stdin is not read",
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


def read_pkcs12() -> Secret:
    """The passphrase line and PKCS#12 bytes from stdin (nothing stripped: it is binary), as
    the PEM chain and key."""
    if sys.stdin.isatty():
        raise InvalidInput("--pkcs12 reads the passphrase and the file from stdin, not a terminal")
    raw = sys.stdin.buffer.read(MAX_SECRET + 1)
    if len(raw) > MAX_SECRET:
        raise InvalidInput("the secret is longer than 64 KiB")
    # On first use: clientcert brings cryptography.x509, which the other commands never need.
    from store.rules import clientcert

    return clientcert.from_pkcs12(Secret(raw))


def _secret_of(args: argparse.Namespace, scheme: str) -> Secret:
    if not args.pkcs12:
        return read_secret()
    if scheme != "mtls":
        raise InvalidInput("--pkcs12 goes with --scheme mtls, and only with it")
    return read_pkcs12()


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


def cmd_credential_add(args: argparse.Namespace, settings: Settings) -> int:
    # Arguments before input: a wrong --host is the error to show, not the empty secret after it.
    validate_name("credential", args.name)
    validation.credential_hosts(args.host)
    if args.secret_ref is not None:
        secretref.for_scheme(args.scheme, args.secret_ref)
    if args.pkcs12 and (args.scheme != "mtls" or args.secret_ref is not None):
        raise InvalidInput("--pkcs12 goes with --scheme mtls, and not with --secret-ref")
    store = settings.store()
    secret = _secret_of(args, args.scheme) if args.secret_ref is None else None
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
        args.name, args.scheme, args.host, secret, args.header, args.param, options, args.secret_ref
    )
    if args.secret_ref is not None:
        emit(
            settings,
            {"name": args.name, "scheme": args.scheme, "secret_ref": fp},
            [f"added credential {args.name} ({args.scheme}, its secret held at {fp})"],
        )
        return 0
    row: dict[str, Any] = {"name": args.name, "scheme": args.scheme, "fingerprint": fp}
    lines = [f"added credential {args.name} ({args.scheme}, {fp})"]
    if args.scheme == "mtls":
        assert secret is not None
        shown = _certificate(secret)
        row |= shown
        lines += [f"  {name}: {value}" for name, value in shown.items()]
    emit(settings, row, lines)
    return 0


def _certificate(secret: Secret) -> dict[str, str]:
    """What `credential add` shows of a client certificate: never anything of its key."""
    from store.rules import clientcert  # on first use, as in read_pkcs12

    found = clientcert.identity(clientcert.parse(secret).chain[0])
    return {
        "subject": found.subject,
        "issuer": found.issuer,
        "sans": ", ".join(found.sans) or "(none)",
        "expires": found.not_after.isoformat(timespec="seconds"),
    }


def _policy_file(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(64 * 1024)
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"cannot read --session-policy {path!r}") from e


def _credential_row(c: CredentialEntry, key: MasterKey | None = None) -> dict[str, Any]:
    state, fingerprint = _source_state(c, key) if c.secret_ref is not None else (None, None)
    return {
        "name": c.name,
        "scheme": c.scheme,
        "header": c.header_name,
        "param": c.param_name,
        "hosts": c.hosts,
        **_scheme_columns(c),
        "fingerprint": c.fingerprint or fingerprint,
        "secret_ref": c.secret_ref,
        "source_state": state,
        "created_at": c.created_at.isoformat(timespec="seconds"),
        "rotated_at": c.rotated_at.isoformat(timespec="seconds") if c.rotated_at else None,
        "placeholder_env": c.options.get("placeholder_env"),
    }


def _source_state(c: CredentialEntry, key: MasterKey | None) -> tuple[str, str | None]:
    """A reference read once from here, as the proxy reads it: ok and the keyed fingerprint
    of its value, or failing and why.

    Only a row whose mark is the master key's: one written by someone without the key is
    never read, here as in the proxy (its reference might name the key file itself)."""
    if key is None:
        return "unchecked (no master key here)", None
    mark = secretref.mark(key, c.name, c.secret_ref or "")
    if not hmac.compare_digest(c.ref_mark or "", mark):
        return "unreadable (not written with this master key)", None
    # Imported here: only a store with references pays for the proxy's modules.
    from addon.proxy.sources import OK, Source, Sources

    record = CredentialRecord(
        c.name, c.scheme, c.header_name, c.param_name, (), NO_SECRET, "", c.options, c.secret_ref
    )
    sources = Sources(lambda _: "")
    try:
        outcome = Source(record, sources.backend(record)).check()
    finally:
        sources.close()
    if outcome.error is not None or outcome.value is None:
        return f"failing ({outcome.error})", None
    return OK, key.fingerprint(outcome.value)


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
    if c.scheme == "mtls":
        return {
            "subject": c.options.get("cert_subject"),
            "expires": c.options.get("cert_not_after"),
        }
    return {}


def _token_endpoint(c: CredentialEntry) -> str | None:
    """Where a minted credential's tokens come from."""
    if c.scheme == "github-app":
        api = c.options.get("api_url", GITHUB_API)
        return f"{api}/app/installations/{c.options.get('installation')}/access_tokens"
    found: str | None = c.options.get("token_url") or c.options.get("token_uri")
    return found


def cmd_credential_list(args: argparse.Namespace, settings: Settings) -> int:
    found = settings.reader().list_credentials()
    key = None
    if any(c.secret_ref is not None for c in found):
        try:
            key = settings.key()
        except CredproxyError:  # listed all the same; references are not read
            key = None
    rows = [_credential_row(c, key) for c in found]
    columns = ["name", "scheme", "header", "param", "hosts"]
    extras = ("region", "service", "access_key_id", "assume_role", "placeholder", "positions")
    for extra in (*extras, "token_url", "scope", "subject", "expires"):
        if any(extra in row for row in rows):
            columns.append(extra)
    if any(row["secret_ref"] for row in rows):
        columns += ["secret_ref", "source_state"]
    columns += ["fingerprint", "rotated_at"]
    emit(settings, rows, table([{c: row.get(c) for c in columns} for row in rows], columns))
    return 0


def cmd_credential_remove(args: argparse.Namespace, settings: Settings) -> int:
    revoked = settings.store().remove_credential(args.name)
    emit(
        settings,
        {"name": args.name, "revoked_grants": revoked},
        [f"removed credential {args.name}; revoked {revoked} grant(s)"],
    )
    return 0


def cmd_credential_rotate(args: argparse.Namespace, settings: Settings) -> int:
    store = settings.store()
    if args.secret_ref is not None:
        ref = store.rotate_credential(args.name, None, args.secret_ref)
        emit(settings, {"name": args.name, "secret_ref": ref}, [f"{args.name} is held at {ref}"])
        return 0
    if args.pkcs12:
        found = [c for c in store.list_credentials() if c.name == args.name]
        if not found or found[0].scheme != "mtls" or args.secret_ref is not None:
            raise InvalidInput("--pkcs12 goes with an mtls credential, and not with --secret-ref")
    fp = store.rotate_credential(args.name, _secret_of(args, "mtls"))
    emit(settings, {"name": args.name, "fingerprint": fp}, [f"rotated {args.name} ({fp})"])
    return 0
