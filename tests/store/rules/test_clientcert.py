"""What an mtls secret must be: a chain that parses, each certificate signed by the next, the
key of the first; what may be shown of it; messages never quote it."""

from __future__ import annotations

import datetime
from functools import cache

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from store.crypto import Secret
from store.errors import InvalidInput
from store.rules import clientcert, validation


@cache
def ca() -> trustme.CA:
    return trustme.CA()


@cache
def issued(name: str = "agent") -> trustme.LeafCert:
    return ca().issue_cert(f"{name}.clients.test", "agent@example.com", common_name=name)


def _key(leaf: trustme.LeafCert) -> bytes:
    return leaf.private_key_pem.bytes()


def _cert(leaf: trustme.LeafCert) -> bytes:
    return leaf.cert_chain_pems[0].bytes()


def test_a_chain_and_its_key_are_stored_as_pem_leaf_first() -> None:
    leaf = issued()
    stored = clientcert.secret(Secret(_key(leaf) + _cert(leaf)))  # key first in the input
    text = stored.reveal()
    assert text.index(b"BEGIN CERTIFICATE") < text.index(b"BEGIN PRIVATE KEY")
    assert clientcert.parse(stored).chain[0].public_bytes(serialization.Encoding.PEM) == (
        _cert(leaf)
    )


def test_an_intermediate_goes_with_the_chain_in_any_order() -> None:
    child = ca().create_child_ca()
    leaf = child.issue_cert("chained.clients.test")
    cert, intermediate = (p.bytes() for p in leaf.cert_chain_pems)
    for given in (cert + intermediate, intermediate + cert):
        parsed = clientcert.parse(Secret(given + leaf.private_key_pem.bytes()))
        pems = [c.public_bytes(serialization.Encoding.PEM) for c in parsed.chain]
        assert pems == [cert, intermediate]


def test_what_is_shown_is_the_certificate_never_the_key() -> None:
    leaf = issued()
    found = clientcert.identity(clientcert.parse(Secret(_cert(leaf) + _key(leaf))).chain[0])
    assert "CN=agent" in found.subject
    assert found.sans == ("DNS:agent.clients.test", "email:agent@example.com")
    hint = found.hint()
    assert set(hint) == {"cert_subject", "cert_issuer", "cert_sans", "cert_not_after"}
    assert hint["cert_not_after"] == "3000-01-01T00:00:00+00:00"


def _other_key() -> bytes:
    return _key(issued("someone-else"))


@pytest.mark.parametrize(
    "make, message",
    [
        pytest.param(
            lambda: _cert(issued()) + _other_key(),
            "the private key does not match any certificate",
            id="a key that is not the certificate's is refused",
        ),
        pytest.param(
            lambda: _cert(issued()),
            "an mtls secret needs exactly one private key (PEM)",
            id="a certificate without its key is refused",
        ),
        pytest.param(
            lambda: _cert(issued()) + _key(issued()) + _other_key(),
            "an mtls secret needs exactly one private key (PEM)",
            id="two keys are refused",
        ),
        pytest.param(
            lambda: _key(issued()),
            "an mtls secret needs the client's certificate (PEM)",
            id="a key without its certificate is refused",
        ),
        pytest.param(
            lambda: (
                b"-----BEGIN CERTIFICATE-----\nnot-base64\n-----END CERTIFICATE-----\n"
                + _key(issued())
            ),
            "a certificate in the chain does not parse",
            id="a certificate that does not parse is refused",
        ),
        pytest.param(
            lambda: (
                _cert(issued()) + b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
            ),
            "the private key does not parse",
            id="a key that does not parse is refused",
        ),
        pytest.param(
            lambda: (
                _cert(issued())
                + b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n"
                + b"-----END ENCRYPTED PRIVATE KEY-----\n"
            ),
            "the private key is encrypted: give it unencrypted (PEM), on stdin",
            id="an encrypted key is refused",
        ),
        pytest.param(
            lambda: _cert(issued()) + _cert(issued("someone-else")) + _key(issued()),
            "each certificate must be in the chain of the key's certificate",
            id="a certificate outside the key's chain is refused",
        ),
        pytest.param(
            lambda: b"sk-not-a-certificate",
            "an mtls secret needs exactly one private key (PEM)",
            id="anything else is refused",
        ),
    ],
)
def test_bad_secrets_are_refused_without_quoting_them(make, message: str) -> None:
    secret = make()
    with pytest.raises(InvalidInput) as e:
        validation.scheme_secret("mtls", Secret(secret), {})
    assert str(e.value) == message
    for line in secret.splitlines():
        if len(line) > 8 and b"-----" not in line:
            assert line.decode() not in str(e.value)


def test_an_expired_certificate_is_refused_at_the_edge() -> None:
    now = datetime.datetime.now(datetime.UTC)
    leaf = ca().issue_cert(
        "old.clients.test",
        not_before=now - datetime.timedelta(days=2),
        not_after=now - datetime.timedelta(days=1),
    )
    with pytest.raises(InvalidInput, match="the certificate expired on "):
        clientcert.secret(Secret(leaf.private_key_and_cert_chain_pem.bytes()))


def test_control_characters_in_a_name_are_escaped() -> None:
    leaf = ca().issue_cert("x.clients.test", common_name="evil\nline")
    found = clientcert.identity(clientcert.parse(Secret(_cert(leaf) + _key(leaf))).chain[0])
    assert "\n" not in found.subject
    assert "evil\\x0aline" in found.subject


def test_the_repr_shows_no_key() -> None:
    leaf = issued()
    parsed = clientcert.parse(Secret(_cert(leaf) + _key(leaf)))
    assert "[secure]" in repr(parsed)
    assert "PRIVATE" not in repr(parsed)


def _p12(leaf: trustme.LeafCert, passphrase: bytes) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import pkcs12

    key = serialization.load_pem_private_key(leaf.private_key_pem.bytes(), password=None)
    certs = [x509.load_pem_x509_certificate(p.bytes()) for p in leaf.cert_chain_pems]
    encryption = (
        serialization.BestAvailableEncryption(passphrase)
        if passphrase
        else serialization.NoEncryption()
    )
    return pkcs12.serialize_key_and_certificates(
        b"client",
        key,  # type: ignore[arg-type]
        certs[0],
        certs[1:] or None,
        encryption,
    )


@pytest.mark.parametrize("passphrase", [b"pass\nphrase-free", b""], ids=["a passphrase", "none"])
def test_a_pkcs12_opens_into_the_chain_and_key(passphrase: bytes) -> None:
    passphrase = passphrase.split(b"\n")[0]
    leaf = ca().create_child_ca().issue_cert("p12.clients.test")
    pem = clientcert.from_pkcs12(Secret(passphrase + b"\n" + _p12(leaf, passphrase)))
    parsed = clientcert.parse(clientcert.secret(pem))
    assert [c.public_bytes(serialization.Encoding.PEM) for c in parsed.chain] == [
        p.bytes() for p in leaf.cert_chain_pems
    ]


def test_a_wrong_passphrase_is_one_message_without_either() -> None:
    bundle = _p12(issued(), b"right-passphrase")
    with pytest.raises(InvalidInput) as e:
        clientcert.from_pkcs12(Secret(b"wrong-passphrase\n" + bundle))
    assert str(e.value) == "the PKCS#12 does not open: not PKCS#12, or a wrong passphrase"
