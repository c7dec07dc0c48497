"""The proxy's CA: created once, kept after, its key file private, loadable by mitmproxy."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from store.ca import PRIVATE_BUNDLE, PUBLIC_CERT, ensure_ca


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    return tmp_path / "certs"


@pytest.fixture(params=[0o000, 0o077], ids=["umask 000", "umask 077"])
def any_umask(request: pytest.FixtureRequest) -> Iterator[None]:
    """A umask that would leave new files world-writable, or unreadable to others."""
    old = os.umask(request.param)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def cert_of(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_init_creates_the_directory_the_bundle_and_the_public_certificate(certs: Path) -> None:
    assert ensure_ca(certs) is True
    assert sorted(p.name for p in certs.iterdir()) == sorted([PRIVATE_BUNDLE, PUBLIC_CERT])


@pytest.mark.usefixtures("any_umask")
def test_the_private_bundle_is_readable_by_its_owner_only(certs: Path) -> None:
    ensure_ca(certs)
    assert mode(certs / PRIVATE_BUNDLE) == 0o600
    assert mode(certs / PUBLIC_CERT) == 0o644


def test_the_public_certificate_holds_no_private_key(certs: Path) -> None:
    ensure_ca(certs)
    assert b"PRIVATE KEY" not in (certs / PUBLIC_CERT).read_bytes()
    assert b"PRIVATE KEY" in (certs / PRIVATE_BUNDLE).read_bytes()


def test_the_bundles_key_belongs_to_its_certificate(certs: Path) -> None:
    ensure_ca(certs)
    data = (certs / PRIVATE_BUNDLE).read_bytes()
    key = serialization.load_pem_private_key(data, password=None)
    assert key.public_key() == cert_of(certs / PRIVATE_BUNDLE).public_key()
    assert cert_of(certs / PRIVATE_BUNDLE) == cert_of(certs / PUBLIC_CERT)


def test_the_certificate_is_a_self_signed_ca_that_can_only_sign(certs: Path) -> None:
    ensure_ca(certs)
    cert = cert_of(certs / PUBLIC_CERT)
    assert cert.subject == cert.issuer
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "credproxy CA"
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical
    assert usage.value.key_cert_sign and usage.value.crl_sign
    assert not usage.value.digital_signature and not usage.value.key_encipherment
    extended = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(extended) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert cert.not_valid_after_utc > cert.not_valid_before_utc


def test_a_second_init_keeps_the_ca_it_found(certs: Path) -> None:
    ensure_ca(certs)
    before = (certs / PRIVATE_BUNDLE).read_bytes()
    assert ensure_ca(certs) is False
    assert (certs / PRIVATE_BUNDLE).read_bytes() == before


@pytest.mark.usefixtures("any_umask")
def test_a_missing_public_certificate_is_written_again_from_the_bundle(certs: Path) -> None:
    ensure_ca(certs)
    bundle = (certs / PRIVATE_BUNDLE).read_bytes()
    (certs / PUBLIC_CERT).unlink()
    assert ensure_ca(certs) is False
    assert (certs / PRIVATE_BUNDLE).read_bytes() == bundle
    assert cert_of(certs / PUBLIC_CERT) == cert_of(certs / PRIVATE_BUNDLE)
    assert mode(certs / PUBLIC_CERT) == 0o644


def test_each_ca_is_its_own(tmp_path: Path) -> None:
    ensure_ca(tmp_path / "a")
    ensure_ca(tmp_path / "b")
    a, b = cert_of(tmp_path / "a" / PUBLIC_CERT), cert_of(tmp_path / "b" / PUBLIC_CERT)
    assert a.serial_number != b.serial_number
    assert a.public_key() != b.public_key()


def test_mitmproxy_loads_the_bundle_and_signs_leaves_with_it(certs: Path) -> None:
    from mitmproxy.certs import CertStore

    ensure_ca(certs)
    store = CertStore.from_store(certs, "mitmproxy", 2048)
    leaf = store.get_cert("api.test", [x509.DNSName("api.test")])
    # Raises unless the leaf names this CA as issuer and carries its signature.
    leaf_cert = x509.load_pem_x509_certificate(leaf.cert.to_pem())
    leaf_cert.verify_directly_issued_by(cert_of(certs / PUBLIC_CERT))
