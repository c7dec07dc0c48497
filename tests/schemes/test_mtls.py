"""The mtls Stamp: nothing on the request, the certificate named for the flow's connection,
refused when out of its validity; no key in any repr."""

from __future__ import annotations

import datetime
from types import SimpleNamespace
from typing import Any

import pytest
import trustme
from mitmproxy.test import tflow

from addon.core.reasons import Reason
from addon.schemes.mtls import CLIENT_CERTS, MtlsStamp
from addon.schemes.stamp import Refused
from addon.schemes.stamping import redacted, stamp_of
from store.crypto import Secret
from store.records import CredentialRecord
from store.rules import clientcert


def _record(**validity: Any) -> CredentialRecord:
    leaf = trustme.CA().issue_cert("agent.clients.test", **validity)
    secret = Secret(leaf.private_key_and_cert_chain_pem.bytes())
    if not validity:
        secret = clientcert.secret(secret)  # as the store seals it
    return CredentialRecord("cc", "mtls", None, None, (), secret, "fp-1")


def _verdict() -> Any:
    return SimpleNamespace(rule=SimpleNamespace(grant_id=7), host="api.test", port=443)


def test_the_certificate_goes_on_the_connection_not_the_request() -> None:
    stamp = stamp_of(_record())
    assert isinstance(stamp, MtlsStamp)
    flow = tflow.tflow()
    before = list(flow.request.headers.fields)
    stamping = stamp.prepare(_verdict(), flow.request, SimpleNamespace(), 0)
    stamping.apply(flow, "/x", None)
    assert [f for f in flow.request.headers.fields if f not in before] == [
        (b"accept-encoding", b"identity")
    ]
    presented = CLIENT_CERTS[flow]
    assert presented.tag == (7, "cc", "fp-1", "api.test", 443)


@pytest.mark.parametrize(
    "shift, detail",
    [
        pytest.param(-1, "the client certificate has expired", id="an expired certificate"),
        pytest.param(1, "the client certificate is not valid yet", id="one not valid yet"),
    ],
)
def test_out_of_its_validity_it_is_refused(shift: int, detail: str) -> None:
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)
    validity = (
        {"not_before": now - 2 * day, "not_after": now - day}
        if shift < 0
        else {"not_before": now + day, "not_after": now + 2 * day}
    )
    stamp = stamp_of(_record(**validity))
    with pytest.raises(Refused) as e:
        stamp.prepare(_verdict(), tflow.tflow().request, SimpleNamespace(), 0)
    assert (e.value.reason, e.value.detail) == (Reason.CLIENT_CERT_EXPIRED, detail)


def test_no_key_in_a_repr_and_the_key_is_redacted() -> None:
    record = _record()
    stamp = stamp_of(record)
    stamping = stamp.prepare(_verdict(), tflow.tflow().request, SimpleNamespace(), 0)
    key = record.secret.reveal().split(b"-----END CERTIFICATE-----\n")[-1]
    body = key.splitlines()[1]
    for shown in (repr(stamp), repr(stamping), repr(stamping.presented)):
        assert "PRIVATE" not in shown and body.decode() not in shown
    forms = redacted(record)
    assert any(b"PRIVATE KEY" in f for f in forms)
    assert body in forms


def test_a_secret_that_is_no_certificate_refuses_every_request() -> None:
    record = CredentialRecord("cc", "mtls", None, None, (), Secret(b"not-pem"), "fp-1")
    with pytest.raises(Refused) as e:
        stamp_of(record).prepare(_verdict(), tflow.tflow().request, SimpleNamespace(), 0)
    assert e.value.reason == Reason.CREDENTIALS_UNAVAILABLE
