"""botocore's SigV4 signer, imported when the first sigv4 credential is opened (once per policy,
off the request path), not at start: botocore is about 70 modules and 3.6 MiB resident that a
proxy without AWS credentials never uses."""

from __future__ import annotations

import functools
from types import SimpleNamespace

# botocore.auth's values, kept here so that planning a request needs no import (tested equal).
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
STREAMING_UNSIGNED_PAYLOAD_TRAILER = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"


@functools.cache
def botocore() -> SimpleNamespace:
    """SigV4Auth, S3SigV4Auth, AWSRequest and Credentials, imported once."""
    from botocore.auth import S3SigV4Auth, SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    return SimpleNamespace(
        SigV4Auth=SigV4Auth, S3SigV4Auth=S3SigV4Auth, AWSRequest=AWSRequest, Credentials=Credentials
    )
