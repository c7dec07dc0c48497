"""mtls: a client certificate the proxy presents in the TLS handshake to the upstream.

Nothing of it is written on the request. `apply` names, beside the flow and keyed weakly,
what its upstream connection must present (CLIENT_CERTS); addon/mitm/clientcerts.py opens
that connection with it and never lets the connection serve a request of another grant (so
another principal), another credential (or version of it) or another host.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization

from addon.core.reasons import Reason
from addon.schemes.stamp import Refused, Stamp, Stamping
from store.crypto import Secret
from store.errors import InvalidInput
from store.rules import clientcert

if TYPE_CHECKING:
    from mitmproxy import http

    from addon.core.verdict import HeaderScan, Verdict
    from store.records import CredentialRecord

# Who an upstream connection presents the certificate for: grant (one principal's),
# credential, its fingerprint (the version), host, port.
Tag = tuple[int, str, str, str, int]


@dataclass(frozen=True, eq=False, repr=False)
class Presented:
    """A certificate to present, and for whom: an upstream connection's identity."""

    tag: Tag
    cert: clientcert.ClientCert

    def __repr__(self) -> str:
        return f"Presented({self.tag!r}, [secure])"


# The certificate each flow's upstream connection presents (beside the flow: it holds a key).
CLIENT_CERTS: weakref.WeakKeyDictionary[http.HTTPFlow, Presented] = weakref.WeakKeyDictionary()


class MtlsStamp(Stamp):
    """mtls: the request as matched; its certificate goes on the upstream connection."""

    __slots__ = ("cert", "not_before", "not_after", "name", "fingerprint")

    def __init__(self, credential: CredentialRecord) -> None:
        super().__init__(credential)
        self.name, self.fingerprint = credential.name, credential.fingerprint
        self.cert: clientcert.ClientCert | None
        try:
            self.cert = clientcert.parse(Secret(self.secret))
        except InvalidInput:  # a referenced source changed under it: refused, never quoted
            self.cert = None
            self.redacts = (self.secret,)
            return
        found = clientcert.identity(self.cert.chain[0])
        self.not_before, self.not_after = found.not_before, found.not_after
        self.redacts = _key_forms(self.cert)

    @classmethod
    def stored(cls, credential: CredentialRecord) -> tuple[bytes, ...]:
        try:
            return _key_forms(clientcert.parse(credential.secret))
        except InvalidInput as e:
            raise ValueError("not a certificate and key") from e

    def prepare(
        self, verdict: Verdict, request: http.Request, headers: HeaderScan, limit: int
    ) -> Stamping:
        if self.cert is None:
            raise Refused(
                Reason.CREDENTIALS_UNAVAILABLE, "the credential is not a certificate and key"
            )
        now = datetime.now(UTC)
        if now >= self.not_after:
            raise Refused(Reason.CLIENT_CERT_EXPIRED, "the client certificate has expired")
        if now < self.not_before:
            raise Refused(Reason.CLIENT_CERT_EXPIRED, "the client certificate is not valid yet")
        assert verdict.rule is not None and verdict.host is not None
        assert verdict.port is not None
        tag = (verdict.rule.grant_id, self.name, self.fingerprint, verdict.host, verdict.port)
        return _Presenting(self, Presented(tag, self.cert))


class _Presenting(Stamping):
    """One request's: the stamp's fields, and its connection's certificate."""

    __slots__ = ("stamp", "presented")

    def __init__(self, stamp: MtlsStamp, presented: Presented) -> None:
        self.stamp, self.presented = stamp, presented

    def redacted(self) -> tuple[bytes, ...]:
        return self.stamp.redacts

    def apply(self, flow: http.HTTPFlow, path: str, query: bytes | None) -> None:
        self.stamp.apply(flow, path, query)
        CLIENT_CERTS[flow] = self.presented


def _key_forms(cert: clientcert.ClientCert) -> tuple[bytes, ...]:
    """What redaction looks for: the key's PEM, and its base64 lines (a PEM re-wrapped)."""
    pem = cert.key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return (pem, *(line for line in pem.splitlines()[1:-1] if len(line) == 64))
