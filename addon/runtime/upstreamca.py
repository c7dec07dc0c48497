"""`--upstream-ca`: the operator's CA certificates, read once at start and added to certifi's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import certifi
from cryptography.hazmat.primitives.serialization import Encoding

from store.ca import read_certificates, read_file


@dataclass(frozen=True)
class UpstreamCA:
    path: Path
    pem: bytes  # its certificates alone, whatever else the file held

    @classmethod
    def read(cls, path: Path) -> UpstreamCA:
        """Raises: InvalidInput, when the file is missing, unreadable, empty or holds no
        readable PEM certificate."""
        what = f"--upstream-ca {path}"
        certificates = read_certificates(read_file(path, what), what)
        return cls(path, b"".join(c.public_bytes(Encoding.PEM) for c in certificates))

    def bundle(self, directory: Path) -> Path:
        """certifi's roots plus these, in `directory`: mitmproxy's option replaces, we add."""
        bundle = directory / "upstream-ca-bundle.pem"
        bundle.write_bytes(Path(certifi.where()).read_bytes() + b"\n" + self.pem)
        return bundle
