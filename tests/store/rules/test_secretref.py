"""Secret references: what parses, and one line without the text for what does not."""

import pytest

from store.errors import InvalidInput
from store.rules.secretref import SecretRef, for_scheme, parse


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        pytest.param("file:/run/secrets/gh", SecretRef("file", "/run/secrets/gh"), id="a file"),
        pytest.param("aws-sm:prod/gh", SecretRef("aws-sm", "prod/gh"), id="a secret id"),
        pytest.param(
            "aws-sm:arn:aws:secretsmanager:eu-west-1:123456789012:secret:gh-AbCd#token",
            SecretRef(
                "aws-sm", "arn:aws:secretsmanager:eu-west-1:123456789012:secret:gh-AbCd", "token"
            ),
            id="an ARN and a JSON key",
        ),
        pytest.param(
            "vault:secret/agents/gh#token",
            SecretRef("vault", "secret/agents/gh", "token"),
            id="a KV v2 mount, path and field",
        ),
    ],
)
def test_references_parse_and_print_back(text: str, ref: SecretRef) -> None:
    assert parse(text) == ref
    assert str(ref) == text


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("ghp_SECRETVALUE123", id="a pasted secret is no reference"),
        pytest.param("file:relative/ghp_SECRETVALUE123", id="a file reference is absolute"),
        pytest.param("file:/run/secrets/", id="a file reference names a file"),
        pytest.param("file:/run/ghp_SECRETVALUE123\n", id="no control characters"),
        pytest.param("aws-sm:has space ghp_SECRETVALUE123", id="a secret id has no spaces"),
        pytest.param("vault:secret/gh", id="a vault reference names its field"),
        pytest.param("vault:gh#ghp_SECRETVALUE123", id="a vault reference has a mount and path"),
        pytest.param("vault:secret/../gh#token", id="a vault path has no dot-dot"),
        pytest.param("env:ghp_SECRETVALUE123", id="an unknown kind"),
    ],
)
def test_what_does_not_parse_is_one_line_that_does_not_quote_it(text: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse(text)
    message = str(refused.value)
    assert "\n" not in message and "SECRETVALUE" not in message and text not in message


def test_a_refresh_tokens_credential_cannot_be_a_reference() -> None:
    """Its tokens are sealed back into the store on every refresh."""
    with pytest.raises(InvalidInput, match="cannot hold a secret reference"):
        for_scheme("oauth2-refresh", "file:/run/secrets/tokens")
    assert for_scheme("bearer", "file:/run/secrets/gh") == "file:/run/secrets/gh"


def test_a_reference_is_at_most_2048_characters() -> None:
    longest = "file:/" + "a" * (2048 - len("file:/"))
    assert str(parse(longest)) == longest
    with pytest.raises(InvalidInput, match="at most 2048 characters"):
        parse(longest + "a")
