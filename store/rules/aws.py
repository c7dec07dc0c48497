"""AWS endpoint names -> the scope SigV4 signs for: (signing name, region, S3's variant or not).

A scope is derived only where AWS's endpoint naming makes it certain: a known endpoint prefix
in a region (`bedrock-runtime.us-east-1.amazonaws.com` signs as `bedrock`), S3 in its path
and virtual-hosted forms, and the global endpoints. Anything else needs `--service` and
`--region`. The prefix -> signing name table comes from botocore's service models
(`metadata.endpointPrefix` -> `metadata.signingName`), saved in aws_signing_names.json.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import NamedTuple

from store.rules.grammar import parse_host

SUFFIXES = (".amazonaws.com", ".amazonaws.com.cn")
_REGION = re.compile(r"[a-z]{2}(?:-gov|-iso[a-z]?)?-[a-z]+-\d{1,2}")
# Served from one region whatever the client's: they sign for us-east-1.
GLOBAL = {
    "sts": "sts",
    "iam": "iam",
    "route53": "route53",
    "cloudfront": "cloudfront",
    "waf": "waf",
    "s3": "s3",
    "s3-external-1": "s3",
}
# Labels that carry S3 in front of a region (`s3.eu-west-1`, `s3-fips.us-east-1`, ...).
S3_LABELS = frozenset(
    ("s3", "s3-fips", "s3-control", "s3-accesspoint", "s3-accesspoint-fips", "s3-object-lambda")
)
SERVICE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


class Scope(NamedTuple):
    service: str
    region: str
    s3: bool  # S3's variant: the path signed as sent, x-amz-content-sha256 always set


@functools.cache
def _signing_names() -> dict[str, tuple[str, bool]]:
    raw = json.loads((Path(__file__).with_name("aws_signing_names.json")).read_text())
    return {prefix: (name, version == "s3v4") for prefix, (name, version) in raw.items()}


def is_region(text: str) -> bool:
    return _REGION.fullmatch(text) is not None


def derive(host: str) -> Scope | None:
    """The scope of an AWS endpoint name (lower-case, no port), or None if not certain.

    A leading `*.` (a wildcard host pattern) reads as one bucket or account label.
    """
    suffix = next((s for s in SUFFIXES if host.endswith(s)), None)
    if suffix is None:
        return None
    labels = host[: -len(suffix)].split(".")
    if labels == [""] or "" in labels:
        return None
    s3 = _s3(labels)
    if s3 is not None:
        return s3
    if len(labels) == 1:
        service = GLOBAL.get(labels[0])
        if service is None or suffix != ".amazonaws.com":
            return None
        return Scope(service, "us-east-1", service == "s3")
    *prefix_labels, region = labels
    if not is_region(region):
        return None
    prefix = ".".join(prefix_labels)
    if prefix.endswith("-fips"):
        prefix = prefix[: -len("-fips")]
    known = _signing_names().get(prefix)
    if known is None and len(prefix_labels) == 2 and prefix_labels[1] == "execute-api":
        known = ("execute-api", False)  # API Gateway: ID.execute-api.REGION
    if known is None:
        return None
    return Scope(known[0], region, known[1])


def _s3(labels: list[str]) -> Scope | None:
    """S3's path-style and virtual-hosted names, with or without a bucket in front."""
    last = labels[-1]
    if last in ("s3", "s3-external-1"):
        return Scope("s3", "us-east-1", True)  # s3.amazonaws.com, BUCKET.s3.amazonaws.com
    if last.startswith("s3-") and is_region(last[3:]):
        return Scope("s3", last[3:], True)  # legacy s3-REGION
    if len(labels) < 2 or not is_region(last):
        return None
    before = labels[-2]
    if before == "dualstack" and len(labels) >= 3:
        before = labels[-3]
    if before in S3_LABELS:
        return Scope("s3", last, True)
    return None


def representative(spec: str) -> str:
    """A host a credential's host pattern stands for: its name, a wildcard as one label."""
    pattern = parse_host(spec)
    return "bucket" + pattern.host[1:] if pattern.wildcard else pattern.host


def scope_of(host: str, service: str | None, region: str | None) -> Scope | None:
    """The scope for `host`: the credential's --service / --region where given, else derived."""
    derived = derive(host)
    if service is None and derived is None:
        return None
    name = service if service is not None else derived.service  # type: ignore[union-attr]
    where = region if region is not None else (derived.region if derived else None)
    if where is None:
        return None
    s3 = name == "s3" if service is not None else derived.s3  # type: ignore[union-attr]
    return Scope(name, where, s3)
