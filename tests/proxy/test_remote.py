"""Secrets read from AWS Secrets Manager and Vault KV v2 (addon/proxy/remote.py).

AWS: moto's real HTTP server on 127.0.0.1 (moto[server]), boto3 as the client, as in
production but for the endpoint. Vault: no Vault or OpenBao binary can be installed here, so a
stand-in speaking the documented KV v2 HTTP API (GET /v1/MOUNT/data/PATH, `data.data`,
`X-Vault-Token`, 403 on a bad token, 404 on a missing path) answers hvac, the real client.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
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


JWT = "eyJ.service-account.jwt"
ROLE_ID, SECRET_ID = "role-id-1234", "secret-id-5678"


class _KV2(BaseHTTPRequestHandler):
    """A stand-in for Vault (no Vault or OpenBao binary can be installed here), kept to its
    documented HTTP API: GET /v1/MOUNT/data/PATH of a KV v2 engine mounted at `secret` (the
    latest version, or `?version=N`), POST of a new version there (`{"data": {...}}`, as
    `vault kv put` and hvac write it), and the documented logins: POST
    /v1/auth/kubernetes/login {role, jwt} and /v1/auth/approle/login {role_id, secret_id},
    answering `auth.client_token` and `auth.lease_duration` (400 when refused)."""

    # Each path's versions, oldest first: version N is secrets[path][N - 1].
    secrets: dict[str, list[dict[str, Any]]] = {}
    valid: set[str] = {TOKEN}
    logins: list[str] = []
    lease = 3600

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prefix = "/v1/secret/data/"
        if self.path.startswith(prefix):
            if self.headers.get("X-Vault-Token") not in self.valid:
                return self._answer(403, {"errors": ["permission denied"]})
            versions = self.secrets.setdefault(self.path[len(prefix) :], [])
            versions.append(body["data"])
            return self._answer(200, {"data": {"version": len(versions)}})
        if self.path == "/v1/auth/kubernetes/login":
            accepted = body == {"role": "credproxy", "jwt": JWT}
        elif self.path == "/v1/auth/approle/login":
            accepted = body == {"role_id": ROLE_ID, "secret_id": SECRET_ID}
        else:
            return self._answer(404, {"errors": []})
        if not accepted:
            return self._answer(400, {"errors": ["invalid role or credentials"]})
        token = f"hvs.login-{len(self.logins)}"
        self.logins.append(token)
        self.valid.add(token)
        auth = {"client_token": token, "lease_duration": self.lease, "renewable": True}
        return self._answer(200, {"auth": auth})

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.headers.get("X-Vault-Token") not in self.valid:
            return self._answer(403, {"errors": ["permission denied"]})
        prefix = "/v1/secret/data/"
        path, _, query = self.path.partition("?")
        versions = self.secrets.get(path[len(prefix) :]) if path.startswith(prefix) else None
        asked = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("version")
        number = int(asked) if asked and asked != "0" else len(versions or [])
        if not versions or not 1 <= number <= len(versions):
            return self._answer(404, {"errors": []})
        metadata = {"version": number, "deletion_time": "", "destroyed": False}
        return self._answer(200, {"data": {"data": versions[number - 1], "metadata": metadata}})

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
    _KV2.secrets = {"agents/gh": [{"token": "ghp-vault"}]}
    _KV2.valid, _KV2.logins, _KV2.lease = {TOKEN}, [], 3600
    yield token_file
    server.shutdown()
    server.server_close()


def test_a_vault_field_is_read_and_the_token_comes_from_its_file(vault: Path) -> None:
    assert Vault().fetch(parse("vault:secret/agents/gh#token")) == b"ghp-vault"


def test_a_new_version_written_to_vault_is_what_the_next_fetch_reads(vault: Path) -> None:
    """A rotation as an operator makes it: a new version written with hvac (as `vault kv put`
    does); the reference names no version, so it reads the latest."""
    import hvac

    backend = Vault()
    ref = parse("vault:secret/agents/gh#token")
    assert backend.fetch(ref) == b"ghp-vault"
    client = hvac.Client(url=os.environ["VAULT_ADDR"], token=TOKEN)
    client.secrets.kv.v2.create_or_update_secret("agents/gh", {"token": "ghp-rotated"})
    assert backend.fetch(ref) == b"ghp-rotated"


def test_a_stopped_vault_is_unavailable_and_quotes_nothing(
    vault: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = Vault()
    ref = parse("vault:secret/agents/gh#token")
    assert backend.fetch(ref) == b"ghp-vault"
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: refused at once
    monkeypatch.setenv("VAULT_ADDR", f"http://127.0.0.1:{closed.getsockname()[1]}")
    try:
        with pytest.raises(SourceError) as raised:
            Vault().fetch(ref)
    finally:
        closed.close()
    assert raised.value.kind == UNAVAILABLE
    assert "ghp" not in str(raised.value) and TOKEN not in str(raised.value)


@pytest.mark.parametrize(
    ("ref", "token", "error"),
    [
        ("vault:secret/agents/none#token", TOKEN, NOT_FOUND),
        ("vault:secret/agents/gh#absent", TOKEN, NOT_FOUND),
        ("vault:secret/agents/gh#token", "hvs.wrong", PERMISSION_DENIED),
    ],
)
def test_what_vault_refuses_is_a_fixed_class(vault: Path, ref: str, token: str, error: str) -> None:
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


@pytest.fixture
def logged_in(vault: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No token file: Kubernetes auth with a service-account token file."""
    monkeypatch.delenv("VAULT_TOKEN_FILE")
    jwt = tmp_path / "sa-token"
    jwt.write_text(JWT)
    monkeypatch.setenv("VAULT_K8S_ROLE", "credproxy")
    monkeypatch.setenv("VAULT_K8S_TOKEN_FILE", str(jwt))
    return jwt


def test_kubernetes_auth_logs_in_once_and_again_when_the_token_is_refused(
    logged_in: Path,
) -> None:
    vault, ref = Vault(), parse("vault:secret/agents/gh#token")
    assert vault.fetch(ref) == vault.fetch(ref) == b"ghp-vault"
    assert _KV2.logins == ["hvs.login-0"]  # the login's token is kept for the next fetch
    _KV2.valid.clear()  # revoked
    with pytest.raises(SourceError) as raised:
        vault.fetch(ref)
    assert raised.value.kind == PERMISSION_DENIED
    _KV2.valid.add("hvs.login-1")
    assert vault.fetch(ref) == b"ghp-vault"  # logged in again
    assert _KV2.logins == ["hvs.login-0", "hvs.login-1"]


def test_a_login_is_made_again_at_80_percent_of_its_lease(logged_in: Path) -> None:
    _KV2.lease = 1
    vault, ref = Vault(), parse("vault:secret/agents/gh#token")
    assert vault.fetch(ref) == b"ghp-vault"
    time.sleep(0.85)
    assert vault.fetch(ref) == b"ghp-vault"
    assert len(_KV2.logins) == 2


def test_approle_logs_in_with_its_ids_from_files(
    vault: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VAULT_TOKEN_FILE")
    (tmp_path / "role-id").write_text(ROLE_ID + "\n")
    (tmp_path / "secret-id").write_text(SECRET_ID + "\n")
    monkeypatch.setenv("VAULT_APPROLE_ROLE_ID_FILE", str(tmp_path / "role-id"))
    monkeypatch.setenv("VAULT_APPROLE_SECRET_ID_FILE", str(tmp_path / "secret-id"))
    assert Vault().fetch(parse("vault:secret/agents/gh#token")) == b"ghp-vault"
    assert len(_KV2.logins) == 1


@pytest.mark.parametrize(
    "jwt",
    [
        pytest.param("eyJ.another.jwt", id="a login Vault refuses"),
        pytest.param("x" * (16 * 1024 + 1), id="a service-account token file over 16 KiB"),
        pytest.param("", id="an empty service-account token file"),
    ],
)
def test_a_login_that_fails_is_auth_failed(logged_in: Path, jwt: str) -> None:
    logged_in.write_text(jwt)
    with pytest.raises(SourceError) as raised:
        Vault().fetch(parse("vault:secret/agents/gh#token"))
    assert raised.value.kind == AUTH_FAILED and _KV2.logins == []


def test_a_token_file_over_4_kib_is_auth_failed(vault: Path) -> None:
    vault.write_text("h" * 4097)
    with pytest.raises(SourceError) as raised:
        Vault().fetch(parse("vault:secret/agents/gh#token"))
    assert raised.value.kind == AUTH_FAILED
