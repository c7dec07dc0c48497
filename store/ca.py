"""The proxy's certificate authority, created by `credproxy init` in the certs directory."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

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


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, mode)
