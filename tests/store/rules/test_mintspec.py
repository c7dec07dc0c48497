"""What the minted-token schemes accept as settings and secrets; messages never quote a
secret."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from store.crypto import Secret
from store.errors import InvalidInput
from store.rules import mintspec, validation

URL = "https://auth.example/oauth/token"


@cache
def pem(kind: str = "rsa") -> str:
    key: Any = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if kind == "rsa"
        else ec.generate_private_key(ec.SECP256R1())
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def google(**change: Any) -> dict[str, Any]:
    key = {
        "type": "service_account",
        "private_key": pem(),
        "client_email": "sa@proj.iam.gserviceaccount.com",
        "token_uri": "https://oauth2.googleapis.com/token",
        "private_key_id": "abc",
    }
    return key | change


@pytest.mark.parametrize(
    ("scheme", "given", "stored"),
    [
        pytest.param(
            "oauth2-client", {"token_url": URL, "scope": ["b", "a", "b"], "audience": "x"},
            {"token_url": URL, "scope": ["a", "b"], "audience": "x"},
            id="scopes sorted and deduplicated",
        ),
        pytest.param(
            "oauth2-refresh", {"token_url": URL, "client_auth": "none", "token_prefix": ""},
            {"token_url": URL, "client_auth": "none", "token_prefix": ""},
            id="a refresh credential without client authentication, a bare token",
        ),
        pytest.param(
            "github-app",
            {"installation": "42", "repository": ["r"], "permission": ["issues=write"],
             "api_url": "https://ghe.example/api/v3/"},
            {"installation": "42", "repository": ["r"], "permission": ["issues=write"],
             "api_url": "https://ghe.example/api/v3"},
            id="a narrowed installation on GitHub Enterprise",
        ),
    ],
)  # fmt: skip
def test_settings_that_are_stored(scheme: str, given: dict[str, Any], stored: dict[str, Any]):
    assert mintspec.options(scheme, given) == stored


@pytest.mark.parametrize(
    ("scheme", "given", "message"),
    [
        pytest.param("oauth2-client", {}, "needs a token_url", id="no token URL"),
        pytest.param("oauth2-client", {"token_url": "http://a.example/t"},
                     "must be an https:// URL", id="a plain-http token URL"),
        pytest.param("oauth2-client", {"token_url": "https://u:p@a.example/t"},
                     "no user, query or fragment", id="a token URL with a password"),
        pytest.param("oauth2-client", {"token_url": "https://A.example/t"},
                     "lower case", id="a token URL host as hosts are not written"),
        pytest.param("oauth2-client", {"token_url": URL, "client_auth": "none"},
                     "use basic or post", id="client credentials without client auth"),
        pytest.param("oauth2-client", {"token_url": URL, "scope": ["a b"]},
                     "one scope token", id="a scope with a space"),
        pytest.param("oauth2-client", {"token_url": URL, "token_prefix": "x\r\n"},
                     "invalid token_prefix", id="a prefix that would split headers"),
        pytest.param("oauth2-client", {"token_url": "https://a.example/t\r\nX-Injected: 1"},
                     "printable ASCII", id="a token URL with CR LF (urlsplit drops them)"),
        pytest.param("oauth2-client", {"token_url": "https://a.example/o auth"},
                     "printable ASCII", id="a token URL with a space"),
        pytest.param("oauth2-client", {"token_url": "https://a.example/\tt"},
                     "printable ASCII", id="a token URL with a tab"),
        pytest.param("github-app", {"installation": "1", "api_url": "https://a.example/\napi"},
                     "printable ASCII", id="github: an API URL with a newline"),
        pytest.param("google-service-account", {}, "at least one scope", id="google: no scope"),
        pytest.param("google-service-account", {"scope": ["s"], "subject": "nobody"},
                     "invalid subject", id="google: a subject that is no address"),
        pytest.param("github-app", {"installation": "0x1"}, "needs an installation",
                     id="github: an installation id that is not digits"),
        pytest.param("github-app", {"installation": "1", "repository": ["o/r"]},
                     "without its owner", id="github: a repository with its owner"),
        pytest.param("github-app", {"installation": "1",
                                    "permission": ["contents=read", "contents=write"]},
                     "one permission twice", id="github: a permission given twice"),
    ],
)  # fmt: skip
def test_settings_that_are_refused(scheme: str, given: dict[str, Any], message: str):
    with pytest.raises(InvalidInput, match=message):
        mintspec.options(scheme, given)


def test_other_schemes_options_do_not_go_with_a_minted_scheme():
    with pytest.raises(InvalidInput, match="region does not go with scheme oauth2-client"):
        validation.credential_options("oauth2-client", {"region": "us-east-1"}, [])
    with pytest.raises(InvalidInput, match="token_url does not go with scheme bearer"):
        validation.credential_options("bearer", {"token_url": URL}, [])


@pytest.mark.parametrize(
    ("scheme", "options", "secret", "message"),
    [
        pytest.param("oauth2-client", {}, '{"client_id": "a", "client_secret": "S3CRET\\n"}',
                     "printable ASCII", id="a client secret with a newline"),
        pytest.param("oauth2-client", {}, '{"client_id": "a", "client_id": "b"}',
                     "names a field twice", id="a field given twice"),
        pytest.param("oauth2-client", {}, '["S3CRET"]', "must be JSON", id="not an object"),
        pytest.param("oauth2-client", {}, '{"client_id": null, "client_secret": "S3CRET"}',
                     "client_id must be a string", id="a null client id"),
        pytest.param("oauth2-client", {}, '{"client_id": "a", "client_secret": null}',
                     "client_secret must be a string", id="a null client secret"),
        pytest.param("oauth2-refresh", {"client_auth": "none"},
                     '{"client_id": "a", "refresh_token": null}',
                     "refresh_token must be a string", id="a null refresh token"),
        pytest.param("oauth2-refresh", {},
                     '{"client_id": "a", "client_secret": null, "refresh_token": "S3CRET"}',
                     "client_secret must be a string", id="a null optional client secret"),
        pytest.param("google-service-account", {}, json.dumps(google(client_email=None)),
                     "client_email must be a string", id="google: a null client e-mail"),
        pytest.param("google-service-account", {}, json.dumps(google(token_uri=None)),
                     "token_uri must be a string", id="google: a null token_uri"),
        pytest.param("oauth2-refresh", {"client_auth": "post"},
                     '{"client_id": "a", "refresh_token": "S3CRET"}',
                     "lacks client_secret", id="post client auth without a client secret"),
        pytest.param("oauth2-refresh", {"client_auth": "none"},
                     '{"client_id": "a", "client_secret": "S3CRET", "refresh_token": "r"}',
                     "does not go with client_auth none", id="a client secret with auth none"),
        pytest.param("google-service-account", {}, json.dumps(google(private_key=pem("ec"))),
                     "must be an RSA key", id="google: an EC key"),
        pytest.param("google-service-account", {}, json.dumps(google(client_email="S3CRET")),
                     "not an e-mail address", id="google: no client e-mail"),
        pytest.param("github-app", {}, json.dumps({"app_id": True, "private_key": pem()}),
                     "numeric id", id="github: an app id that is a bool"),
        pytest.param("github-app", {}, '{"app_id": 1, "private_key": "S3CRET"}',
                     "not a PEM private key", id="github: a key that does not parse"),
    ],
)  # fmt: skip
def test_secrets_that_are_refused_without_quoting_them(
    scheme: str, options: dict[str, Any], secret: str, message: str
):
    with pytest.raises(InvalidInput, match=message) as raised:
        validation.scheme_secret(scheme, Secret(secret.encode()), options)
    assert "S3CRET" not in str(raised.value) and "PRIVATE" not in str(raised.value)


def test_a_key_file_is_stored_compact_and_its_hints_listed():
    stored = validation.scheme_secret(
        "google-service-account", Secret(json.dumps(google(), indent=2).encode()), {}
    )
    assert b"\n" not in stored.reveal()
    assert validation.secret_hint("google-service-account", stored) == {
        "client_email": "sa@proj.iam.gserviceaccount.com",
        "token_uri": "https://oauth2.googleapis.com/token",
    }
    app = validation.scheme_secret(
        "github-app", Secret(json.dumps({"app_id": 12, "private_key": pem()}).encode()), {}
    )
    assert validation.secret_hint("github-app", app) == {"app_id": "12"}
