"""Sealing secrets at rest (AES-256-GCM), the master key, fingerprints and token hashes."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from store.errors import MasterKeyError, SealError

KEY_ENV = "CREDPROXY_MASTER_KEY"
NONCE_BYTES = 12


class Secret:
    """A credential's plaintext. Its repr and str never show it; it refuses to be pickled."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes) -> None:
        self._value = value

    def reveal(self) -> bytes:
        return self._value

    def __repr__(self) -> str:
        return "Secret([secure])"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        return id(self)

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Secret cannot be pickled")


def _derive(key: bytes, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=purpose).derive(key)


@dataclass(frozen=True)
class MasterKey:
    """The 32-byte key every secret is sealed under, and where it came from (for errors)."""

    key: bytes = field(repr=False)
    source: str
    key_id: str = field(init=False)
    _fp_key: bytes = field(init=False, repr=False)
    _mark_key: bytes = field(init=False, repr=False)
    _check: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_id", _derive(self.key, b"credproxy key id")[:6].hex())
        object.__setattr__(self, "_fp_key", _derive(self.key, b"credproxy fingerprint"))
        # Not the fingerprints' key: a fingerprint of a chosen value is shown and logged, and
        # must never double as a valid mark.
        object.__setattr__(self, "_mark_key", _derive(self.key, b"credproxy row mark"))
        check = hmac.new(_derive(self.key, b"credproxy key check"), b"credproxy", "sha256")
        object.__setattr__(self, "_check", check.hexdigest())

    @classmethod
    def generate(cls, source: str) -> MasterKey:
        return cls(os.urandom(32), source)

    @property
    def check_value(self) -> str:
        return self._check

    def encoded(self) -> bytes:
        return base64.b64encode(self.key) + b"\n"

    def seal(self, plaintext: bytes, context: str) -> tuple[str, bytes, bytes]:
        """Returns (key id, nonce, ciphertext) bound to `context` (which row it belongs to)."""
        nonce = os.urandom(NONCE_BYTES)
        ciphertext = AESGCM(self.key).encrypt(nonce, plaintext, self._aad(context))
        return self.key_id, nonce, ciphertext

    def open(self, key_id: str, nonce: bytes, ciphertext: bytes, context: str) -> Secret:
        """Raises SealError if the key, the context or the ciphertext is not the sealed one."""
        if key_id != self.key_id:
            raise SealError(f"secret of {context} is sealed under key {key_id}, not {self.key_id}")
        try:
            return Secret(AESGCM(self.key).decrypt(nonce, ciphertext, self._aad(context)))
        except InvalidTag as e:
            raise SealError(f"secret of {context} failed authentication") from e

    def _aad(self, context: str) -> bytes:
        return f"credproxy/v1/{context}/{self.key_id}".encode()

    def fingerprint(self, secret: Secret) -> str:
        return "fp-" + hmac.new(self._fp_key, secret.reveal(), "sha256").hexdigest()[:12]

    def mark(self, data: bytes) -> str:
        """A keyed mark of a row's own fields (a secret reference's), under a key of its own:
        29 hex digits (116 bits), to fit the 32 characters of the column it is kept in."""
        return "rm-" + hmac.new(self._mark_key, data, "sha256").hexdigest()[:29]


def decode_key(text: str | bytes, source: str) -> MasterKey:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise MasterKeyError(f"master key from {source} is not valid base64") from e
    if len(key) != 32:
        raise MasterKeyError(f"master key from {source} is not 32 bytes of base64")
    return MasterKey(key, source)


def load_master_key(key_file: Path, env: Mapping[str, str]) -> MasterKey:
    """The key from CREDPROXY_MASTER_KEY, else from `key_file`, which must be private."""
    if env.get(KEY_ENV):
        return decode_key(env[KEY_ENV], KEY_ENV)
    source = f"key file {key_file}"
    try:
        info = key_file.stat()
    except FileNotFoundError as e:
        raise MasterKeyError(f"no master key: {source} does not exist (run credproxy init)") from e
    except OSError as e:
        raise MasterKeyError(f"cannot read {source}: {e.strerror}") from e
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise MasterKeyError(
            f"{source} is accessible by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"run chmod 600 {key_file}"
        )
    try:
        return decode_key(key_file.read_bytes(), source)
    except OSError as e:
        raise MasterKeyError(f"cannot read {source}: {e.strerror}") from e


def write_key_file(path: Path, key: MasterKey, *, replace: bool = False) -> None:
    """Write `key` with mode 0600; atomically replaces an existing file only if `replace`."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key.encoded())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def new_token() -> str:
    """A principal's proxy token: 192 random bits, URL-safe so it fits in a proxy URL."""
    return secrets.token_urlsafe(24)


def hash_token(token: str) -> str:
    # Tokens are 192-bit random, so a fast hash is enough: no dictionary to search.
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: str, token_hash: str) -> bool:
    return hmac.compare_digest(hash_token(token), token_hash)
