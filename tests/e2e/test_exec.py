"""`credproxy exec` and `credproxy env` with real clients, through the real proxy, to a
loopback upstream: stamped credentials, a contained environment, exit codes, signals, and a
session token that ends with the command."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import termios
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from store.crypto import Secret
from tests.e2e.conftest import CREDPROXY, Proxy
from tests.e2e.raw import Reply, exchange, get, proxy_auth
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SECRET = "sk-exec-" + os.urandom(8).hex()
CALLER_SECRET = "ghp_" + os.urandom(18).hex()  # 36 characters: a GitHub token's shape


@dataclass
class Agent:
    name: str
    cred: str


def make_agent(proxy: Proxy, names) -> Agent:
    """A principal granted GET and POST on api.test with a credential that has a placeholder."""
    name, cred = names("agent"), names("cred")
    proxy.store.add_principal(name)
    proxy.store.add_credential(
        cred,
        "bearer",
        ["api.test"],
        Secret(SECRET.encode()),
        options={"placeholder_env": "OPENAI_API_KEY"},
    )
    proxy.store.add_grant(name, ["GET", "POST"], credential=cred, paths=["/"])
    proxy.wait_reload()
    return Agent(name, cred)


@pytest.fixture
def agent(proxy: Proxy, names) -> Agent:
    return make_agent(proxy, names)


def credproxy(
    proxy: Proxy, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CREDPROXY, *args],
        env={**proxy.env, **(env or {})},
        cwd=proxy.home,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def exec_(proxy: Proxy, agent: Agent, *command: str, **kw) -> subprocess.CompletedProcess[str]:
    return credproxy(
        proxy,
        "exec",
        "--unsafe-state-access",
        "--principal",
        agent.name,
        "--proxy",
        f"127.0.0.1:{proxy.port}",
        "--",
        *command,
        **kw,
    )


def session_token(proxy_url: str) -> str:
    return proxy_url.rsplit("@", 1)[0].rsplit(":", 1)[1]


def tokens(proxy: Proxy, agent: Agent) -> list[str]:
    return [t.state for t in proxy.store.list_tokens(agent.name)]


def stamped(upstream: Upstream) -> list[list[str]]:
    return [r.header("authorization") for r in upstream.log.requests]


# -- clients -------------------------------------------------------------------------


def test_curl_is_stamped_and_its_session_token_ends_with_it(
    proxy: Proxy, upstream: Upstream, agent: Agent, tmp_path: Path
):
    seen = tmp_path / "proxy-url"
    done = exec_(
        proxy,
        agent,
        "sh",
        "-c",
        f'curl -sS -H "Authorization: Bearer $OPENAI_API_KEY" https://api.test/v1/x '
        f'&& printf %s "$HTTPS_PROXY" > {seen}',
    )
    assert done.returncode == 0, done.stderr
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]
    token = session_token(seen.read_text())
    assert tokens(proxy, agent) == ["revoked"]
    proxy.wait_reload()
    reply = get(proxy, (agent.name, token))
    assert (reply.status, reply.reason) == (407, "auth-required")
    assert SECRET not in done.stdout + done.stderr


PYTHON_CLIENTS = {
    "httpx": "import httpx; print(httpx.get('https://api.test/v1/httpx').status_code)",
    "requests": "import requests; print(requests.get('https://api.test/v1/requests').status_code)",
    "urllib": ("import urllib.request as u; print(u.urlopen('https://api.test/v1/urllib').status)"),
}


@pytest.mark.parametrize("client", sorted(PYTHON_CLIENTS))
def test_python_clients_read_the_proxy_and_the_ca_from_the_environment(
    proxy: Proxy, upstream: Upstream, agent: Agent, client: str
):
    if client == "requests":
        pytest.importorskip("requests")
    done = exec_(proxy, agent, sys.executable, "-c", PYTHON_CLIENTS[client])
    assert (done.returncode, done.stdout.strip()) == (0, "200"), done.stderr
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]
    assert upstream.log.requests[0].target == f"/v1/{client}"


def test_git_reaches_the_upstream_through_the_proxy(proxy: Proxy, upstream: Upstream, agent: Agent):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    # The upstream is no git server: what matters is that git's request arrived, stamped.
    exec_(proxy, agent, "git", "ls-remote", "https://api.test/v1/repo.git")
    assert upstream.log.requests, "git never reached the upstream"
    assert upstream.log.requests[0].target.startswith("/v1/repo.git/info/refs")
    assert stamped(upstream)[0] == [f"Bearer {SECRET}"]


def test_pip_reaches_the_index_through_the_proxy(proxy: Proxy, upstream: Upstream, agent: Agent):
    exec_(
        proxy,
        agent,
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--retries",
        "0",
        "--isolated",
        "--disable-pip-version-check",
        "--dest",
        str(proxy.home / "pip"),
        "--index-url",
        "https://api.test/v1/simple/",
        "nothing-here",
    )
    assert upstream.log.requests, "pip never reached the index"
    assert "/v1/simple/nothing-here/" in [r.target for r in upstream.log.requests]
    assert stamped(upstream)[0] == [f"Bearer {SECRET}"]


def _node_major() -> int:
    node = shutil.which("node")
    if node is None:
        return 0
    out = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    return int(out.lstrip("v").split(".")[0])


NODE_CONNECT = """
const http = require('http'), tls = require('tls');
const p = new URL(process.env.HTTPS_PROXY);
const auth = 'Basic ' + Buffer.from(
  decodeURIComponent(p.username) + ':' + decodeURIComponent(p.password)).toString('base64');
http.request({host: p.hostname, port: p.port, method: 'CONNECT', path: 'api.test:443',
              headers: {'Proxy-Authorization': auth}})
  .on('connect', (res, socket) => {
    if (res.statusCode !== 200) { console.log('CONNECT', res.statusCode); process.exit(1); }
    const s = tls.connect({socket, servername: 'api.test'}, () => s.write(
      'GET /v1/node HTTP/1.1\\r\\nHost: api.test\\r\\nConnection: close\\r\\n\\r\\n'));
    let got = '';
    s.on('data', d => got += d);
    s.on('end', () => console.log(got.split(' ')[1]));
  }).end();
"""


@pytest.mark.skipif(_node_major() == 0, reason="node is not installed")
def test_node_https_trusts_the_ca_from_node_extra_ca_certs(
    proxy: Proxy, upstream: Upstream, agent: Agent
):
    # Node before 24 has no proxy support of its own: the script makes the CONNECT, as a
    # proxy agent would; what this checks is the proxy URL and the CA exec hands to Node.
    done = exec_(proxy, agent, "node", "-e", NODE_CONNECT)
    assert (done.returncode, done.stdout.strip()) == (0, "200"), done.stderr
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]


@pytest.mark.skipif(
    _node_major() < 24,
    reason="Node's fetch reads the proxy variables (NODE_USE_ENV_PROXY) from Node 24 on; "
    "Node 20 and 22 need an undici dispatcher the script sets itself",
)
def test_node_fetch_uses_the_proxy_on_node_24(proxy: Proxy, upstream: Upstream, agent: Agent):
    script = "fetch('https://api.test/v1/node').then(r => console.log(r.status))"
    done = exec_(proxy, agent, "node", "-e", script)
    assert (done.returncode, done.stdout.strip()) == (0, "200"), done.stderr
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]


def _node_version() -> str:
    return subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(_node_major() == 0, reason="node is not installed")
@pytest.mark.parametrize(
    "command",
    [
        pytest.param(("node", "-e", ""), id="node"),
        pytest.param(("npm", "--version"), id="a Node launcher: npm"),
    ],
)
def test_a_node_before_24_gets_one_notice_with_the_fix(
    proxy: Proxy, agent: Agent, command: tuple[str, ...]
):
    done = exec_(proxy, agent, *command)
    assert done.returncode == 0, done.stderr
    notices = [line for line in done.stderr.splitlines() if "notice" in line]
    if _node_major() >= 24:
        assert notices == []
        return
    assert notices == [
        f"credproxy: notice: Node {_node_version()} ignores HTTPS_PROXY in fetch and https; "
        "Node 24 and later read it (exec sets NODE_USE_ENV_PROXY=1); on Node 20 or 22, call "
        "undici's setGlobalDispatcher(new EnvHttpProxyAgent()) before fetch"
    ]


def test_no_notice_for_a_command_that_is_not_node(proxy: Proxy, agent: Agent):
    done = exec_(proxy, agent, "sh", "-c", "node --version >/dev/null 2>&1; true")
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if "notice" in line] == []


# -- the environment -----------------------------------------------------------------


def test_secret_shaped_variables_stay_outside_and_placeholders_are_set(proxy: Proxy, agent: Agent):
    caller = {
        "MY_SERVICE_TOKEN": "plain-looking",
        "HARMLESS_NAME": CALLER_SECRET,
        "OPENAI_API_KEY": "sk-caller-" + "x" * 20,
        "KEPT_TOKEN": "kept on purpose",
        "PLAIN_VARIABLE": "stays",
    }
    done = credproxy(
        proxy,
        "exec",
        "--unsafe-state-access",
        "--principal",
        agent.name,
        "--proxy",
        f"127.0.0.1:{proxy.port}",
        "--keep-env",
        "KEPT_TOKEN",
        "--",
        "env",
        env=caller,
    )
    assert done.returncode == 0, done.stderr
    inside = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert "MY_SERVICE_TOKEN" not in inside and "HARMLESS_NAME" not in inside
    assert not any(k.startswith("CREDPROXY_") for k in inside)
    assert CALLER_SECRET not in done.stdout and "sk-caller-" not in done.stdout
    assert inside["OPENAI_API_KEY"] == "credproxy-placeholder"
    assert (inside["KEPT_TOKEN"], inside["PLAIN_VARIABLE"]) == ("kept on purpose", "stays")
    assert inside["NO_PROXY"] == inside["no_proxy"] == ""
    assert inside["https_proxy"] == inside["HTTPS_PROXY"]
    assert inside["https_proxy"].startswith(f"http://{agent.name}:")
    assert inside["CURL_CA_BUNDLE"] == str((proxy.home / "certs" / "credproxy-ca.pem").resolve())
    # The names removed are told on stderr, never their values.
    assert "MY_SERVICE_TOKEN" in done.stderr and "HARMLESS_NAME" in done.stderr
    assert CALLER_SECRET not in done.stderr and "plain-looking" not in done.stderr
    assert "KEPT_TOKEN" not in done.stderr


# -- exit status and signals ---------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "status"),
    [
        pytest.param("exit 0", 0, id="success is 0"),
        pytest.param("exit 7", 7, id="a status passes through"),
        pytest.param("kill -TERM $$", 128 + 15, id="death by a signal is 128+N"),
    ],
)
def test_the_commands_exit_status_is_execs(proxy: Proxy, agent: Agent, script: str, status: int):
    assert exec_(proxy, agent, "sh", "-c", script).returncode == status
    assert tokens(proxy, agent) == ["revoked"]


def test_a_missing_command_is_127_and_its_session_is_revoked(proxy: Proxy, agent: Agent):
    done = exec_(proxy, agent, "no-such-command-here")
    assert done.returncode == 127
    assert done.stderr.splitlines()[-1] == (
        "credproxy: error: cannot run 'no-such-command-here': command not found"
    )
    assert tokens(proxy, agent) == ["revoked"]


TRAP = """
import os, signal, sys, time
got = []
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, lambda n, f: got.append(n))
open(sys.argv[1], "w").write(os.environ["HTTPS_PROXY"])
while not got:
    time.sleep(0.05)
open(sys.argv[1] + ".got", "w").write(str(got[0]))
sys.exit(40 + got[0])
"""


def _started(ready: Path, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not ready.exists() or not ready.read_text():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)


def _spawn_exec(proxy: Proxy, agent: Agent, *command: str, ttl: str = "8h"):
    return subprocess.Popen(
        [
            *CREDPROXY,
            "exec",
            "--unsafe-state-access",
            "--principal",
            agent.name,
            "--ttl",
            ttl,
            "--proxy",
            f"127.0.0.1:{proxy.port}",
            "--",
            *command,
        ],
        env=proxy.env,
        cwd=proxy.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name
)
def test_signals_to_exec_reach_the_command_and_the_session_is_revoked(
    proxy: Proxy, agent: Agent, tmp_path: Path, sig: signal.Signals
):
    ready = tmp_path / "ready"
    process = _spawn_exec(proxy, agent, sys.executable, "-c", TRAP, str(ready))
    try:
        _started(ready, process)
        token = session_token(ready.read_text())
        assert get(proxy, (agent.name, token)).status != 407
        os.kill(process.pid, sig)
        process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 40 + sig
    assert (tmp_path / "ready.got").read_text() == str(int(sig))
    assert tokens(proxy, agent) == ["revoked"]
    proxy.wait_reload()
    assert get(proxy, (agent.name, token)).status == 407


def test_after_kill_9_of_exec_the_session_expires_on_its_own(
    proxy: Proxy, agent: Agent, tmp_path: Path
):
    ready = tmp_path / "ready"
    process = _spawn_exec(
        proxy, agent, "sh", "-c", f'printf %s "$HTTPS_PROXY" > {ready}; sleep 120', ttl="3s"
    )
    try:
        _started(ready, process)
        token = session_token(ready.read_text())
        process.kill()
        process.wait(timeout=60)  # the orphaned sleep keeps the pipes open
        assert tokens(proxy, agent) == ["active"]  # nothing revoked it
        assert get(proxy, (agent.name, token)).status != 407
        (entry,) = proxy.store.list_tokens(agent.name)
        assert entry.expires_at is not None
        while datetime.now(UTC) <= entry.expires_at:
            time.sleep(0.1)
        reply = get(proxy, (agent.name, token))
        assert (reply.status, reply.reason) == (407, "auth-required")
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the orphaned sleep


# -- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(["--principal", "{agent}", "touch", "{marker}"], "--", id="no --"),
        pytest.param(["--principal", "{agent}", "--"], "no command", id="nothing after --"),
        pytest.param(
            ["--principal", "ghost", "--", "touch", "{marker}"], "ghost", id="unknown principal"
        ),
        pytest.param(
            ["--principal", "{agent}", "--ttl", "0", "--", "touch", "{marker}"], "ttl", id="ttl 0"
        ),
        pytest.param(
            ["--principal", "{agent}", "--ttl", "soon", "--", "touch", "{marker}"],
            "ttl",
            id="ttl garbage",
        ),
        pytest.param(
            ["--principal", "{agent}", "--ttl", "31d", "--", "touch", "{marker}"],
            "ttl",
            id="ttl too long",
        ),
        pytest.param(
            ["--principal", "{agent}", "--proxy", "127.0.0.1:1", "--", "touch", "{marker}"],
            "unreachable",
            id="unreachable proxy",
        ),
        pytest.param(
            ["--principal", "{agent}", "--proxy", "no port", "--", "touch", "{marker}"],
            "--proxy",
            id="bad proxy address",
        ),
    ],
)
def test_bad_input_is_one_line_status_2_and_the_command_never_runs(
    proxy: Proxy, agent: Agent, tmp_path: Path, args: list[str], says: str
):
    marker = tmp_path / "ran"
    argv = [a.format(agent=agent.name, marker=marker) for a in args]
    if "--proxy" not in argv:
        argv = ["--proxy", f"127.0.0.1:{proxy.port}", *argv]
    done = credproxy(proxy, "exec", "--unsafe-state-access", *argv)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()
    assert tokens(proxy, agent) in ([], ["revoked"])


def test_a_removed_principal_is_refused(proxy: Proxy, agent: Agent, tmp_path: Path):
    proxy.store.remove_principal(agent.name)
    done = exec_(proxy, agent, "touch", str(tmp_path / "ran"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert not (tmp_path / "ran").exists()


# -- credproxy env -------------------------------------------------------------------


def test_env_prints_a_working_session_that_outlives_the_command(
    proxy: Proxy, upstream: Upstream, agent: Agent
):
    done = credproxy(
        proxy,
        "env",
        "--principal",
        agent.name,
        "--proxy",
        f"127.0.0.1:{proxy.port}",
        "--ttl",
        "10m",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    env = json.loads(done.stdout)
    assert env["OPENAI_API_KEY"] == "credproxy-placeholder" and env["NO_PROXY"] == ""
    assert tokens(proxy, agent) == ["active"]
    context = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
    with httpx.Client(proxy=env["HTTPS_PROXY"], verify=context) as client:
        assert client.get("https://api.test/v1/env").status_code == 200
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]


# -- principal token, from the CLI ---------------------------------------------------


def test_principal_token_commands_print_the_token_once_and_list_only_hashes(
    proxy: Proxy, agent: Agent
):
    added = credproxy(
        proxy, "principal", "token", "add", agent.name, "--expires", "1h", "--note", "ci", "--json"
    )
    assert added.returncode == 0, added.stderr
    made = json.loads(added.stdout)
    listed = credproxy(proxy, "principal", "token", "list", agent.name, "--json")
    (row,) = json.loads(listed.stdout)
    assert (row["id"], row["note"], row["state"]) == (made["id"], "ci", "active")
    assert made["token"] not in listed.stdout
    proxy.wait_reload()
    assert get(proxy, (agent.name, made["token"])).status != 407
    revoked = credproxy(proxy, "principal", "token", "revoke", str(made["id"]))
    assert revoked.returncode == 0, revoked.stderr
    assert tokens(proxy, agent) == ["revoked"]
    missing = credproxy(proxy, "principal", "token", "revoke", "999999")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1


COUNT = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda n, f: got.append(n))
open(sys.argv[1], "w").write(os.environ["HTTPS_PROXY"])
while not got:
    time.sleep(0.05)
time.sleep(1)  # room for a second, forwarded copy, which must not come
open(sys.argv[1] + ".count", "w").write(str(len(got)))
"""


def test_a_terminals_ctrl_c_reaches_the_command_once(proxy: Proxy, agent: Agent, tmp_path: Path):
    ready = tmp_path / "ready"
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [
            *CREDPROXY, "exec", "--unsafe-state-access", "--principal", agent.name,
            "--proxy", f"127.0.0.1:{proxy.port}", "--", sys.executable, "-c", COUNT, str(ready),
        ],
        env=proxy.env, cwd=proxy.home, stdin=terminal, stdout=terminal,
        stderr=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )  # fmt: skip
    os.close(terminal)
    try:
        _started(ready, process)
        os.write(controller, b"\x03")  # the terminal sends SIGINT to its foreground group
        assert process.wait(timeout=30) == 0
        assert (tmp_path / "ready.count").read_text() == "1"
        assert tokens(proxy, agent) == ["revoked"]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        os.close(controller)


def test_credential_add_takes_a_placeholder_variable_name(proxy: Proxy, names):
    name = names("cred")
    bad = subprocess.run(
        [*CREDPROXY, "credential", "add", name, "--scheme", "bearer", "--host", "api.test",
         "--placeholder-env", "NOT-A-NAME"],
        input="s3cr3t", env=proxy.env, cwd=proxy.home, capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--placeholder-env" in bad.stderr and "s3cr3t" not in bad.stderr
    good = subprocess.run(
        [*CREDPROXY, "credential", "add", name, "--scheme", "bearer", "--host", "api.test",
         "--placeholder-env", "ANTHROPIC_API_KEY"],
        input="s3cr3t", env=proxy.env, cwd=proxy.home, capture_output=True, text=True,
    )  # fmt: skip
    assert good.returncode == 0, good.stderr
    listed = json.loads(credproxy(proxy, "credential", "list", "--json").stdout)
    assert {c["name"]: c["placeholder_env"] for c in listed}[name] == "ANTHROPIC_API_KEY"


def test_the_command_inherits_no_descriptor_of_the_store(proxy: Proxy, agent: Agent):
    done = exec_(proxy, agent, "sh", "-c", 'ls -l /proc/$$/fd | sed "s/.*-> //"')
    assert done.returncode == 0, done.stderr
    opened = done.stdout.split()
    assert not [f for f in opened if "credproxy" in f or f.startswith("socket:")], opened


def _exec_plain(proxy: Proxy, agent: Agent, *args: str, cwd: Path | None = None):
    return subprocess.run(
        [*CREDPROXY, "exec", *args[:-1], "--principal", agent.name,
         "--proxy", f"127.0.0.1:{proxy.port}", "--", *args[-1].split()],
        env=proxy.env, cwd=cwd or proxy.home, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_without_isolate_a_user_who_can_read_the_key_is_refused(
    proxy: Proxy, agent: Agent, tmp_path: Path
):
    """exec runs as root here: CMD could read the master key and change the store."""
    marker = tmp_path / "ran"
    done = _exec_plain(proxy, agent, f"touch {marker}")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "who can read the master key" in done.stderr and "--isolate" in done.stderr
    assert str(proxy.home / "credproxy.key") in done.stderr
    assert not marker.exists()
    assert tokens(proxy, agent) == []
    done = _exec_plain(proxy, agent, "--unsafe-state-access", f"touch {marker}")
    assert done.returncode == 0, done.stderr
    assert marker.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="--user needs root")
def test_user_runs_the_command_as_another_user_who_cannot_read_the_state(
    proxy: Proxy, upstream: Upstream, agent: Agent, tmp_path: Path
):
    """No opt-in needed: nobody reads neither the key, nor the CA's key, nor writes the store;
    it reads a copy of the CA that exec made for it, and its requests are stamped."""
    out = Path(tempfile.mkdtemp(dir="/var/tmp"))  # pytest's folders are closed to nobody
    out.chmod(0o777)
    script = (
        f"id -u > {out}/uid; cat {proxy.home}/credproxy.key > {out}/key 2>&1; "
        f"cat {proxy.home}/certs/mitmproxy-ca.pem > {out}/ca 2>&1; "
        f"grep NoNewPrivs /proc/self/status > {out}/nnp; "
        f"curl -sS https://api.test/v1/as-nobody > {out}/curl 2>&1"
    )
    try:
        done = subprocess.run(
            [*CREDPROXY, "exec", "--user", "nobody", "--principal", agent.name,
             "--proxy", f"127.0.0.1:{proxy.port}", "--", "sh", "-c", script],
            env=proxy.env, cwd=out, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert (out / "uid").read_text() == "65534\n"
        assert "Permission denied" in (out / "key").read_text()
        assert "Permission denied" in (out / "ca").read_text()
        assert (out / "nnp").read_text().split() == ["NoNewPrivs:", "1"]
        assert stamped(upstream) == [[f"Bearer {SECRET}"]], (out / "curl").read_text()
        assert not list(Path(tempfile.gettempdir()).glob("credproxy-ca-*/"))
    finally:
        shutil.rmtree(out)


def test_keep_env_never_passes_credproxys_own_settings(proxy: Proxy, agent: Agent):
    done = _exec_plain(
        proxy, agent, "--unsafe-state-access", "--keep-env", "CREDPROXY_MASTER_KEY", "true"
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "CREDPROXY_MASTER_KEY" in done.stderr
    assert tokens(proxy, agent) == []


def test_what_exec_sets_itself_is_not_reported_as_withheld(proxy: Proxy, agent: Agent):
    caller = {"AWS_CA_BUNDLE": "/etc/ssl/aws.pem", "SSL_CERT_DIR": "/etc/ssl/certs"}
    done = credproxy(
        proxy, "exec", "--unsafe-state-access", "--principal", agent.name,
        "--proxy", f"127.0.0.1:{proxy.port}", "--", "env", env=caller,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (said,) = [line for line in done.stderr.splitlines() if "not passed" in line]
    assert "SSL_CERT_DIR" in said.split() and "AWS_CA_BUNDLE" not in said.split()
    inside = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert "SSL_CERT_DIR" not in inside
    assert inside["AWS_CA_BUNDLE"] == inside["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"]
    assert inside["AWS_CA_BUNDLE"].endswith("credproxy-ca.pem")


def test_execs_readiness_probe_writes_no_denial(proxy: Proxy, agent: Agent):
    """Each run: one `internal` line for the principal, and no 407 `auth-required` deny with
    no principal (what token guessing looks like) from the probe."""
    runs = 4
    for _ in range(runs):
        assert exec_(proxy, agent, "true").returncode == 0
    lines = [line for line in proxy.audit() if line.get("host") == "credproxy.internal"]
    assert [line for line in lines if line.get("decision") == "deny"] == []
    mine = [line for line in lines if line.get("principal") == agent.name]
    assert [line["decision"] for line in mine] == ["internal"] * runs


def test_a_not_loaded_answer_reads_no_credentials(proxy: Proxy, agent: Agent):
    """`?loaded=N` past the proxy's counter is answered 503 whatever the token: no oracle.
    Once loaded, a wrong token is the usual denial."""

    def probe(loaded: int) -> Reply:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            return exchange(
                sock,
                f"GET http://credproxy.internal/access-requests/0?loaded={loaded} HTTP/1.1\r\n"
                f"Host: credproxy.internal\r\nProxy-Authorization: {proxy_auth(agent.name, 'x')}"
                "\r\nConnection: close\r\n\r\n".encode(),
            )

    far = probe(10**17)
    assert (far.status, far.reason) == (503, "policy-loading")
    assert [line for line in proxy.audit() if "policy-loading" in json.dumps(line)] == []
    now = probe(0)
    assert (now.status, now.reason) == (407, "auth-required")
