"""Fill a fresh, migrated store with principals, sealed credentials and grants, in bulk.

One transaction of plain INSERTs: the Store API commits (and bumps the change counter) once
per call, which is minutes for 12,000 rows. Rows are built with the store's own validators,
sealing and hashing, so `credproxy run` reads them exactly as if the CLI had written them.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from sqlalchemy import insert, update

from store.crypto import MasterKey, Secret, hash_token, new_token
from store.db.models import Credential, Grant, Principal, StoreState, utcnow
from store.repository import Store
from store.rules import bodyrules
from store.rules.grammar import parse_host, validate_method, validate_name, validate_path_pattern
from store.tables.keys import seal

HOST = "bench.test"
PATH = "/bench/item"


@dataclass(frozen=True)
class Population:
    principals: int
    credentials: int
    grants_per_principal: int
    # The benchmark's host as the grants name it; "localhost:PORT" for the configurations
    # whose upstream name goes through the system resolver.
    host: str = HOST
    # "sigv4": every request signed with AWS SigV4 (bench.test is no AWS name: the scope is
    # given as --service/--region would give it).
    scheme: str = "bearer"
    # The benchmark's grant decides each request's body: POST with a GraphQL query rule.
    graphql: bool = False

    @property
    def grants(self) -> int:
        return self.principals * self.grants_per_principal


def _hosts(*specs: str) -> list[str]:
    return [str(parse_host(spec)) for spec in specs]


GRAPHQL_RULE = bodyrules.parse("graphql", {"query": "*", "mutation": ["addComment"]})


def _grant(
    host: str, principal_id: int, credential: int, j: int, graphql: bool = False
) -> dict[str, object]:
    """Grant j of a principal: 0 is the benchmark's, 1 shares its host, the rest elsewhere."""
    body = None
    if j == 0:
        hosts, methods, paths = _hosts(host), ["GET"], ["/bench/"]
        if graphql:
            methods, body = ["POST"], GRAPHQL_RULE.to_json()
    elif j == 1:
        hosts, methods, paths = _hosts(host), ["POST", "PUT"], ["/upload/"]
    else:
        hosts, methods, paths = (
            _hosts(f"api{j}.svc{credential}.example"),
            ["GET", "POST"],
            [
                f"/v{j}/",
                f"/v{j}/repos/*/issues",
            ],
        )
    return {
        "principal_id": principal_id,
        "credential_id": credential + 1,
        "hosts": hosts,
        "methods": [validate_method(m) for m in methods],
        "paths": sorted(validate_path_pattern(p) for p in paths),
        "once": False,
        "websocket": False,
        "created_at": utcnow(),
        "body": body,
    }


def populate(store: Store, key: MasterKey, spec: Population) -> list[tuple[str, str]]:
    """Write `spec` into an empty store; returns each principal's (name, token)."""
    now = utcnow()
    tokens = [
        (validate_name("principal", f"agent-{i:04d}"), new_token()) for i in range(spec.principals)
    ]
    principals = [
        {"id": i + 1, "name": name, "token_hash": hash_token(token), "created_at": now}
        for i, (name, token) in enumerate(tokens)
    ]
    credentials = []
    for k in range(spec.credentials):
        name = validate_name("credential", f"cred-{k:04d}")
        plain = secrets.token_urlsafe(32)
        secret = Secret(plain.encode())
        options = None
        if spec.scheme == "sigv4":
            keys = {"access_key_id": f"AKIABENCH{k:011d}", "secret_access_key": plain}
            secret = Secret(json.dumps(keys).encode())
            options = {"service": "execute-api", "region": "us-east-1"}
        key_id, nonce, ciphertext = seal(key, name, secret)
        credentials.append(
            {
                "id": k + 1,
                "name": name,
                "scheme": spec.scheme,
                "options": options,
                "hosts": _hosts(spec.host, f"*.svc{k}.example"),
                "key_id": key_id,
                "nonce": nonce,
                "ciphertext": ciphertext,
                "fingerprint": key.fingerprint(secret),
                "created_at": now,
            }
        )
    grants = [
        _grant(
            spec.host,
            i + 1,
            (i * spec.grants_per_principal + j) % spec.credentials,
            j,
            spec.graphql,
        )
        for i in range(spec.principals)
        for j in range(spec.grants_per_principal)
    ]
    with store.engine.begin() as connection:
        connection.execute(insert(Principal), principals)
        connection.execute(insert(Credential), credentials)
        connection.execute(insert(Grant), grants)
        connection.execute(
            update(StoreState)
            .where(StoreState.id == 1)
            .values(change_counter=StoreState.change_counter + 1)
        )
    return tokens
