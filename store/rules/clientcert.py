"""A client certificate credential (scheme mtls): a PEM certificate chain and its private key.

Checked once, before it is stored: the chain parses, one certificate is the key's, and each
other is the issuer of the one before it (put in that order). What is stored is the chain
(leaf first) and the key as unencrypted PKCS#8 PEM. Messages never quote the input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtensionOID

from store.crypto import Secret
from store.errors import InvalidInput

MAX_CHAIN = 8
_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n.*?-----END \1-----", re.DOTALL)
_KEYS = (b"PRIVATE KEY", b"RSA PRIVATE KEY", b"EC PRIVATE KEY")
Key = (
    rsa.RSAPrivateKey
    | ec.EllipticCurvePrivateKey
    | ed25519.Ed25519PrivateKey
    | ed448.Ed448PrivateKey
)


@dataclass(frozen=True)
class Identity:
    """What may be shown of a client certificate: never anything of the key."""

    subject: str
    issuer: str
    sans: tuple[str, ...]
    not_before: datetime
    not_after: datetime

    def hint(self) -> dict[str, str]:
        """What `credential list` keeps in the credential's options."""
        return {
            "cert_subject": self.subject,
            "cert_issuer": self.issuer,
            "cert_sans": ", ".join(self.sans),
            "cert_not_after": self.not_after.isoformat(timespec="seconds"),
        }


@dataclass(frozen=True, repr=False)
class ClientCert:
    """A parsed chain and key. Its repr never shows the key."""

    chain: tuple[x509.Certificate, ...]
    key: Key

    def __repr__(self) -> str:
        return f"ClientCert({identity(self.chain[0]).subject!r}, key=[secure])"

    def pem(self) -> bytes:
        """The form the store seals: the chain, leaf first, then the key (PKCS#8)."""
        return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in self.chain) + (
            self.key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


def parse(value: Secret) -> ClientCert:
    """A PEM chain and one unencrypted private key, in any order in the input; the chain is
    returned leaf first.

    Raises: InvalidInput, naming what is wrong and quoting nothing.
    """
    blocks = [(m.group(1), m.group(0)) for m in _BLOCK.finditer(value.reveal())]
    if any(kind == b"ENCRYPTED PRIVATE KEY" for kind, _ in blocks):
        raise InvalidInput("the private key is encrypted: give it unencrypted (PEM), on stdin")
    keys = [block for kind, block in blocks if kind in _KEYS]
    pems = [block for kind, block in blocks if kind == b"CERTIFICATE"]
    if len(keys) != 1:
        raise InvalidInput("an mtls secret needs exactly one private key (PEM)")
    if not pems:
        raise InvalidInput("an mtls secret needs the client's certificate (PEM)")
    if len(pems) > MAX_CHAIN:
        raise InvalidInput(f"the certificate chain is longer than {MAX_CHAIN}")
    try:
        chain = tuple(x509.load_pem_x509_certificate(p) for p in pems)
    except ValueError:
        raise InvalidInput("a certificate in the chain does not parse") from None
    try:
        key = serialization.load_pem_private_key(keys[0], password=None)
    except (ValueError, TypeError):
        raise InvalidInput("the private key does not parse") from None
    if not isinstance(key, Key):
        raise InvalidInput("the private key must be RSA, EC, Ed25519 or Ed448")
    return ClientCert(_ordered(chain, key), key)


def _ordered(certs: tuple[x509.Certificate, ...], key: Key) -> tuple[x509.Certificate, ...]:
    """The key's certificate first, then each one's issuer (as `openssl pkcs12 -nodes`
    prints them, in any order).

    Raises: InvalidInput for no certificate of the key, or one outside its chain.
    """
    mine = _spki(key.public_key())
    leaves = [c for c in certs if _spki(c.public_key()) == mine]
    if not leaves:
        raise InvalidInput("the private key does not match any certificate")
    chain = [leaves[0]]
    rest = [c for c in certs if c is not leaves[0]]
    while rest:
        parent = next((c for c in rest if _issued(chain[-1], c)), None)
        if parent is None:
            raise InvalidInput("each certificate must be in the chain of the key's certificate")
        chain.append(parent)
        rest.remove(parent)
    return tuple(chain)


def _issued(child: x509.Certificate, parent: x509.Certificate) -> bool:
    try:
        child.verify_directly_issued_by(parent)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def from_pkcs12(value: Secret) -> Secret:
    """A PKCS#12 bundle as PEM: `value` is its passphrase (maybe empty), a newline, then the
    PKCS#12 bytes.

    Raises: InvalidInput, quoting nothing.
    """
    passphrase, newline, bundle = value.reveal().partition(b"\n")
    if not newline or not bundle:
        raise InvalidInput("give the passphrase (or an empty line), a newline, then the PKCS#12")
    try:
        key, cert, extra = pkcs12.load_key_and_certificates(bundle, passphrase or None)
    except (ValueError, TypeError):
        raise InvalidInput(
            "the PKCS#12 does not open: not PKCS#12, or a wrong passphrase"
        ) from None
    if key is None or cert is None:
        raise InvalidInput("the PKCS#12 holds no certificate and key")
    pem = serialization.Encoding.PEM
    chain = b"".join(c.public_bytes(pem) for c in (cert, *extra))
    return Secret(
        chain
        + key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def secret(value: Secret, now: datetime | None = None) -> Secret:
    """The secret as the store seals it; an expired certificate is refused here already."""
    cert = parse(value)
    found = identity(cert.chain[0])
    if found.not_after <= (now or datetime.now(UTC)):
        raise InvalidInput(
            f"the certificate expired on {found.not_after.isoformat(timespec='seconds')}"
        )
    return Secret(cert.pem())


def identity(cert: x509.Certificate) -> Identity:
    try:
        found = cert.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME)
        names = found.value
        assert isinstance(names, x509.SubjectAlternativeName)
        listed = (
            [f"DNS:{n}" for n in names.get_values_for_type(x509.DNSName)]
            + [f"IP:{n}" for n in names.get_values_for_type(x509.IPAddress)]
            + [f"URI:{n}" for n in names.get_values_for_type(x509.UniformResourceIdentifier)]
            + [f"email:{n}" for n in names.get_values_for_type(x509.RFC822Name)]
        )
        sans = tuple(_shown(n) for n in listed)
    except x509.ExtensionNotFound:
        sans = ()
    return Identity(
        subject=_shown(cert.subject.rfc4514_string()),
        issuer=_shown(cert.issuer.rfc4514_string()),
        sans=sans,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
    )


def _spki(public: CertificatePublicKeyTypes) -> bytes:
    return public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _shown(text: str) -> str:
    """A name from the certificate, its control characters escaped: it reaches a terminal."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
