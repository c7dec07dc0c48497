"""Secrets read from a remote store: AWS Secrets Manager and SSM Parameter Store (boto3) and
HashiCorp Vault KV v2 (hvac). Imported only when a reference of theirs is used; their
libraries are optional extras (`pip install 'credproxy[aws]'`, `'credproxy[vault]'`).

credproxy authenticates to each as itself, from its own environment, never from the store:
- AWS: boto3's standard chain (environment, shared profile, web identity / IRSA, IMDS);
  AWS_REGION or AWS_DEFAULT_REGION, or the region in an ARN. AWS_ENDPOINT_URL_SECRETS_MANAGER
  (or AWS_ENDPOINT_URL) points it elsewhere, as boto3 reads it.
- Vault: VAULT_ADDR, and a token read from VAULT_TOKEN_FILE (never an environment value
  holding the token itself), else a login with Kubernetes auth (VAULT_K8S_ROLE) or AppRole
  (VAULT_APPROLE_ROLE_ID_FILE, VAULT_APPROLE_SECRET_ID_FILE); VAULT_CACERT for a private CA;
  VAULT_NAMESPACE if set.

Every failure is one of sourcekinds' fixed classes: a backend's own text (an exception's
message, a response body) is never kept, logged or shown. Values are fetched again every
`--secret-ttl` (they are not watched).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
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
TOKEN_FILE_LIMIT = 4096  # a Vault token, an AppRole role id or secret id
JWT_FILE_LIMIT = 16 * 1024  # a Kubernetes service-account token
SERVICE_ACCOUNT_JWT = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def _small_file(path: str, limit: int) -> str:
    """A credential of credproxy's own, from its file: ASCII, one trailing newline off, at
    most `limit` bytes. Raises SourceError (auth-failed)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 3)
        text = trimmed(raw).decode("ascii")
    except (OSError, UnicodeDecodeError, SourceError):
        raise SourceError(AUTH_FAILED) from None
    if len(text) > limit or not text.isprintable():
        raise SourceError(AUTH_FAILED)
    return text


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
    """vault:MOUNT/PATH#FIELD: one field of a KV version 2 secret's latest version.

    Logged in with a token file (VAULT_TOKEN_FILE), else with Kubernetes auth (VAULT_K8S_ROLE
    and the pod's service-account token) or AppRole (VAULT_APPROLE_ROLE_ID_FILE and
    VAULT_APPROLE_SECRET_ID_FILE): the token a login gives is kept until 80 % of its lease,
    or until Vault refuses it, then the next fetch logs in again."""

    watched = False

    def __init__(self) -> None:
        import hvac  # noqa: F401 - ImportError here: the `vault` extra is not installed

        env = os.environ
        self._address = env.get("VAULT_ADDR")
        self._token_file = env.get("VAULT_TOKEN_FILE")
        self._verify: str | bool = env.get("VAULT_CACERT") or True
        self._namespace = env.get("VAULT_NAMESPACE")
        self._k8s_role = env.get("VAULT_K8S_ROLE")
        self._k8s_mount = env.get("VAULT_K8S_MOUNT") or "kubernetes"
        self._k8s_jwt = env.get("VAULT_K8S_TOKEN_FILE") or SERVICE_ACCOUNT_JWT
        self._role_id = env.get("VAULT_APPROLE_ROLE_ID_FILE")
        self._secret_id = env.get("VAULT_APPROLE_SECRET_ID_FILE")
        self._approle_mount = env.get("VAULT_APPROLE_MOUNT") or "approle"
        self._lock = threading.Lock()  # one login at a time: fetches run in a pool
        self._login: tuple[str, float] | None = None  # the token, and when to log in again

    def identity(self, ref: SecretRef) -> object:
        return None  # not watched: fetched every ttl

    def _token(self, client: Any) -> tuple[str, bool]:
        """The token to read with, and whether a login gave it. Raises SourceError."""
        if self._token_file:
            return _small_file(self._token_file, TOKEN_FILE_LIMIT), False
        if not self._k8s_role and not self._role_id:
            raise SourceError(AUTH_FAILED)
        with self._lock:
            if self._login is not None and time.monotonic() < self._login[1]:
                return self._login[0], True
            self._login = None
            answer = self._log_in(client)
            try:
                token = answer["auth"]["client_token"]
                lease = float(answer["auth"].get("lease_duration") or 0)
            except (KeyError, TypeError, ValueError):
                raise SourceError(AUTH_FAILED) from None
            if not isinstance(token, str) or not token:
                raise SourceError(AUTH_FAILED)
            # A lease of 0 never expires: kept until Vault refuses it.
            self._login = (token, time.monotonic() + (lease * 0.8 if lease > 0 else math.inf))
            return token, True

    def _log_in(self, client: Any) -> Any:
        import hvac.exceptions
        import requests

        try:
            if self._k8s_role:
                jwt = _small_file(self._k8s_jwt, JWT_FILE_LIMIT)
                return client.auth.kubernetes.login(
                    self._k8s_role, jwt, use_token=False, mount_point=self._k8s_mount
                )
            role_id = _small_file(self._role_id or "", TOKEN_FILE_LIMIT)
            secret_id = _small_file(self._secret_id, TOKEN_FILE_LIMIT) if self._secret_id else None
            return client.auth.approle.login(
                role_id, secret_id, use_token=False, mount_point=self._approle_mount
            )
        except (
            requests.RequestException,
            OSError,
            hvac.exceptions.VaultDown,
            hvac.exceptions.InternalServerError,
            hvac.exceptions.BadGateway,
        ):
            raise SourceError(UNAVAILABLE) from None
        except (hvac.exceptions.VaultError, ValueError):
            raise SourceError(AUTH_FAILED) from None

    def _refused(self, token: str) -> None:
        """Vault refused a token a login gave (revoked, or its lease cut short): log in anew."""
        with self._lock:
            if self._login is not None and self._login[0] == token:
                self._login = None

    def fetch(self, ref: SecretRef) -> bytes:
        import hvac
        import hvac.exceptions
        import requests

        if not self._address:
            raise SourceError(UNAVAILABLE)
        client = hvac.Client(
            url=self._address,
            verify=self._verify,
            timeout=TIMEOUT,
            namespace=self._namespace,
        )
        # A token file is read again each time: a rotated one is used.
        client.token, logged_in = self._token(client)
        try:
            answer = client.secrets.kv.v2.read_secret_version(
                path=ref.path, mount_point=ref.mount, raise_on_deleted_version=True
            )
        except hvac.exceptions.InvalidPath:
            raise SourceError(NOT_FOUND) from None
        except (hvac.exceptions.Unauthorized, hvac.exceptions.Forbidden) as e:
            if logged_in:
                self._refused(client.token)
            if isinstance(e, hvac.exceptions.Unauthorized):
                raise SourceError(AUTH_FAILED) from None
            raise SourceError(PERMISSION_DENIED) from None  # a bad token, or no policy here
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
