"""`credproxy run` refuses broken start-up files with one line and status 2, before it serves,
and leaves no temporary folder behind however its start-up ends."""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from store.ca import PRIVATE_BUNDLE as BUNDLE
from store.ca import PUBLIC_CERT as PUBLIC
from tests.e2e.conftest import CREDPROXY, _env

ERROR = "credproxy: error: "

# Loaded by every worker through PYTHONPATH: SIGKILL once it has made its temporary folder, as
# the OOM killer or the supervisor's start-up deadline would end it, with no chance to clean.
_KILLED = """
import os, signal, tempfile
if os.environ.get("CREDPROXY_WORKER"):
    _mkdtemp = tempfile.mkdtemp
    def mkdtemp(*args, **kwargs):
        path = _mkdtemp(*args, **kwargs)
        if kwargs.get("prefix") == "credproxy-":
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    tempfile.mkdtemp = mkdtemp
"""


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _key_pem(key: rsa.RSAPrivateKey, password: bytes | None = None) -> bytes:
    encryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, encryption
    )


def _expired_ca(certs: Path) -> None:
    """A CA whose certificate expired yesterday, its key its own, its public copy the same."""
    key = _key()
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "credproxy CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .serial_number(x509.random_serial_number())
        .subject_name(name)
        .issuer_name(name)
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now - datetime.timedelta(days=1))
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (certs / BUNDLE).write_bytes(_key_pem(key) + cert_pem)
    (certs / PUBLIC).write_bytes(cert_pem)


def _pem_blocks(path: Path, marker: bytes) -> bytes:
    """The PEM blocks of `path` whose BEGIN line holds `marker`."""
    kept, keeping = [], False
    for line in path.read_bytes().splitlines(keepends=True):
        keeping = keeping or (line.startswith(b"-----BEGIN") and marker in line)
        if keeping:
            kept.append(line)
        if line.startswith(b"-----END"):
            keeping = False
    return b"".join(kept)


Change = Callable[[Path], None]  # applied to the home before `run`


@dataclass(frozen=True)
class Case:
    change: Change
    args: tuple[str, ...]
    line: str  # the one line expected on stderr, after "credproxy: error: "; {home}, {port}
    exact: bool = True  # else: the line's beginning
    end: str = ""  # the line's end, when not exact
    unreadable: bool = False  # run without the capabilities that read any file as root
    killed_workers: bool = False


def _certs(change: Callable[[Path], None]) -> Change:
    return lambda home: change(home / "certs")


def _write(name: str, data: Callable[[Path], bytes]) -> Change:
    """Replace certs/`name` with data computed from the certs folder."""

    def change(certs: Path) -> None:
        (certs / name).write_bytes(data(certs))

    return _certs(change)


def _upstream(data: Callable[[Path], bytes]) -> Change:
    def change(home: Path) -> None:
        (home / "upstream.pem").write_bytes(data(home))

    return change


def _nothing(home: Path) -> None:
    pass


def _unreadable_upstream(home: Path) -> None:
    shutil.copy(home / "certs" / PUBLIC, home / "upstream.pem")
    (home / "upstream.pem").chmod(0)


BUNDLE_PATH = "{home}/certs/" + BUNDLE
CA_FILE = "CA file " + BUNDLE_PATH
PUBLIC_FILE = "CA file {home}/certs/" + PUBLIC
UPSTREAM = ("--upstream-ca", "upstream.pem")
GOOD_UPSTREAM = ("--upstream-ca", "certs/" + PUBLIC)

CASES = {
    "a CA bundle truncated inside its key": Case(
        _write(BUNDLE, lambda c: (c / BUNDLE).read_bytes()[:1500]),
        (),
        f"{CA_FILE}: its private key cannot be read (truncated or corrupt PEM)",
    ),
    "a CA bundle truncated inside its certificate": Case(
        _write(BUNDLE, lambda c: (c / BUNDLE).read_bytes()[:-100]),
        (),
        f"{CA_FILE}: a certificate in it cannot be read (truncated or corrupt PEM)",
    ),
    "a CA bundle with a certificate and no key": Case(
        _write(BUNDLE, lambda c: (c / PUBLIC).read_bytes()),
        (),
        f"{CA_FILE} holds no PEM private key",
    ),
    "a CA bundle with a key and no certificate": Case(
        _write(BUNDLE, lambda c: _pem_blocks(c / BUNDLE, b"PRIVATE KEY")),
        (),
        f"{CA_FILE} holds no PEM certificate",
    ),
    "a CA bundle of garbage": Case(
        _write(BUNDLE, lambda c: b"garbage\n"),
        (),
        f"{CA_FILE} holds no PEM private key",
    ),
    "an empty CA bundle": Case(
        _write(BUNDLE, lambda c: b""),
        (),
        f"{CA_FILE} is empty",
    ),
    "a CA bundle whose key is not its certificate's": Case(
        _write(BUNDLE, lambda c: _key_pem(_key()) + (c / PUBLIC).read_bytes()),
        (),
        f"{CA_FILE}: its private key does not match its certificate",
    ),
    "a CA bundle whose key is encrypted": Case(
        _write(BUNDLE, lambda c: _key_pem(_key(), b"pw") + (c / PUBLIC).read_bytes()),
        (),
        f"{CA_FILE}: its private key is encrypted",
    ),
    "an expired CA": Case(
        _certs(_expired_ca),
        (),
        f"{CA_FILE}: its certificate expired on "
        f"{datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1):%Y-%m-%d}",
    ),
    "no CA bundle": Case(
        _certs(lambda c: (c / BUNDLE).unlink()),
        (),
        f"{CA_FILE} does not exist: run credproxy init",
    ),
    "an unreadable CA bundle": Case(
        _certs(lambda c: (c / BUNDLE).chmod(0)),
        (),
        f"{CA_FILE} cannot be read: Permission denied",
        unreadable=True,
    ),
    "a public CA copy of another CA": Case(
        _write(PUBLIC, lambda c: trustme.CA().cert_pem.bytes()),
        (),
        f"{PUBLIC_FILE} is not the certificate in {BUNDLE_PATH}, so clients would not trust "
        f"the proxy: remove it and run credproxy init to write it again",
    ),
    "no public CA copy": Case(
        _certs(lambda c: (c / PUBLIC).unlink()),
        (),
        f"{PUBLIC_FILE} does not exist: run credproxy init",
    ),
    "a public CA copy of garbage": Case(
        _write(PUBLIC, lambda c: b"garbage\n"),
        (),
        f"{PUBLIC_FILE} holds no PEM certificate",
    ),
    "a CA bundle of garbage under --workers 2": Case(
        _write(BUNDLE, lambda c: b"garbage\n"),
        ("--workers", "2"),
        f"{CA_FILE} holds no PEM private key",
    ),
    "--upstream-ca naming a README": Case(
        _nothing,
        ("--upstream-ca", "README.md"),
        "--upstream-ca README.md holds no PEM certificate",
    ),
    "an empty --upstream-ca": Case(
        _upstream(lambda h: b"\n"),
        UPSTREAM,
        "--upstream-ca upstream.pem is empty",
    ),
    "an --upstream-ca with a key and no certificate": Case(
        _upstream(lambda h: _key_pem(_key())),
        UPSTREAM,
        "--upstream-ca upstream.pem holds no PEM certificate",
    ),
    "a truncated --upstream-ca": Case(
        _upstream(lambda h: (h / "certs" / PUBLIC).read_bytes()[:-100]),
        UPSTREAM,
        "--upstream-ca upstream.pem: a certificate in it cannot be read (truncated or corrupt PEM)",
    ),
    "a missing --upstream-ca": Case(
        _nothing,
        UPSTREAM,
        "--upstream-ca upstream.pem does not exist",
    ),
    "an unreadable --upstream-ca": Case(
        _unreadable_upstream,
        UPSTREAM,
        "--upstream-ca upstream.pem cannot be read: Permission denied",
        unreadable=True,
    ),
    "--admin on an address in use": Case(
        _nothing,
        ("--admin", "127.0.0.1:{port}", *GOOD_UPSTREAM),
        "cannot listen on --admin 127.0.0.1:{port}: ",
        exact=False,
    ),
    "--admin on an address in use, under --workers 2": Case(
        _nothing,
        ("--admin", "127.0.0.1:{port}", "--workers", "2", *GOOD_UPSTREAM),
        "cannot listen on --admin 127.0.0.1:{port}: ",
        exact=False,
    ),
    "--listen on an address in use": Case(
        _nothing,
        ("--listen", "127.0.0.1:{port}", *GOOD_UPSTREAM),
        "cannot listen on --listen 127.0.0.1:{port}: 127.0.0.1:{port} is already in use",
    ),
    "workers killed in start-up": Case(
        _nothing,
        ("--workers", "2", *GOOD_UPSTREAM),
        "worker ",
        exact=False,
        end=" exited at start-up (status -9)",
        killed_workers=True,
    ),
}


@dataclass(frozen=True)
class Outcome:
    status: int | None  # None: it started serving
    stdout: str
    stderr: str
    tmp_before: list[str]
    tmp_after: list[str]


def _without_dac(command: list[str]) -> list[str]:
    """As root, a file of mode 000 is read all the same: drop the capabilities that do it."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: no file is unreadable")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search", *command]


def _start(case: Case, home: Path, port: int) -> Outcome:
    case.change(home)
    tmp = home / "tmp"
    tmp.mkdir()
    env = _env(home) | {"TMPDIR": str(tmp)}
    if case.killed_workers:
        (home / "site").mkdir()
        (home / "site" / "sitecustomize.py").write_text(_KILLED)
        paths = [str(home / "site"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    args = [a.format(port=port) for a in case.args]
    if "--listen" not in args:
        args = ["--listen", "127.0.0.1:0", *args]
    command = [*CREDPROXY, "run", *args]
    if case.unreadable:
        command = _without_dac(command)
    before = sorted(os.listdir(tmp))
    out, err = home / "run.out", home / "run.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen(command, env=env, cwd=home, stdout=stdout, stderr=stderr)
    deadline = time.monotonic() + 30
    status: int | None = None
    while time.monotonic() < deadline:
        status = process.poll()
        if status is not None or '"proxy.started"' in out.read_text():
            break
        time.sleep(0.05)
    if status is None:  # serving, or hung: either way not the refusal expected
        process.kill()
        process.wait(10)
    return Outcome(status, out.read_text(), err.read_text(), before, sorted(os.listdir(tmp)))


@pytest.fixture(scope="module")
def taken() -> Iterator[int]:
    """A port listened on at 127.0.0.1."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in CASES])
def test_a_start_up_refusal_is_one_line_and_leaves_no_temporary_folder(
    tmp_path: Path, initialised_home: Path, taken: int, name: str
) -> None:
    case, home = CASES[name], tmp_path / "home"
    shutil.copytree(initialised_home, home)
    shutil.copy(Path(__file__).parents[2] / "README.md", home / "README.md")
    outcome = _start(case, home, taken)
    assert outcome.status == 2, (outcome.stdout, outcome.stderr)
    assert "Traceback" not in outcome.stderr + outcome.stdout
    (line,) = outcome.stderr.splitlines()
    expected = ERROR + case.line.format(home=home, port=taken)
    if case.exact:
        assert line == expected
    else:
        assert line.startswith(expected) and line.endswith(case.end)
    if not case.killed_workers:
        assert outcome.stdout == ""  # refused before anything was served or logged
    assert outcome.tmp_before == []
    assert outcome.tmp_after == []
