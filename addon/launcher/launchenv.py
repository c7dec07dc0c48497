"""The variables a sandboxed command gets: proxy, trust for every ecosystem, placeholders.

Pure: the caller decides the proxy URL, the CA and truststore paths, and the placeholder names.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from addon.launcher.truststore import PASSWORD as TRUSTSTORE_PASSWORD

PLACEHOLDER = "credproxy-placeholder"
PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")
NO_PROXY_VARS = ("NO_PROXY", "no_proxy")
# Each client's own variable for the CA: the one list behind exec, `credproxy env`,
# docker-compose.yml's x-trust-ca and README's "Trust the CA" (each checked by a test).
CA_VARS = (
    "CURL_CA_BUNDLE",  # curl
    "REQUESTS_CA_BUNDLE",  # requests
    "SSL_CERT_FILE",  # OpenSSL, httpx, Python ssl, Go, uv
    "NODE_EXTRA_CA_CERTS",  # Node
    "PIP_CERT",  # pip
    "NPM_CONFIG_CAFILE",  # npm
    "GIT_SSL_CAINFO",  # git over HTTPS
    "AWS_CA_BUNDLE",  # AWS SDKs and the CLI
    "CARGO_HTTP_CAINFO",  # Cargo
    "DENO_CERT",  # Deno
    "CLOUDSDK_CORE_CUSTOM_CA_CERTS_FILE",  # gcloud
    "HTTPLIB2_CA_CERTS",  # httplib2 (older Google client libraries)
    "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",  # gRPC's C core (Python, Ruby, PHP, C++)
    "NIX_SSL_CERT_FILE",  # Nix
)
# Trust settings that would add roots beside the CA, or point a client elsewhere: removed.
SCRUBBED_TRUST = ("SSL_CERT_DIR",)
FORMATS = ("sh", "dotenv", "json")
# CMDs that run Node: Node itself and the launchers that start it.
NODE_COMMANDS = frozenset({"node", "nodejs", "npx", "npm", "yarn", "pnpm", "tsx", "ts-node"})
# The first Node whose fetch and https read the proxy variables (under NODE_USE_ENV_PROXY=1).
NODE_ENV_PROXY = 24
_NODE_VERSION = re.compile(r"v(\d+)\.\d+\.\d+")
_BARE = re.compile(r"[A-Za-z0-9_./:@%+,=-]*")


@dataclass(frozen=True)
class Session:
    """What a sandboxed command needs to reach the proxy."""

    proxy_url: str  # http://NAME:TOKEN@HOST:PORT, or http://HOST:PORT when a forwarder adds it
    proxy_host: str
    proxy_port: int
    ca_file: Path
    truststore: Path | None  # PKCS12 with the CA, for Java; None when it could not be made
    placeholders: tuple[str, ...] = ()


def variables(session: Session) -> dict[str, str]:
    """Every variable the session sets, in a stable order."""
    env = {name: session.proxy_url for name in PROXY_VARS}
    env.update({name: "" for name in NO_PROXY_VARS})
    env.update({name: str(session.ca_file) for name in CA_VARS})
    # Node 24+ reads the proxy variables for fetch and https only when asked to.
    env["NODE_USE_ENV_PROXY"] = "1"
    env.update({name: PLACEHOLDER for name in session.placeholders})
    return env


def java_options(session: Session, existing: str | None) -> str:
    """JAVA_TOOL_OPTIONS: proxy properties and the truststore, after what the caller had."""
    host, port = session.proxy_host, session.proxy_port
    props = [
        f"-Dhttps.proxyHost={host}",
        f"-Dhttps.proxyPort={port}",
        f"-Dhttp.proxyHost={host}",
        f"-Dhttp.proxyPort={port}",
        "-Dhttp.nonProxyHosts=",
        # Else the JDK never answers a 407 with Basic on CONNECT (README, "Java"). The token
        # itself stays out: the JVM prints JAVA_TOOL_OPTIONS on every start.
        "-Djdk.http.auth.tunneling.disabledSchemes=",
    ]
    if session.truststore is not None:
        props += [
            f"-Djavax.net.ssl.trustStore={session.truststore}",
            "-Djavax.net.ssl.trustStoreType=PKCS12",
            f"-Djavax.net.ssl.trustStorePassword={TRUSTSTORE_PASSWORD}",
        ]
    return " ".join(([existing] if existing else []) + props)


def contained(base: Mapping[str, str], session: Session) -> dict[str, str]:
    """The (already scrubbed) environment with the session's variables set over it."""
    env = {name: value for name, value in base.items() if name not in SCRUBBED_TRUST}
    env.update(variables(session))
    env["JAVA_TOOL_OPTIONS"] = java_options(session, base.get("JAVA_TOOL_OPTIONS"))
    return env


def render(env: Mapping[str, str], fmt: str) -> str:
    """The variables as `export NAME=...` lines, a dotenv file or a JSON object."""
    if fmt == "json":
        return json.dumps(dict(env), indent=2) + "\n"
    if fmt == "sh":
        return "".join(f"export {n}={shlex.quote(v)}\n" for n, v in env.items())
    return "".join(f"{n}={_dotenv(v)}\n" for n, v in env.items())


def _dotenv(value: str) -> str:
    # Bare where every dotenv reader agrees on what it means; else double-quoted.
    return value if _BARE.fullmatch(value) else json.dumps(value)


def set_by_session(name: str) -> bool:
    """Whether exec sets `name` itself (so the caller's value is replaced, not withheld)."""
    return name in PROXY_VARS or name in NO_PROXY_VARS or name in CA_VARS


def runs_node(command: Sequence[str]) -> bool:
    """Whether CMD is Node or one of its launchers (by its name, wherever it lives)."""
    return bool(command) and os.path.basename(command[0]) in NODE_COMMANDS


def node_notice(version: str) -> str | None:
    """The line for a Node that printed `version` (`node --version`) and ignores the proxy
    variables; None for one that reads them, or for an answer that is no version."""
    found = _NODE_VERSION.fullmatch(version.strip())
    if found is None or int(found.group(1)) >= NODE_ENV_PROXY:
        return None
    return (
        f"credproxy: notice: Node {found.group(0)} ignores HTTPS_PROXY in fetch and https; "
        f"Node {NODE_ENV_PROXY} and later read it (exec sets NODE_USE_ENV_PROXY=1); on Node 20 "
        "or 22, call undici's setGlobalDispatcher(new EnvHttpProxyAgent()) before fetch"
    )


def placeholder_names(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(set(names)))
