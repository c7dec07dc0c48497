"""Secrets read from AWS Secrets Manager and Vault KV v2 (addon/proxy/remote.py).

AWS: moto's real HTTP server on 127.0.0.1 (moto[server]), boto3 as the client, as in
production but for the endpoint. Vault: no Vault or OpenBao binary can be installed here, so a
stand-in speaking the documented KV v2 HTTP API (GET /v1/MOUNT/data/PATH, `data.data`,
`X-Vault-Token`, 403 on a bad token, 404 on a missing path) answers hvac, the real client.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from moto.server import ThreadedMotoServer

from addon.proxy.remote import ParameterStore, SecretsManager, Vault
from addon.proxy.sourcekinds import (
    AUTH_FAILED,
    MALFORMED,
    NOT_FOUND,
    PERMISSION_DENIED,
    UNAVAILABLE,
    SourceError,
)
from store.errors import InvalidInput
from store.rules.secretref import parse


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """moto's server, and boto3 pointed at it the way an operator would (environment)."""
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    httpx.post(f"{endpoint}/moto-api/reset")  # moto's state lives in this process: start empty
    monkeypatch.setenv("AWS_ENDPOINT_URL_SECRETS_MANAGER", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("secretsmanager", endpoint_url=endpoint, region_name="us-east-1")
    yield client, server
    server.stop()


def test_a_secret_string_and_a_json_key_are_read_and_a_rotation_is_seen(aws: Any) -> None:
    client, _ = aws
    client.create_secret(Name="prod/gh", SecretString="ghp-one\n")
    client.create_secret(Name="prod/keys", SecretString=json.dumps({"token": "tk-1", "n": 7}))
    backend = SecretsManager()
    assert backend.fetch(parse("aws-sm:prod/gh")) == b"ghp-one"
    assert backend.fetch(parse("aws-sm:prod/keys#token")) == b"tk-1"
    client.put_secret_value(SecretId="prod/gh", SecretString="ghp-two")
    assert backend.fetch(parse("aws-sm:prod/gh")) == b"ghp-two"


@pytest.mark.parametrize(
    ("ref", "error"),
    [
        ("aws-sm:prod/none", NOT_FOUND),
        ("aws-sm:prod/keys#absent", NOT_FOUND),
        ("aws-sm:prod/text#token", MALFORMED),
    ],
)
def test_what_cannot_be_read_is_a_fixed_class(aws: Any, ref: str, error: str) -> None:
    client, _ = aws
    client.create_secret(Name="prod/keys", SecretString=json.dumps({"token": "tk-1"}))
    client.create_secret(Name="prod/text", SecretString="not json")
    with pytest.raises(SourceError) as raised:
        SecretsManager().fetch(parse(ref))
    assert raised.value.kind == error


def test_a_stopped_secrets_manager_is_unavailable(aws: Any) -> None:
    client, server = aws
    client.create_secret(Name="prod/gh", SecretString="ghp-one")
    backend = SecretsManager()
    assert backend.fetch(parse("aws-sm:prod/gh")) == b"ghp-one"
    server.stop()
    with pytest.raises(SourceError) as raised:
        backend.fetch(parse("aws-sm:prod/gh"))
    assert raised.value.kind == UNAVAILABLE
    assert "ghp" not in str(raised.value)


def test_a_securestring_parameter_is_read_decrypted_and_a_new_version_is_seen(
    aws: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, server = aws
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_SSM", endpoint)
    ssm = boto3.client("ssm", endpoint_url=endpoint, region_name="us-east-1")
    ssm.put_parameter(Name="/agents/gh", Value="ssm-one", Type="SecureString")
    backend = ParameterStore()
    assert backend.fetch(parse("aws-ssm:/agents/gh")) == b"ssm-one"
    ssm.put_parameter(Name="/agents/gh", Value="ssm-two", Type="SecureString", Overwrite=True)
    assert backend.fetch(parse("aws-ssm:/agents/gh")) == b"ssm-two"
    with pytest.raises(SourceError) as raised:
        backend.fetch(parse("aws-ssm:/agents/none"))
    assert raised.value.kind == NOT_FOUND


@pytest.mark.parametrize("text", ["aws-ssm:", "aws-ssm:a b", "aws-ssm://double", "aws-ssm:x#y"])
def test_a_parameter_name_that_does_not_parse_is_refused(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse(text)


# -- Vault --------------------------------------------------------------------------------

TOKEN = "hvs.test-token"


class _KV2(BaseHTTPRequestHandler):
    """GET /v1/MOUNT/data/PATH of a KV v2 engine mounted at `secret`."""

    secrets: dict[str, dict[str, Any]] = {}

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.headers.get("X-Vault-Token") != TOKEN:
            return self._answer(403, {"errors": ["permission denied"]})
        prefix = "/v1/secret/data/"
        path = self.path.split("?", 1)[0]
        found = self.secrets.get(path[len(prefix) :]) if path.startswith(prefix) else None
        if found is None:
            return self._answer(404, {"errors": []})
        metadata = {"version": 1, "deletion_time": "", "destroyed": False}
        return self._answer(200, {"data": {"data": found, "metadata": metadata}})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def vault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KV2)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    token_file = tmp_path / "vault-token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("VAULT_ADDR", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("VAULT_TOKEN_FILE", str(token_file))
    _KV2.secrets = {"agents/gh": {"token": "ghp-vault"}}
    yield token_file
    server.shutdown()
    server.server_close()


def test_a_vault_field_is_read_and_the_token_comes_from_its_file(vault: Path) -> None:
    assert Vault().fetch(parse("vault:secret/agents/gh#token")) == b"ghp-vault"


@pytest.mark.parametrize(
    ("ref", "token", "error"),
    [
        ("vault:secret/agents/none#token", TOKEN, NOT_FOUND),
        ("vault:secret/agents/gh#absent", TOKEN, NOT_FOUND),
        ("vault:secret/agents/gh#token", "hvs.wrong", PERMISSION_DENIED),
    ],
)
def test_what_vault_refuses_is_a_fixed_class(
    vault: Path, ref: str, token: str, error: str
) -> None:
    vault.write_text(token)
    with pytest.raises(SourceError) as raised:
        Vault().fetch(parse(ref))
    assert raised.value.kind == error


def test_without_a_token_file_vault_is_never_asked(
    vault: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VAULT_TOKEN_FILE")
    with pytest.raises(SourceError) as raised:
        Vault().fetch(parse("vault:secret/agents/gh#token"))
    assert raised.value.kind == AUTH_FAILED
