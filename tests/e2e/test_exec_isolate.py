"""`credproxy exec --isolate`: the proxy is the only way out, CMD holds no token, and it can
neither read nor change credproxy's state. Real bubblewrap, a real proxy, real clients."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import CREDPROXY, NAMES, Proxy, start_proxy, stop_proxy
from tests.e2e.test_exec import SECRET, Agent, make_agent, stamped, tokens
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e


def _namespaces() -> str | None:
    """Why --isolate cannot work here, or None."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    done = subprocess.run(
        ["bwrap", "--ro-bind", "/", "/", "--unshare-all", "true"], capture_output=True, text=True
    )
    return None if done.returncode == 0 else f"bwrap cannot make namespaces: {done.stderr.strip()}"


WHY = _namespaces()
needs_namespaces = pytest.mark.skipif(
    WHY is not None and not os.environ.get("CI"), reason=WHY or ""
)


# exec as root runs the sandbox as another user (root in a user namespace is still root to
# the kernel's permission checks); that user needs folders and a Python it can reach.
AS_USER: tuple[str, ...] = ("--user", "nobody") if os.geteuid() == 0 else ()
PYTHON = "/usr/bin/python3" if os.geteuid() == 0 else sys.executable


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A folder the sandbox's user can use (pytest's own are closed to other users)."""
    folder = Path(tempfile.mkdtemp(dir="/var/tmp"))  # noqa: S108
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def agent(proxy: Proxy, names) -> Agent:
    return make_agent(proxy, names)


def isolated(
    proxy: Proxy,
    agent: Agent,
    *command: str,
    flags: tuple[str, ...] = (),
    cwd: Path | None = None,
    pass_fds: tuple[int, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """exec --isolate from a working directory of its own (the proxy's home holds the state)."""
    work = cwd or Path("/var/tmp") / f"credproxy-test-work-{os.getpid()}"  # noqa: S108
    work.mkdir(exist_ok=True)
    work.chmod(0o777)
    return subprocess.run(
        [
            *CREDPROXY,
            "exec",
            "--isolate",
            *AS_USER,
            *flags,
            "--principal",
            agent.name,
            "--proxy",
            f"127.0.0.1:{proxy.port}",
            "--",
            *command,
        ],
        env={**proxy.env, **(env or {})},
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
        pass_fds=pass_fds,
    )


@needs_namespaces
def test_curl_goes_through_the_proxy_and_holds_no_token(
    proxy: Proxy, upstream: Upstream, agent: Agent, tmp_path: Path
):
    env_file = tmp_path / "env"
    done = isolated(
        proxy,
        agent,
        "sh",
        "-c",
        f"env > {env_file}; curl -sS https://api.test/v1/isolated",
        flags=("--rw", str(tmp_path)),
    )
    assert done.returncode == 0, done.stderr
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]
    inside = env_file.read_text()
    assert f"https_proxy=http://127.0.0.1:{proxy.port}\n" in inside
    assert "@" not in "".join(line for line in inside.splitlines() if "proxy" in line.lower())
    assert f"{agent.name}:" not in inside
    (entry,) = proxy.store.list_tokens(agent.name)
    assert entry.state == "revoked"


@needs_namespaces
def test_a_direct_connection_to_the_upstream_fails_and_the_proxy_reaches_it(
    proxy: Proxy, upstream: Upstream, agent: Agent
):
    script = f"""
import socket, urllib.request
try:
    socket.create_connection(("127.0.0.1", {upstream.port}), timeout=5)
    print("direct: reached")
except OSError as e:
    print("direct: failed")
try:
    socket.getaddrinfo("example.com", 443)
    print("dns: resolved")
except OSError:
    print("dns: failed")
print("proxy:", urllib.request.urlopen("https://api.test/v1/py").status)
"""
    done = isolated(proxy, agent, PYTHON, "-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["direct: failed", "dns: failed", "proxy: 200"]
    # The same server takes connections from outside: the namespace is what stopped it.
    socket.create_connection(("127.0.0.1", upstream.port), timeout=5).close()
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]


@needs_namespaces
def test_the_exit_status_passes_through_the_namespace(proxy: Proxy, agent: Agent):
    assert isolated(proxy, agent, "sh", "-c", "exit 9").returncode == 9
    assert isolated(proxy, agent, "sh", "-c", "kill -TERM $$").returncode == 128 + 15
    assert set(tokens(proxy, agent)) == {"revoked"}


@needs_namespaces
def test_java_httpclient_works_with_no_authenticator(
    proxy: Proxy, upstream: Upstream, agent: Agent, tmp_path: Path
):
    if shutil.which("java") is None or shutil.which("keytool") is None:
        pytest.skip("java and keytool are not installed")
    source = tmp_path / "Get.java"
    source.write_text(
        "import java.net.*; import java.net.http.*;\n"
        "public class Get { public static void main(String[] a) throws Exception {\n"
        "  var c = HttpClient.newBuilder().proxy(ProxySelector.getDefault()).build();\n"
        '  var r = c.send(HttpRequest.newBuilder(URI.create("https://api.test/v1/java")).build(),\n'
        "    HttpResponse.BodyHandlers.ofString());\n"
        "  System.out.println(r.statusCode()); } }\n"
    )
    done = isolated(proxy, agent, "java", str(source), flags=("--ro", str(tmp_path)))
    assert done.stdout.strip().splitlines()[-1:] == ["200"], done.stderr
    assert stamped(upstream) == [[f"Bearer {SECRET}"]]


def test_without_namespaces_isolate_refuses_and_never_runs_the_command(
    proxy: Proxy, agent: Agent, tmp_path: Path
):
    marker = tmp_path / "ran"
    empty = tmp_path / "bin"
    empty.mkdir()
    (empty / "bwrap").write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n"
    )
    (empty / "bwrap").chmod(0o755)
    path = f"{empty}:{os.environ['PATH']}"
    done = subprocess.run(
        [
            *CREDPROXY,
            "exec",
            "--isolate",
            *AS_USER,
            "--principal",
            agent.name,
            "--proxy",
            f"127.0.0.1:{proxy.port}",
            "--",
            "touch",
            str(marker),
        ],
        env={**proxy.env, "PATH": path},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "cannot create its sandbox" in done.stderr
    assert not marker.exists()
    assert tokens(proxy, agent) == []


ATTACKS = r"""
import ctypes, json, os, socket, subprocess, sys
home, proxy_pid = sys.argv[1], int(sys.argv[2])
tried = {}

def attempt(name, action):
    try:
        action()
        tried[name] = "succeeded"
    except Exception as e:
        tried[name] = type(e).__name__

def read(path):
    with open(path, "rb") as f:
        f.read(1)

for name in ("credproxy.key", "credproxy.db", "credproxy.db-wal", "certs/mitmproxy-ca.pem"):
    attempt("read " + name, lambda name=name: read(os.path.join(home, name)))
def journal():  # a hot journal next to the store, if it lands on the host
    with open(os.path.join(home, "credproxy.db-journal"), "wb") as f:
        f.write(b"\xd9\xd5\x05\xf9\x20\xa1\x63\xd7" + bytes(504))
try:  # under /tmp it lands in the sandbox's own tmpfs: the host's folder is checked after
    journal()
except OSError:
    pass
certs = os.path.join(home, "certs")
tried["certs"] = sorted(os.listdir(certs)) if os.path.isdir(certs) else []
def grant_add():  # what `credproxy grant add` does to the store, by hand
    import sqlite3
    db = sqlite3.connect(f"file:{home}/credproxy.db?mode=rw", uri=True)
    db.execute("CREATE TABLE attacker (x)")
    db.commit()
attempt("change the store", grant_add)
def sysctl():  # the same value back: harmless if it lands, a kernel setting if it does
    path = "/proc/sys/kernel/core_uses_pid"
    value = open(path).read()
    with open(path, "w") as f:
        f.write(value)
attempt("write /proc/sys", sysctl)
def postgres():
    s = socket.socket(socket.AF_UNIX)
    s.connect("/run/postgresql/.s.PGSQL.5432")
attempt("connect /run/postgresql", postgres)
var_run = "/var/run/postgresql/.s.PGSQL.5432"
attempt("connect /var/run/postgresql", lambda: socket.socket(socket.AF_UNIX).connect(var_run))
attempt("read the proxy's environ", lambda: read(f"/proc/{proxy_pid}/environ"))
attempt("read the proxy's cmdline", lambda: read(f"/proc/{proxy_pid}/cmdline"))
libc = ctypes.CDLL(None, use_errno=True)
def ptrace():
    if libc.ptrace(16, proxy_pid, None, None) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), "ptrace")
attempt("ptrace the proxy", ptrace)
def umount():
    if libc.umount2(home.encode(), 2) != 0:  # MNT_DETACH
        raise OSError(ctypes.get_errno(), "umount")
attempt("unmount the hiding", umount)
# A folder descriptor leads out of every mount (`..` climbs the host's tree): none may be open.
folders = []
for fd in os.listdir("/proc/self/fd"):
    target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
    if target.startswith("/") and not target.startswith("/proc") and os.path.isdir(target):
        folders.append(target)
tried["folder descriptors"] = folders
def through_descriptors():
    for fd in range(3, 256):
        for up in (".", "..", "../..", "../../.."):
            try:
                read(f"/proc/self/fd/{fd}/{up}/credproxy.key")
                return
            except OSError:
                pass
    raise FileNotFoundError("no descriptor leads to the key")
attempt("read the key through a descriptor", through_descriptors)
status = open("/proc/self/status").read()
tried["NoNewPrivs"] = [l.split()[1] for l in status.splitlines() if l.startswith("NoNewPrivs")][0]
tried["CapEff"] = [l.split()[1] for l in status.splitlines() if l.startswith("CapEff")][0]
tried["CapBnd"] = [l.split()[1] for l in status.splitlines() if l.startswith("CapBnd")][0]
print(json.dumps(tried))
"""


@pytest.fixture(scope="module")
def proxy_off_tmp(shared_upstream: Upstream, upstream_ca, initialised_home: Path):
    """A proxy whose state lies outside /tmp (which the sandbox masks anyway), so that what
    hides it is the hidden set itself."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:  # noqa: S108
        home = Path(tmp) / "home"
        resolve = [f"{n}=127.0.0.1:{shared_upstream.port}" for n in NAMES if n != "localhost"]
        running = start_proxy(home, upstream_ca, resolve, template=initialised_home)
        if os.geteuid() == 0:
            # The state is the sandbox user's own, as on a laptop: only hiding keeps it out.
            Path(tmp).chmod(0o755)
            for path in [home, *home.rglob("*")]:
                os.chown(path, 65534, 65534)
        try:
            yield running
        finally:
            stop_proxy(running)


@needs_namespaces
@pytest.mark.parametrize("where", ["/tmp", "/var/tmp"])
def test_the_sandbox_can_neither_read_nor_change_credproxy_state(
    request: pytest.FixtureRequest, names, tmp_path: Path, where: str
):
    proxy = request.getfixturevalue("proxy" if where == "/tmp" else "proxy_off_tmp")
    agent = make_agent(proxy, names)
    assert str(proxy.home).startswith(where)
    script = tmp_path / "attacks.py"
    script.write_text(ATTACKS)
    grants_before = proxy.store.list_grants()
    assert Path("/run/postgresql/.s.PGSQL.5432").exists() or not os.environ.get("CI")
    # A folder of the state open in exec's caller (a shell's stray descriptor), passed down.
    stray = os.open(proxy.home, os.O_PATH | os.O_DIRECTORY)
    try:
        done = isolated(
            proxy,
            agent,
            PYTHON,
            str(script),
            str(proxy.home),
            str(proxy.process.pid),
            flags=("--ro", str(tmp_path)),
            pass_fds=(stray,),
        )
    finally:
        os.close(stray)
    assert done.returncode == 0, done.stderr
    tried = json.loads(done.stdout.splitlines()[-1])
    assert [k for k, v in tried.items() if v == "succeeded"] == []
    assert tried["folder descriptors"] == []
    assert set(tried["certs"]) <= {"credproxy-ca.pem"} | {n for n in tried["certs"] if ".p12" in n}
    assert tried["NoNewPrivs"] == "1"
    assert tried["CapEff"] == tried["CapBnd"] == "0000000000000000"
    assert proxy.store.list_grants() == grants_before
    assert not (proxy.home / "credproxy.db-journal").exists()
    # The same reads from outside work: the sandbox is what stopped them.
    assert (proxy.home / "credproxy.key").read_bytes()


@needs_namespaces
def test_a_working_directory_that_holds_the_state_is_refused(
    proxy: Proxy, agent: Agent, tmp_path: Path
):
    marker = tmp_path / "ran"
    done = isolated(proxy, agent, "touch", str(marker), cwd=proxy.home)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "working directory holds credproxy's state" in done.stderr
    assert str(proxy.home) in done.stderr
    assert not marker.exists()
    assert tokens(proxy, agent) == []


@needs_namespaces
@pytest.mark.parametrize("flag", ["--ro", "--rw"])
def test_no_bind_option_exposes_the_hidden_set(
    proxy: Proxy, agent: Agent, tmp_path: Path, flag: str
):
    for path in (proxy.home, proxy.home / "certs", proxy.home / "credproxy.key"):
        done = isolated(proxy, agent, "true", flags=(flag, str(path)))
        assert done.returncode == 2, (flag, path)
        assert (
            done.stderr.count("\n") == 1
            and "credproxy.key" in done.stderr
            or "certs" in (done.stderr)
        )
    assert tokens(proxy, agent) == []


@needs_namespaces
def test_only_the_sandbox_reaches_its_forwarder(proxy: Proxy, agent: Agent, tmp_path: Path):
    """The forwarder listens inside the sandbox's network: no socket file for another process
    of the same user to find, and nothing on the host's loopback."""
    script = tmp_path / "wait.sh"
    ready = tmp_path / "ready"
    script.write_text(f"touch {ready}; sleep 3\n")
    process = subprocess.Popen(
        [
            *CREDPROXY,
            "exec",
            "--isolate",
            *AS_USER,
            "--rw",
            str(tmp_path),
            "--principal",
            agent.name,
            "--proxy",
            f"127.0.0.1:{proxy.port}",
            "--",
            "sh",
            str(script),
        ],
        env=proxy.env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(200):
            if ready.exists():
                break
            time.sleep(0.05)
        assert ready.exists()
        sockets = subprocess.run(
            ["find", "/tmp", "-type", "s", "-newer", str(script)], capture_output=True, text=True
        ).stdout
        assert "credproxy" not in sockets
        # The proxy's own port is taken by the proxy: a second listener would have failed.
        found = [
            line
            for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
            if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == proxy.port
        ]
        assert len(found) == 1
    finally:
        process.wait(timeout=30)
    assert process.returncode == 0


@needs_namespaces
def test_a_signal_to_exec_reaches_the_command_in_its_own_session(
    proxy: Proxy, agent: Agent, tmp_path: Path
):
    ready = tmp_path / "ready"
    got = tmp_path / "got"
    process = subprocess.Popen(
        [
            *CREDPROXY,
            "exec",
            "--isolate",
            *AS_USER,
            "--rw",
            str(tmp_path),
            "--principal",
            agent.name,
            "--proxy",
            f"127.0.0.1:{proxy.port}",
            "--",
            "sh",
            "-c",
            f"trap 'echo TERM > {got}; exit 7' TERM; touch {ready}; while :; do sleep 0.1; done",
        ],
        env=proxy.env,
        cwd=tmp_path,
    )
    for _ in range(200):
        if ready.exists():
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 7
    assert got.read_text() == "TERM\n"


@needs_namespaces
@pytest.mark.skipif(os.geteuid() != 0, reason="exec runs as root only in CI's containers")
def test_as_root_the_sandbox_needs_another_user(proxy: Proxy, agent: Agent, tmp_path: Path):
    """Root in a user namespace keeps root's file permissions: it could write /proc/sys
    (kernel.core_pattern runs a program as the host's root) and read root's files."""
    marker = tmp_path / "ran"
    done = subprocess.run(
        [*CREDPROXY, "exec", "--isolate", "--principal", agent.name,
         "--proxy", f"127.0.0.1:{proxy.port}", "--", "touch", str(marker)],
        env=proxy.env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--user" in done.stderr, done.stderr
    assert not marker.exists()
    assert tokens(proxy, agent) == []


# Run in the sandbox: each argument's path, READ and what it holds, or refused and why.
READ_EACH = (
    "import sys\n"
    "for p in sys.argv[1:]:\n"
    "    try:\n"
    "        print(p, 'READ', open(p).read())\n"
    "    except OSError as e:\n"
    "        print(p, 'refused', type(e).__name__)\n"
)


@needs_namespaces
def test_a_secret_file_a_credential_references_is_hidden_in_the_sandbox(
    proxy: Proxy, agent: Agent, tmp_path: Path
):
    """A mounted Secret a credential's `file:` reference reads is a secret like the store's:
    the sandbox sees neither the file nor its folder, though they are readable by anyone."""
    mounted = tmp_path / "gh"
    (mounted / "..data").mkdir(parents=True)
    (mounted / "..data" / "token").write_text("gh-isolate-secret")
    (mounted / "token").symlink_to("..data/token")
    for path in (mounted, mounted / "..data"):
        path.chmod(0o755)
    (mounted / "..data" / "token").chmod(0o644)
    name = "ref-" + os.urandom(3).hex()
    proxy.store.add_credential(
        name, "bearer", ["api.test"], None, secret_ref=f"file:{mounted}/token"
    )
    done = isolated(
        proxy,
        agent,
        PYTHON,
        "-c",
        READ_EACH,
        str(mounted / "token"),
        str(mounted / "..data" / "token"),
    )
    assert done.returncode == 0, done.stderr
    assert "gh-isolate-secret" not in done.stdout and "READ" not in done.stdout
    assert done.stdout.count("refused") == 2
    # From outside, the same file reads: the sandbox is what hid it.
    assert (mounted / "token").read_text() == "gh-isolate-secret"


@needs_namespaces
def test_the_files_credproxy_logs_in_to_secret_backends_with_are_hidden(
    proxy: Proxy, agent: Agent, tmp_path: Path
):
    """Vault's token file and the AWS chain's credentials file, named by the variables
    credproxy reads them from: whoever reads them reads every secret they may, so the sandbox
    sees neither, though they are readable by anyone."""
    backend = tmp_path / "backend"
    backend.mkdir()
    backend.chmod(0o755)
    files = {"VAULT_TOKEN_FILE": "hvs.isolate-vault", "AWS_SHARED_CREDENTIALS_FILE": "aws-kept"}
    for var, value in files.items():
        (backend / var).write_text(value)
        (backend / var).chmod(0o644)
    done = isolated(
        proxy,
        agent,
        PYTHON,
        "-c",
        READ_EACH,
        *(str(backend / var) for var in files),
        env={var: str(backend / var) for var in files},
    )
    assert done.returncode == 0, done.stderr
    assert "READ" not in done.stdout and done.stdout.count("refused") == 2, done.stdout
    assert (backend / "VAULT_TOKEN_FILE").read_text() == "hvs.isolate-vault"
