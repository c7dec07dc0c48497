"""Secrets read from a remote store: AWS Secrets Manager and SSM Parameter Store (boto3) and
HashiCorp Vault KV v2 (hvac). Imported only when a reference of theirs is used; their
libraries are optional extras (`pip install 'credproxy[aws]'`, `'credproxy[vault]'`).

credproxy authenticates to each as itself, from its own environment, never from the store:
- AWS: boto3's standard chain (environment, shared profile, web identity / IRSA, IMDS);
  AWS_REGION or AWS_DEFAULT_REGION, or the region in an ARN. AWS_ENDPOINT_URL_SECRETS_MANAGER
  (or AWS_ENDPOINT_URL) points it elsewhere, as boto3 reads it.
- Vault: VAULT_ADDR, and a token read from VAULT_TOKEN_FILE (never an environment value
  holding the token itself); VAULT_CACERT for a private CA; VAULT_NAMESPACE if set.

Every failure is one of sourcekinds' fixed classes: a backend's own text (an exception's
message, a response body) is never kept, logged or shown. Values are fetched again every
`--secret-ttl` (they are not watched).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from addon.proxy.sourcekinds import (
    AUTH_FAILED,
    MALFORMED,
    NOT_FOUND,
    PERMISSION_DENIED,
    UNAVAILABLE,
    SourceError,
    trimmed,
)
from store.rules.secretref import SecretRef

TIMEOUT = 10.0  # seconds, for one call to a backend


def _json_key(raw: str | bytes, key: str | None) -> bytes:
    """The value, or one string (or number) of a JSON object's key. Raises: SourceError."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        raise SourceError(MALFORMED) from None
    if key is None:
        return trimmed(text.encode("utf-8"))
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        raise SourceError(MALFORMED) from None
    if not isinstance(found, dict) or key not in found:
        raise SourceError(NOT_FOUND)
    value = found[key]
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise SourceError(MALFORMED)
    return trimmed(str(value).encode("utf-8"))


def _aws_error(e: Exception, *missing: str) -> SourceError:
    """An AWS call's failure as a fixed class; `missing` are the service's not-found codes."""
    import botocore.exceptions

    if isinstance(e, botocore.exceptions.NoCredentialsError):
        return SourceError(AUTH_FAILED)
    if not isinstance(e, botocore.exceptions.ClientError):
        return SourceError(UNAVAILABLE)
    code = e.response.get("Error", {}).get("Code", "")
    if code in missing:
        return SourceError(NOT_FOUND)
    if code in ("AccessDeniedException", "AccessDenied"):
        return SourceError(PERMISSION_DENIED)
    if code in ("UnrecognizedClientException", "InvalidSignatureException"):
        return SourceError(AUTH_FAILED)
    return SourceError(UNAVAILABLE)


class SecretsManager:
    """aws-sm:SECRET_ID[#JSON_KEY]: the secret's current string (its AWSCURRENT version)."""

    watched = False

    def __init__(self) -> None:
        import boto3  # noqa: F401 - ImportError here: the `aws` extra is not installed
        import botocore.config

        self._config = botocore.config.Config(
            connect_timeout=TIMEOUT, read_timeout=TIMEOUT, retries={"max_attempts": 2}
        )
        self._clients: dict[str | None, Any] = {}
        self._lock = threading.Lock()

    def _client(self, region: str | None) -> Any:
        import boto3

        with self._lock:
            found = self._clients.get(region)
            if found is None:
                session = boto3.session.Session()
                found = session.client("secretsmanager", region_name=region, config=self._config)
                self._clients[region] = found
            return found

    def identity(self, ref: SecretRef) -> object:
        return None  # not watched: fetched every ttl

    def fetch(self, ref: SecretRef) -> bytes:
        import botocore.exceptions

        # An ARN names its region (arn:aws:secretsmanager:REGION:...); a name uses the default.
        parts = ref.target.split(":")
        region = parts[3] if ref.target.startswith("arn:") and len(parts) > 3 else None
        try:
            answer = self._client(region).get_secret_value(SecretId=ref.target)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as e:
            raise _aws_error(e, "ResourceNotFoundException") from None
        if "SecretString" in answer:
            return _json_key(answer["SecretString"], ref.key)
        if ref.key is not None:
            raise SourceError(MALFORMED)  # a binary secret has no keys
        return trimmed(bytes(answer.get("SecretBinary", b"")))


class ParameterStore(SecretsManager):
    """aws-ssm:NAME: a Parameter Store parameter's value, decrypted (a SecureString's)."""

    def _client(self, region: str | None) -> Any:
        import boto3

        key = f"ssm:{region}"
        with self._lock:
            found = self._clients.get(key)
            if found is None:
                session = boto3.session.Session()
                found = session.client("ssm", region_name=region, config=self._config)
                self._clients[key] = found
            return found

    def fetch(self, ref: SecretRef) -> bytes:
        import botocore.exceptions

        parts = ref.target.split(":")
        region = parts[3] if ref.target.startswith("arn:") and len(parts) > 3 else None
        try:
            answer = self._client(region).get_parameter(Name=ref.target, WithDecryption=True)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as e:
            raise _aws_error(e, "ParameterNotFound", "ParameterVersionNotFound") from None
        value = answer.get("Parameter", {}).get("Value")
        if not isinstance(value, str):
            raise SourceError(MALFORMED)
        return trimmed(value.encode("utf-8"))


class Vault:
    """vault:MOUNT/PATH#FIELD: one field of a KV version 2 secret's latest version."""

    watched = False

    def __init__(self) -> None:
        import hvac  # noqa: F401 - ImportError here: the `vault` extra is not installed

        self._address = os.environ.get("VAULT_ADDR")
        self._token_file = os.environ.get("VAULT_TOKEN_FILE")
        self._verify: str | bool = os.environ.get("VAULT_CACERT") or True
        self._namespace = os.environ.get("VAULT_NAMESPACE")

    def identity(self, ref: SecretRef) -> object:
        return None  # not watched: fetched every ttl

    def _token(self) -> str:
        if not self._token_file:
            raise SourceError(AUTH_FAILED)
        try:
            with open(self._token_file, "rb") as f:
                return trimmed(f.read(4096 + 2)).decode("ascii")
        except (OSError, UnicodeDecodeError, SourceError):
            raise SourceError(AUTH_FAILED) from None

    def fetch(self, ref: SecretRef) -> bytes:
        import hvac
        import hvac.exceptions
        import requests

        if not self._address:
            raise SourceError(UNAVAILABLE)
        client = hvac.Client(
            url=self._address,
            token=self._token(),  # read again each time: a rotated token file is used
            verify=self._verify,
            timeout=TIMEOUT,
            namespace=self._namespace,
        )
        try:
            answer = client.secrets.kv.v2.read_secret_version(
                path=ref.path, mount_point=ref.mount, raise_on_deleted_version=True
            )
        except hvac.exceptions.InvalidPath:
            raise SourceError(NOT_FOUND) from None
        except hvac.exceptions.Unauthorized:
            raise SourceError(AUTH_FAILED) from None
        except hvac.exceptions.Forbidden:  # a bad token or a policy without this path
            raise SourceError(PERMISSION_DENIED) from None
        except (hvac.exceptions.VaultError, requests.RequestException, OSError, ValueError):
            raise SourceError(UNAVAILABLE) from None
        try:
            data = answer["data"]["data"]
        except (KeyError, TypeError):
            raise SourceError(MALFORMED) from None
        if not isinstance(data, dict) or ref.key not in data:
            raise SourceError(NOT_FOUND)
        value = data[ref.key]
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise SourceError(MALFORMED)
        return trimmed(str(value).encode("utf-8"))
