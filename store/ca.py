"""The proxy's certificate authority, created by `credproxy init` in the certs directory."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from store.errors import InvalidInput

# What sandboxes trust.
PUBLIC_CERT = "credproxy-ca.pem"
# Private key + certificate, in the file name and form mitmproxy's certificate store loads.
PRIVATE_BUNDLE = "mitmproxy-ca.pem"


def ensure_ca(certs: Path) -> bool:
    """Create the CA unless one exists; returns whether it was created."""
    bundle = certs / PRIVATE_BUNDLE
    if bundle.exists():
        if not (certs / PUBLIC_CERT).exists():
            cert = x509.load_pem_x509_certificate(bundle.read_bytes())
            _write(certs / PUBLIC_CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return False
    certs.mkdir(parents=True, exist_ok=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, "credproxy CA"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "credproxy"),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .serial_number(x509.random_serial_number())
        .subject_name(name)
        .issuer_name(name)
        .not_valid_before(now - datetime.timedelta(days=2))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    _write(bundle, key_pem + cert_pem, 0o600)
    _write(certs / PUBLIC_CERT, cert_pem, 0o644)
    return True


def check_ca(certs: Path) -> None:
    """The CA files mitmproxy loads and sandboxes trust, checked before either is used.

    Raises: InvalidInput, naming the file and what is wrong with it.
    """
    bundle = certs / PRIVATE_BUNDLE
    # Left to mitmproxy, a missing bundle becomes a new CA that no sandbox trusts, and a
    # broken one an error that `run` could only report as the listener's.
    raw = read_file(bundle, f"CA file {bundle}", "run credproxy init")
    if b"PRIVATE KEY-----" not in raw:
        raise InvalidInput(f"CA file {bundle} holds no PEM private key")
    try:
        key = load_pem_private_key(raw, password=None)
    except TypeError as e:
        raise InvalidInput(f"CA file {bundle}: its private key is encrypted") from e
    except ValueError as e:
        raise InvalidInput(
            f"CA file {bundle}: its private key cannot be read (truncated or corrupt PEM)"
        ) from e
    cert = read_certificates(raw, f"CA file {bundle}")[0]
    if key.public_key() != cert.public_key():
        raise InvalidInput(f"CA file {bundle}: its private key does not match its certificate")
    expiry = cert.not_valid_after_utc
    if expiry <= datetime.datetime.now(datetime.UTC):
        raise InvalidInput(f"CA file {bundle}: its certificate expired on {expiry:%Y-%m-%d}")
    public = certs / PUBLIC_CERT
    what = f"CA file {public}"
    if read_certificates(read_file(public, what, "run credproxy init"), what)[0] != cert:
        raise InvalidInput(
            f"{what} is not the certificate in {bundle}, so clients would not trust the "
            f"proxy: remove it and run credproxy init to write it again"
        )


def read_certificates(raw: bytes, what: str) -> list[x509.Certificate]:
    """The PEM certificates in `raw`, at least one.

    Raises: InvalidInput, beginning with `what`.
    """
    if b"-----BEGIN CERTIFICATE-----" not in raw:
        raise InvalidInput(f"{what} holds no PEM certificate")
    try:
        return x509.load_pem_x509_certificates(raw)
    except ValueError as e:
        raise InvalidInput(
            f"{what}: a certificate in it cannot be read (truncated or corrupt PEM)"
        ) from e


def read_file(path: Path, what: str, advice: str | None = None) -> bytes:
    """The bytes of a file that must hold something; `advice` follows "does not exist".

    Raises: InvalidInput, beginning with `what`.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError as e:
        raise InvalidInput(f"{what} does not exist{f': {advice}' if advice else ''}") from e
    except OSError as e:
        raise InvalidInput(f"{what} cannot be read: {e.strerror}") from e
    if not raw.strip():
        raise InvalidInput(f"{what} is empty")
    return raw


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, mode)
