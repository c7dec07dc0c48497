"""AWS endpoint names -> SigV4 scopes: derived only where AWS's naming makes them certain."""

from __future__ import annotations

import pytest

from store.rules.aws import Scope, derive, representative, scope_of


@pytest.mark.parametrize(
    ("host", "scope"),
    [
        pytest.param(
            "bedrock-runtime.us-east-1.amazonaws.com",
            Scope("bedrock", "us-east-1", False),
            id="bedrock-runtime signs as bedrock, not as its first label",
        ),
        pytest.param(
            "bedrock-agent-runtime.eu-central-1.amazonaws.com",
            Scope("bedrock", "eu-central-1", False),
            id="bedrock-agent-runtime signs as bedrock",
        ),
        pytest.param(
            "sqs.eu-west-1.amazonaws.com", Scope("sqs", "eu-west-1", False), id="a regional service"
        ),
        pytest.param(
            "s3.eu-west-1.amazonaws.com", Scope("s3", "eu-west-1", True), id="S3 path style"
        ),
        pytest.param(
            "mybucket.s3.eu-west-1.amazonaws.com",
            Scope("s3", "eu-west-1", True),
            id="S3 virtual-hosted",
        ),
        pytest.param(
            "my.dotted.bucket.s3.dualstack.ap-south-1.amazonaws.com",
            Scope("s3", "ap-south-1", True),
            id="S3 dualstack with a dotted bucket",
        ),
        pytest.param(
            "mybucket.s3.amazonaws.com", Scope("s3", "us-east-1", True), id="S3's global name"
        ),
        pytest.param(
            "s3-us-west-2.amazonaws.com", Scope("s3", "us-west-2", True), id="S3's legacy dash"
        ),
        pytest.param(
            "sts.amazonaws.com", Scope("sts", "us-east-1", False), id="STS's global endpoint"
        ),
        pytest.param(
            "iam.amazonaws.com", Scope("iam", "us-east-1", False), id="IAM's global endpoint"
        ),
        pytest.param(
            "sts.us-gov-west-1.amazonaws.com",
            Scope("sts", "us-gov-west-1", False),
            id="a GovCloud region",
        ),
        pytest.param(
            "abc123.execute-api.eu-west-1.amazonaws.com",
            Scope("execute-api", "eu-west-1", False),
            id="API Gateway",
        ),
        pytest.param(
            "kms-fips.us-east-1.amazonaws.com",
            Scope("kms", "us-east-1", False),
            id="a FIPS endpoint",
        ),
        pytest.param("example.com", None, id="not AWS"),
        pytest.param("amazonaws.com", None, id="no service"),
        pytest.param("nosuchservice.us-east-1.amazonaws.com", None, id="an unknown prefix"),
        pytest.param("sqs.amazonaws.com", None, id="a regional service without region"),
        pytest.param("sqs.mars-north-1x.amazonaws.com", None, id="not a region"),
        pytest.param("bucket.amazonaws.com", None, id="a wildcard over everything"),
        pytest.param("amazonaws.com.evil.test", None, id="AWS's suffix inside another name"),
    ],
)
def test_derive(host: str, scope: Scope | None) -> None:
    assert derive(host) == scope


def test_flags_complete_or_override_what_the_host_says() -> None:
    assert scope_of("bucket.amazonaws.com", "execute-api", "eu-west-1") == Scope(
        "execute-api", "eu-west-1", False
    )
    assert scope_of("vpce-1.sqs.example.internal", "sqs", None) is None
    assert scope_of("sqs.eu-west-1.amazonaws.com", None, "eu-west-2") == Scope(
        "sqs", "eu-west-2", False
    )
    assert scope_of("proxy.internal", "s3", "eu-west-1") == Scope("s3", "eu-west-1", True)


def test_a_wildcard_pattern_stands_for_one_label() -> None:
    assert representative("*.s3.eu-west-1.amazonaws.com:443") == "bucket.s3.eu-west-1.amazonaws.com"
    assert representative("sts.amazonaws.com") == "sts.amazonaws.com"
