"""The variables of a session: proxy, trust, Java, placeholders, and their three renderings."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from addon.launcher.launchenv import (
    CA_VARS,
    PLACEHOLDER,
    PROXY_VARS,
    Session,
    contained,
    node_notice,
    render,
    runs_node,
    variables,
)

SESSION = Session(
    proxy_url="http://agent:tok@127.0.0.1:8080",
    proxy_host="127.0.0.1",
    proxy_port=8080,
    ca_file=Path("/etc/credproxy/ca.pem"),
    truststore=Path("/etc/credproxy/ca.p12"),
    placeholders=("OPENAI_API_KEY",),
)


def test_proxy_and_trust_are_set_for_every_client() -> None:
    env = variables(SESSION)
    assert {env[n] for n in PROXY_VARS} == {SESSION.proxy_url}
    assert {"https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"} <= set(PROXY_VARS)
    assert env["NO_PROXY"] == env["no_proxy"] == ""
    assert {env[n] for n in CA_VARS} == {"/etc/credproxy/ca.pem"}
    assert {
        "CURL_CA_BUNDLE",
        "REQUESTS_CA_BUNDLE",
        "SSL_CERT_FILE",
        "NODE_EXTRA_CA_CERTS",
        "PIP_CERT",
        "NPM_CONFIG_CAFILE",
        "GIT_SSL_CAINFO",
        "AWS_CA_BUNDLE",
        "CARGO_HTTP_CAINFO",
        "DENO_CERT",
    } <= set(CA_VARS)
    assert env["NODE_USE_ENV_PROXY"] == "1"
    assert env["OPENAI_API_KEY"] == PLACEHOLDER


def test_the_session_overrides_what_the_caller_had_and_java_keeps_its_options() -> None:
    env = contained(
        {"PATH": "/bin", "no_proxy": "api.test", "JAVA_TOOL_OPTIONS": "-Xmx1g"}, SESSION
    )
    assert env["PATH"] == "/bin"
    assert env["no_proxy"] == ""
    java = env["JAVA_TOOL_OPTIONS"].split()
    assert java[0] == "-Xmx1g"
    assert "-Dhttps.proxyHost=127.0.0.1" in java and "-Dhttps.proxyPort=8080" in java
    assert "-Djavax.net.ssl.trustStore=/etc/credproxy/ca.p12" in java
    assert "-Djdk.http.auth.tunneling.disabledSchemes=" in java
    assert "tok" not in env["JAVA_TOOL_OPTIONS"]  # the JVM prints it on every start


def test_sh_output_reads_back_in_a_shell() -> None:
    env = {"A": "it's $HOME `x`", "B": "", "C": "-Dx=1 -Dy=2"}
    shown = subprocess.run(
        ["sh", "-c", render(env, "sh") + 'printf "%s|%s|%s" "$A" "$B" "$C"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert shown == "it's $HOME `x`||-Dx=1 -Dy=2"


def test_dotenv_and_json_outputs() -> None:
    env = {"HTTPS_PROXY": "http://a:t-_@h:1", "NO_PROXY": "", "J": "-Da=1 -Db=2"}
    assert render(env, "dotenv") == 'HTTPS_PROXY=http://a:t-_@h:1\nNO_PROXY=\nJ="-Da=1 -Db=2"\n'
    assert json.loads(render(env, "json")) == env


def test_the_client_recipes_name_every_ca_variable_exec_sets() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "clients.md").read_text()
    table = page[page.index("**Trust the CA.**") : page.index("| Java | a trust store")]
    assert [n for n in CA_VARS if f"`{n}`" not in table] == []


def test_a_system_ca_folder_is_removed_and_the_new_clients_get_the_ca() -> None:
    env = contained({"SSL_CERT_DIR": "/etc/ssl/certs", "KEEP": "1"}, SESSION)
    assert "SSL_CERT_DIR" not in env and env["KEEP"] == "1"
    for name in (
        "CLOUDSDK_CORE_CUSTOM_CA_CERTS_FILE",
        "HTTPLIB2_CA_CERTS",
        "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",
        "NIX_SSL_CERT_FILE",
        "NPM_CONFIG_CAFILE",
    ):
        assert env[name] == "/etc/credproxy/ca.pem"


NODE_NOTICE = (
    "credproxy: notice: Node v20.20.2 ignores HTTPS_PROXY in fetch and https; Node 24 and later "
    "read it (exec sets NODE_USE_ENV_PROXY=1); on Node 20 or 22, call undici's "
    "setGlobalDispatcher(new EnvHttpProxyAgent()) before fetch"
)


@pytest.mark.parametrize(
    ("command", "runs"),
    [
        pytest.param(["node", "-e", "1"], True, id="node"),
        pytest.param(["/usr/local/bin/node"], True, id="node by its path"),
        pytest.param(["npx", "tsx", "a.ts"], True, id="npx"),
        pytest.param(["npm", "test"], True, id="npm"),
        pytest.param(["yarn"], True, id="yarn"),
        pytest.param(["pnpm", "dev"], True, id="pnpm"),
        pytest.param(["tsx", "a.ts"], True, id="tsx"),
        pytest.param(["ts-node", "a.ts"], True, id="ts-node"),
        pytest.param(["python3", "node"], False, id="node as an argument is not node"),
        pytest.param(["nodemon"], False, id="another name beginning with node"),
        pytest.param([], False, id="no command"),
    ],
)
def test_a_node_command_is_known_by_its_name(command: list[str], runs: bool) -> None:
    assert runs_node(command) is runs


@pytest.mark.parametrize(
    ("version", "notice"),
    [
        pytest.param("v20.20.2\n", NODE_NOTICE, id="Node 20 gets the notice"),
        pytest.param("v22.12.0\n", NODE_NOTICE.replace("v20.20.2", "v22.12.0"), id="Node 22"),
        pytest.param("v24.0.0\n", None, id="Node 24 reads NODE_USE_ENV_PROXY"),
        pytest.param("v25.1.0", None, id="Node 25"),
        pytest.param("", None, id="no answer"),
        pytest.param("v20.1.0\x1b[2J", None, id="an answer that is no version"),
    ],
)
def test_a_node_before_24_gets_one_notice_naming_the_fix(version: str, notice: str | None) -> None:
    assert node_notice(version) == notice
