"""Secret references: where a credential's secret is held when credproxy does not seal it.

    file:/ABSOLUTE/PATH            a file (a mounted Kubernetes Secret), re-read on change
    aws-sm:SECRET_ID[#JSON_KEY]    AWS Secrets Manager: the secret string, or one key of it
    aws-ssm:PARAMETER_NAME         AWS SSM Parameter Store: a (SecureString) parameter, decrypted
    vault:MOUNT/PATH#FIELD         HashiCorp Vault KV version 2: one field of the secret

A reference is not a secret: the store keeps it as it is, `credential list` and `export`
show it. The proxy resolves it (addon/proxy/sources.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from store.crypto import MasterKey
from store.errors import InvalidInput

FILE, AWS_SM, AWS_SSM, VAULT = "file", "aws-sm", "aws-ssm", "vault"
KINDS = (FILE, AWS_SM, AWS_SSM, VAULT)
MAX_REF = 2048
# A secret's value holds what is stamped: never a reference whose tokens change on use.
UNREFERENCEABLE = frozenset({"oauth2-refresh"})

# C0, DEL, C1 (NEL, CSI) and the Unicode line and paragraph separators: a reference is
# printed by `credential list`, `run` and the audit stream, never with a line break or an escape.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Secrets Manager: a name (letters, digits, /_+=.@-) or an ARN (adds `:`).
_AWS_ID = re.compile(r"[A-Za-z0-9/_+=.@:-]{1,2048}")
_JSON_KEY = re.compile(r"[^\x00-\x1f\x7f#]{1,256}")
# Parameter Store: a name (letters, digits, _.-/), a path from /, or an ARN.
_SSM_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,2048}")
_VAULT_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,255}")
_VAULT_FIELD = re.compile(r"[A-Za-z0-9._-]{1,255}")


@dataclass(frozen=True)
class SecretRef:
    kind: str
    target: str  # the path, the secret id, or mount/path
    key: str | None = None  # the JSON key (aws-sm) or field (vault)

    def __str__(self) -> str:
        return f"{self.kind}:{self.target}" + (f"#{self.key}" if self.key is not None else "")

    @property
    def mount(self) -> str:
        """Vault: the KV v2 engine's mount."""
        return self.target.split("/", 1)[0]

    @property
    def path(self) -> str:
        """Vault: the secret's path under its mount."""
        return self.target.split("/", 1)[1]


def parse(text: str) -> SecretRef:
    """Raises InvalidInput, in one line that does not quote the text (a secret pasted in the
    wrong place must not reach a terminal's scrollback)."""
    if len(text) > MAX_REF or _CONTROL.search(text):
        raise InvalidInput("a secret reference is at most 2048 characters, without controls")
    kind, sep, rest = text.partition(":")
    if not sep or kind not in KINDS:
        raise InvalidInput(
            "a secret reference starts with file:, aws-sm:, aws-ssm: or vault: "
            "(file:/PATH, aws-sm:SECRET_ID[#KEY], aws-ssm:NAME, vault:MOUNT/PATH#FIELD)"
        )
    if kind == FILE:
        if not rest.startswith("/") or rest.endswith("/"):
            raise InvalidInput("a file: reference names an absolute path to a file")
        return SecretRef(FILE, rest)
    if kind == AWS_SSM:
        if not _SSM_NAME.fullmatch(rest) or "//" in rest:
            raise InvalidInput(
                "an aws-ssm: reference names a parameter: letters, digits and _.-/ (or an ARN)"
            )
        return SecretRef(AWS_SSM, rest)
    target, hashed, key = rest.partition("#")
    if kind == AWS_SM:
        if not _AWS_ID.fullmatch(target):
            raise InvalidInput(
                "an aws-sm: reference names a secret id or ARN: letters, digits and /_+=.@:-"
            )
        if hashed and not _JSON_KEY.fullmatch(key):
            raise InvalidInput("an aws-sm: reference's #KEY is 1 to 256 printable characters")
        return SecretRef(AWS_SM, target, key if hashed else None)
    segments = target.split("/")
    if len(segments) < 2 or not all(_VAULT_SEGMENT.fullmatch(s) for s in segments):
        raise InvalidInput(
            "a vault: reference is MOUNT/PATH#FIELD: segments of letters, digits and ._-"
        )
    if any(s in (".", "..") for s in segments):
        raise InvalidInput("a vault: reference's path has no . or .. segment")
    if not hashed or not _VAULT_FIELD.fullmatch(key):
        raise InvalidInput("a vault: reference names the field: vault:MOUNT/PATH#FIELD")
    return SecretRef(VAULT, target, key)


def for_scheme(scheme: str, text: str) -> str:
    """The reference, checked for this scheme; what the store keeps. Raises InvalidInput."""
    ref = parse(text)
    if scheme in UNREFERENCEABLE:
        raise InvalidInput(
            f"an {scheme} credential's tokens are sealed back on every refresh: "
            "it cannot hold a secret reference"
        )
    return str(ref)


def mark(key: MasterKey, name: str, ref: str) -> str:
    """The keyed mark a referenced credential's row carries in place of a fingerprint: the
    proxy reads no reference without it, so that whoever can write the database but holds no
    master key cannot point a credential at a file of the proxy's (its key, its CA)."""
    return key.mark(f"credproxy/secret-ref/{name}/{ref}".encode())
