"""`--upstream-ca`: the certificates alone are kept, and added to certifi's roots."""

from __future__ import annotations

from pathlib import Path

import certifi
import pytest
import trustme

from addon.runtime.upstreamca import UpstreamCA
from store.errors import InvalidInput


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


def test_only_the_certificates_of_the_file_are_kept(tmp_path: Path, ca: trustme.CA) -> None:
    path = tmp_path / "ca.pem"
    key = ca.private_key_pem.bytes()
    path.write_bytes(b"a comment\n" + key + ca.cert_pem.bytes())
    upstream = UpstreamCA.read(path)
    assert upstream.pem.strip() == ca.cert_pem.bytes().strip()
    assert b"PRIVATE KEY" not in upstream.pem


def test_the_bundle_is_certifis_roots_then_the_operators(tmp_path: Path, ca: trustme.CA) -> None:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    bundle = UpstreamCA.read(path).bundle(tmp_path)
    roots = Path(certifi.where()).read_bytes()
    data = bundle.read_bytes()
    assert bundle.parent == tmp_path
    assert data.startswith(roots)
    assert data.rstrip().endswith(ca.cert_pem.bytes().rstrip())


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(None, "does not exist", id="a missing file"),
        pytest.param(b"\n  \n", "is empty", id="an empty file"),
        pytest.param(b"not a certificate\n", "holds no PEM certificate", id="no certificate"),
        pytest.param(
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            "cannot be read",
            id="a corrupt certificate",
        ),
    ],
)
def test_a_file_without_a_readable_certificate_is_refused_naming_the_flag(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "ca.pem"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InvalidInput, match=message) as caught:
        UpstreamCA.read(path)
    assert str(caught.value).startswith(f"--upstream-ca {path}")
