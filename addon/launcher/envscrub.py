"""The contained environment: the caller's variables minus everything that looks like a secret.

Pure. A variable goes when its name or its value has a secret's shape, unless it is kept by
name; the rules scan every variable, so nothing depends on a list of the ones to remove.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

# Upper-cased names containing one of these, starting or ending so, look like secrets.
NAME_PARTS = (
    "KEY",
    "TOKEN",
    "SECRET",
    "PASS",  # PASSWORD, PASSWD, DB_PASS, PGPASS
    "CREDENTIAL",
    "AUTH",
    "COOKIE",
    "PRIVATE",
)
NAME_PREFIXES = ("AWS_", "CREDPROXY_")  # credproxy's own settings are the operator's
# Not PWD alone: the shell's working directory is no secret.
NAME_SUFFIXES = ("_PAT", "_DSN", "_PWD", "_CONN", "_CONNECTION_STRING")

# Values with a well-known key's shape, anywhere in the value.
_VALUE_SHAPES = re.compile(
    "|".join(
        (
            r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_-]{16,}",  # OpenAI, Anthropic (sk-ant-...)
            r"(?<![A-Za-z0-9])gh[pousr]_[A-Za-z0-9]{20,}",  # GitHub tokens
            r"github_pat_[A-Za-z0-9_]{20,}",
            r"xox[abpre]-[A-Za-z0-9-]{8,}",  # Slack
            r"xapp-[A-Za-z0-9-]{8,}",
            r"(?<![A-Za-z0-9])[sr]k_(?:live|test)_[A-Za-z0-9]{10,}",  # Stripe
            r"glpat-[A-Za-z0-9_-]{20,}",  # GitLab
            r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,}",  # Hugging Face
            r"AIza[0-9A-Za-z_-]{35}",  # Google API keys
            r"(?<![A-Za-z0-9])npm_[A-Za-z0-9]{36}",
            r"(?i:-----BEGIN[A-Z ]* PRIVATE KEY(?: BLOCK)?-----)",  # PEM and PGP, any case
            r"(?i:(?:password|passwd|accountkey)=)",  # connection strings
            r"(?i:^\s*(?:authorization|cookie)\s*:)",  # a header line
            r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}",  # AWS access key ids
            r"eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.",  # a JWT: header.payload.signature
            r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s@]+@",  # a URL with userinfo
        )
    )
)


def secret_name(name: str) -> bool:
    upper = name.upper()
    return (
        any(part in upper for part in NAME_PARTS)
        or upper.startswith(NAME_PREFIXES)
        or upper.endswith(NAME_SUFFIXES)
    )


def secret_value(value: str) -> bool:
    return _VALUE_SHAPES.search(value) is not None


def scrub(env: Mapping[str, str], keep: Collection[str] = ()) -> tuple[dict[str, str], list[str]]:
    """The variables that stay, and the sorted names of those removed (never their values)."""
    kept: dict[str, str] = {}
    removed: list[str] = []
    for name, value in env.items():
        if name not in keep and (secret_name(name) or secret_value(value)):
            removed.append(name)
        else:
            kept[name] = value
    return kept, sorted(removed)
