"""The store's checks name no CLI flag; the CLI words the inputs they name as its flags."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from addon.cli.cli import worded
from store.errors import InvalidInput
from store.rules import validation


def _spec_without_hosts() -> validation.GrantSpec:
    return validation.grant_spec(["GET"], [], [], None)


WORDINGS = [
    pytest.param(
        lambda: validation.credential_hosts([]),
        "a credential needs at least one host",
        "a credential needs at least one --host",
        id="a credential without hosts",
    ),
    pytest.param(
        lambda: validation.scheme_options("header", None, None),
        "a header name goes with scheme header or a minted-token scheme, and only with them",
        "--header NAME goes with --scheme header or a minted-token scheme, and only with them",
        id="the header scheme without a header name",
    ),
    pytest.param(
        lambda: validation.scheme_options("bearer", None, "key"),
        "a parameter name goes with scheme query, and only with it",
        "--param NAME goes with --scheme query, and only with it",
        id="a parameter name with another scheme",
    ),
    pytest.param(
        lambda: validation.grant_spec([], ["example.com"], [], None),
        "a grant needs at least one method (or '*')",
        "a grant needs at least one --method (or '*')",
        id="a grant without methods",
    ),
    pytest.param(
        lambda: validation.grant_spec(["*", "GET"], ["example.com"], [], None),
        "method '*' already allows every method",
        "--method '*' already allows every method",
        id="a grant with '*' and another method",
    ),
    pytest.param(
        lambda: validation.within_credential(_spec_without_hosts(), None, []),
        "a grant without a credential needs at least one host",
        "a grant without --credential needs at least one --host",
        id="a grant with neither credential nor host",
    ),
    pytest.param(
        lambda: validation.approvable_path(7, "/{x}/*"),
        "request 7's path /{x}/* has a '*' segment, which a grant reads as any segment: "
        "approve it with a path pattern",
        "request 7's path /{x}/* has a '*' segment, which a grant reads as any segment: "
        "approve it with --path",
        id="approving a requested path with a '*' segment as it stands",
    ),
]


@pytest.mark.parametrize(("check", "plain", "cli"), WORDINGS)
def test_a_message_names_inputs_plainly_and_the_cli_words_them_as_flags(
    check: Callable[[], object], plain: str, cli: str
) -> None:
    with pytest.raises(InvalidInput) as raised:
        check()
    assert str(raised.value) == plain
    assert "--" not in str(raised.value)
    assert worded(raised.value) == cli


def test_a_message_without_inputs_reads_the_same_to_the_cli() -> None:
    with pytest.raises(InvalidInput) as raised:
        validation.request_state("{open}")
    assert (
        worded(raised.value)
        == str(raised.value)
        == ("invalid state '{open}': use one of pending, approved, denied, expired")
    )


@pytest.mark.parametrize("name", ["HTTPS_PROXY", "no_proxy", "SSL_CERT_FILE", "NODE_USE_ENV_PROXY"])
def test_a_placeholder_never_takes_the_place_of_a_variable_exec_sets(name: str) -> None:
    from store.errors import InvalidInput
    from store.rules.validation import env_name

    with pytest.raises(InvalidInput, match="exec sets for the proxy itself"):
        env_name(name)
