"""The minted-token schemes' settings and secrets, checked before they are stored.

oauth2-client, oauth2-refresh, google-service-account and github-app keep a long-lived
secret (JSON) in the store; the proxy mints short-lived tokens with it. Messages never quote
a secret.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from store.crypto import Secret
from store.errors import InvalidInput
from store.rules.grammar import parse_host

MINTED = ("oauth2-client", "oauth2-refresh", "google-service-account", "github-app")
DEFAULT_PREFIX = "Bearer "
GITHUB_API = "https://api.github.com"
OPTIONS = {
    "oauth2-client": ("token_url", "scope", "audience", "client_auth", "token_prefix"),
    "oauth2-refresh": ("token_url", "scope", "client_auth", "token_prefix"),
    "google-service-account": ("scope", "subject", "token_prefix"),
    "github-app": ("installation", "repository", "permission", "api_url", "token_prefix"),
}
# Every minted scheme's option, once, in the order the CLI and `credential list` show them.
OPTION_NAMES = tuple(dict.fromkeys(name for names in OPTIONS.values() for name in names))
# Those that take a list (repeatable flags; lists in a policy file).
LIST_OPTION_NAMES = frozenset({"scope", "repository", "permission"})
CLIENT_AUTH = {
    "oauth2-client": ("basic", "post"),
    "oauth2-refresh": ("basic", "post", "none"),
}
# Printable ASCII without spaces: what a form field, a header value or a JWT claim carries.
_VALUE = re.compile(r"[\x21-\x7e]{1,4096}")
_SCOPE = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]{1,256}")  # RFC 6749 scope-token
_PREFIX = re.compile(r"[\x20-\x7e]{0,64}")
_EMAIL = re.compile(r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9.-]{1,253}")
_REPOSITORY = re.compile(r"[A-Za-z0-9._-]{1,100}")
_PERMISSION = re.compile(r"([a-z][a-z_]{0,63})=(read|write)")
_DIGITS = re.compile(r"[1-9][0-9]{0,19}")
GOOGLE_FIELDS = frozenset(
    {
        "type",
        "project_id",
        "private_key_id",
        "private_key",
        "client_email",
        "client_id",
        "auth_uri",
        "token_uri",
        "auth_provider_x509_cert_url",
        "client_x509_cert_url",
        "universe_domain",
    }
)


def https_url(text: str, what: str) -> str:
    """An https URL without userinfo, query or fragment; its host is checked as hosts are."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise InvalidInput(f"invalid {{{what}}}: not a URL", **{what: what}) from None
    if not _VALUE.fullmatch(text):  # urlsplit drops CR, LF and tab and keeps spaces
        raise InvalidInput(f"the {{{what}}} must be printable ASCII without spaces", **{what: what})
    if parts.scheme != "https" or not parts.hostname:
        raise InvalidInput(f"the {{{what}}} must be an https:// URL", **{what: what})
    if parts.username is not None or parts.query or parts.fragment:
        raise InvalidInput(f"the {{{what}}} must have no user, query or fragment", **{what: what})
    parse_host(parts.netloc)
    if port is not None and not 0 < port < 65536:
        raise InvalidInput(f"invalid {{{what}}}: port out of range", **{what: what})
    return text


def options(scheme: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """A minted scheme's settings, as stored in credentials.options."""
    out: dict[str, Any] = {}
    prefix = given.get("token_prefix")
    if prefix is not None:
        if not _PREFIX.fullmatch(prefix):
            raise InvalidInput(
                "invalid {token_prefix}: at most 64 printable ASCII characters",
                token_prefix="token_prefix",  # noqa: S106 - an input's name
            )
        out["token_prefix"] = prefix
    if scheme in ("oauth2-client", "oauth2-refresh"):
        url = given.get("token_url")
        if url is None:
            raise InvalidInput(
                f"{{scheme}} {scheme} needs a {{token_url}}",
                scheme="scheme",
                token_url="token_url",  # noqa: S106 - an input's name
            )
        out["token_url"] = https_url(url, "token_url")
        auth = given.get("client_auth")
        if auth is not None:
            if auth not in CLIENT_AUTH[scheme]:
                raise InvalidInput(
                    f"invalid {{client_auth}} {auth!r}: use {' or '.join(CLIENT_AUTH[scheme])}",
                    client_auth="client_auth",
                )
            out["client_auth"] = auth
    if scheme in ("oauth2-client", "oauth2-refresh", "google-service-account"):
        scopes = list(given.get("scope") or ())
        for scope in scopes:
            if not _SCOPE.fullmatch(scope):
                raise InvalidInput(
                    "invalid {scope}: one scope token, no spaces or quotes", scope="scope"
                )
        if scheme == "google-service-account" and not scopes:
            raise InvalidInput(
                "{scheme} google-service-account needs at least one {scope}",
                scheme="scheme",
                scope="scope",
            )
        if scopes:
            out["scope"] = sorted(set(scopes))
    audience = given.get("audience")
    if audience is not None:
        if not _VALUE.fullmatch(audience):
            raise InvalidInput("invalid {audience}: printable ASCII", audience="audience")
        out["audience"] = audience
    subject = given.get("subject")
    if subject is not None:
        if not _EMAIL.fullmatch(subject):
            raise InvalidInput("invalid {subject}: a user's e-mail address", subject="subject")
        out["subject"] = subject
    if scheme == "github-app":
        out |= _github_options(given)
    return out


def _github_options(given: Mapping[str, Any]) -> dict[str, Any]:
    installation = given.get("installation")
    if installation is None or not _DIGITS.fullmatch(str(installation)):
        raise InvalidInput(
            "{scheme} github-app needs an {installation} id (digits)",
            scheme="scheme",
            installation="installation",
        )
    out: dict[str, Any] = {"installation": str(installation)}
    repositories = list(given.get("repository") or ())
    for name in repositories:
        if not _REPOSITORY.fullmatch(name):
            raise InvalidInput(
                "invalid {repository}: a repository name without its owner",
                repository="repository",
            )
    if repositories:
        out["repository"] = sorted(set(repositories))
    permissions: dict[str, str] = {}
    for text in given.get("permission") or ():
        m = _PERMISSION.fullmatch(text)
        if m is None:
            raise InvalidInput(
                "invalid {permission}: NAME=read or NAME=write, e.g. contents=read",
                permission="permission",
            )
        if permissions.setdefault(m[1], m[2]) != m[2]:
            raise InvalidInput("{permission} names one permission twice", permission="permission")
    if permissions:
        out["permission"] = sorted(f"{k}={v}" for k, v in permissions.items())
    api = given.get("api_url")
    if api is not None:
        out["api_url"] = https_url(api.rstrip("/"), "api_url")
    return out


def json_object(value: Secret, shape: str) -> dict[str, Any]:
    """A JSON secret that must be an object: no duplicate field, messages never quote it."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise InvalidInput(f"the secret names a field twice: it must be {shape}")
        return dict(pairs)

    try:
        data = json.loads(value.reveal(), object_pairs_hook=no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidInput(f"the secret is not valid JSON: it must be {shape}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"the secret must be {shape}")
    return data


def _fields(
    data: dict[str, Any], shape: str, required: tuple[str, ...], optional: tuple[str, ...]
) -> None:
    unknown = set(data) - set(required) - set(optional)
    if unknown:
        raise InvalidInput(f"the secret has a field other than {', '.join(required + optional)}")
    for name in required:
        if name not in data:
            raise InvalidInput(f"the secret lacks {name}: it must be {shape}")


def _text(data: dict[str, Any], name: str) -> None:
    value = data[name]  # null too: a present field is a string
    if not isinstance(value, str) or not _VALUE.fullmatch(value):
        raise InvalidInput(f"the secret's {name} must be a string of printable ASCII")


def private_key(pem: Any, name: str = "private_key") -> Any:
    """An RSA private key from PEM; the message never quotes it."""
    from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    if not isinstance(pem, str):
        raise InvalidInput(f"the secret's {name} must be a PEM string")
    try:
        key = load_pem_private_key(pem.encode(), password=None)
    except (ValueError, TypeError):
        raise InvalidInput(f"the secret's {name} is not a PEM private key") from None
    if not isinstance(key, RSAPrivateKey) or key.key_size < 2048:
        raise InvalidInput(f"the secret's {name} must be an RSA key of 2048 bits or more")
    return key


def secret(scheme: str, value: Secret, settings: Mapping[str, Any]) -> Secret:
    """A minted scheme's JSON secret, checked, back as compact JSON."""
    if scheme == "oauth2-client":
        shape = "JSON {client_id, client_secret}"
        data = json_object(value, shape)
        _fields(data, shape, ("client_id", "client_secret"), ())
        for name in data:
            _text(data, name)
    elif scheme == "oauth2-refresh":
        shape = "JSON {client_id, client_secret (unless --client-auth none), refresh_token}"
        data = json_object(value, shape)
        _fields(data, shape, ("client_id", "refresh_token"), ("client_secret",))
        for name in data:
            _text(data, name)
        auth = settings.get("client_auth")
        if auth in ("basic", "post") and "client_secret" not in data:
            raise InvalidInput(f"the secret lacks client_secret: it must be {shape}")
        if auth == "none" and "client_secret" in data:
            raise InvalidInput(
                "client_secret does not go with {client_auth} none", client_auth="client_auth"
            )
    elif scheme == "google-service-account":
        shape = "a Google service-account key file (JSON)"
        data = json_object(value, shape)
        _fields(
            data,
            shape,
            ("type", "client_email", "private_key", "token_uri"),
            tuple(sorted(GOOGLE_FIELDS)),
        )
        if data["type"] != "service_account":
            raise InvalidInput("the secret's type must be service_account")
        for name in data:
            if name != "private_key":
                _text(data, name)
        if not _EMAIL.fullmatch(data["client_email"]):
            raise InvalidInput("the secret's client_email is not an e-mail address")
        https_url(data["token_uri"], "token_uri")
        private_key(data["private_key"])
    else:
        shape = "JSON {app_id, private_key}"
        data = json_object(value, shape)
        _fields(data, shape, ("app_id", "private_key"), ())
        app_id = data["app_id"]
        if isinstance(app_id, bool) or not _DIGITS.fullmatch(str(app_id)):
            raise InvalidInput("the secret's app_id must be the App's numeric id")
        data["app_id"] = str(app_id)
        private_key(data["private_key"])
    return Secret(json.dumps(data, separators=(",", ":"), sort_keys=True).encode())


# What `credential list` may show of a minted scheme's secret (credentials.options).
HINTS = {
    "google-service-account": {"client_email": "client_email", "token_uri": "token_uri"},
    "github-app": {"app_id": "app_id"},
}


def token_version(credential: Any) -> str:
    """What defines a minted credential's tokens: its secret (fingerprint), scheme and
    settings. A token minted for another version is dropped (addon/schemes/mint.py Tokens)."""
    settings = json.dumps(credential.options or {}, sort_keys=True, default=str)
    return f"{credential.fingerprint} {credential.scheme} {settings}"


def hint(scheme: str, data: Mapping[str, Any]) -> dict[str, str]:
    return {shown: str(data[field]) for field, shown in HINTS.get(scheme, {}).items()}
