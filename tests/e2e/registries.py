"""What real package clients talk to, as Upstream apps: an npm registry with one scoped
package, a PEP 503 simple index with one wheel, and git's smart HTTP through `git http-backend`.

Each answers 401 unless the request carries the credential credproxy stamps, so a client that
succeeds shows the stamp arrived; each answers only the exact paths a client should send.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.upstream import Answer, Received

NPM_HOST, PYPI_HOST, GIT_HOST = "registry.test", "pypi.test", "git.test"
HOSTS = [NPM_HOST, PYPI_HOST, GIT_HOST]

SCOPE, PACKAGE, VERSION = "@scope", "name", "1.0.0"
# npm asks for `/@scope%2fname`; credproxy forwards the escape upper-cased, and only that is served.
PACKUMENT_PATH = f"/{SCOPE}%2F{PACKAGE}"
TARBALL_PATH = f"/{SCOPE}/{PACKAGE}/-/{PACKAGE}-{VERSION}.tgz"
WHEEL = "tinypkg-1.0-py3-none-any.whl"
INDEX_PATH = "/simple/tinypkg/"
WHEEL_PATH = f"/files/{WHEEL}"
REPO = "/repo.git"


def basic(user_password: str) -> str:
    return "Basic " + base64.b64encode(user_password.encode()).decode()


def _gzip_tar(files: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def _wheel() -> bytes:
    files = {
        "tinypkg/__init__.py": b"VALUE = 42\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: credproxy-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = [
        f"{name},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}"
        for name, data in files.items()
    ]
    record.append("tinypkg-1.0.dist-info/RECORD,,")
    files["tinypkg-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return out.getvalue()


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


@dataclass
class Registries:
    """The three services behind one Upstream, told apart by the Host header."""

    npm_auth: str
    pypi_auth: str
    git_auth: str
    git_root: Path

    def __post_init__(self) -> None:
        self.tarball = _gzip_tar(
            {
                "package/package.json": json.dumps(
                    {"name": f"{SCOPE}/{PACKAGE}", "version": VERSION, "main": "index.js"}
                ).encode(),
                "package/index.js": b"module.exports = 42;\n",
            }
        )
        self.wheel = _wheel()

    def __call__(self, r: Received) -> Answer | None:
        host = (r.header("host") or [""])[0].split(":")[0]
        expected = {
            NPM_HOST: self.npm_auth,
            PYPI_HOST: self.pypi_auth,
            GIT_HOST: self.git_auth,
        }.get(host)
        if expected is None:
            return None
        if r.header("authorization") != [expected]:
            return 401, [("www-authenticate", 'Basic realm="registry"')], b"unauthorized\n"
        if host == NPM_HOST:
            return self._npm(r)
        if host == PYPI_HOST:
            return self._pypi(r)
        return self._git(r)

    def _npm(self, r: Received) -> Answer:
        if r.method in ("GET", "HEAD") and r.target == PACKUMENT_PATH:
            dist = {
                "tarball": f"https://{NPM_HOST}{TARBALL_PATH}",
                "shasum": hashlib.sha1(self.tarball).hexdigest(),
                "integrity": "sha512-"
                + base64.b64encode(hashlib.sha512(self.tarball).digest()).decode(),
            }
            version = {"name": f"{SCOPE}/{PACKAGE}", "version": VERSION, "dist": dist}
            packument = {
                "name": f"{SCOPE}/{PACKAGE}",
                "dist-tags": {"latest": VERSION},
                "versions": {VERSION: version},
            }
            return 200, [("content-type", "application/json")], json.dumps(packument).encode()
        if r.method in ("GET", "HEAD") and r.target == TARBALL_PATH:
            return 200, [("content-type", "application/octet-stream")], self.tarball
        return 404, [("content-type", "application/json")], b'{"error":"not found"}'

    def _pypi(self, r: Received) -> Answer:
        if r.method in ("GET", "HEAD") and r.target == INDEX_PATH:
            digest = hashlib.sha256(self.wheel).hexdigest()
            page = (
                "<!DOCTYPE html><html><body>"
                f'<a href="https://{PYPI_HOST}{WHEEL_PATH}#sha256={digest}">{WHEEL}</a>'
                "</body></html>"
            )
            return 200, [("content-type", "text/html")], page.encode()
        if r.method in ("GET", "HEAD") and r.target == WHEEL_PATH:
            return 200, [("content-type", "application/octet-stream")], self.wheel
        return 404, [("content-type", "text/plain")], b"not found\n"

    def _git(self, r: Received) -> Answer:
        """One CGI call of `git http-backend` (git's own smart HTTP server)."""
        path, _, query = r.target.partition("?")
        if not path.startswith(REPO + "/"):
            return 404, [("content-type", "text/plain")], b"not found\n"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.git_root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "GATEWAY_INTERFACE": "CGI/1.1",
            "REQUEST_METHOD": r.method,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "CONTENT_TYPE": (r.header("content-type") or [""])[0],
            "CONTENT_LENGTH": str(len(r.body)),
            "REMOTE_ADDR": "127.0.0.1",
        }
        for name, value in r.headers:
            if name.lower() not in ("content-type", "content-length", "transfer-encoding"):
                env["HTTP_" + name.upper().replace("-", "_")] = value
        out = subprocess.run(
            ["git", "http-backend"], input=r.body, env=env, capture_output=True, timeout=30
        ).stdout
        sep = b"\r\n\r\n" if b"\r\n\r\n" in out else b"\n\n"
        head, _, body = out.partition(sep)
        status, fields = 200, []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                fields.append((name, value.strip()))
        return status, fields, body


def make_git_repo(root: Path) -> str:
    """A bare repository `repo.git` under `root` with one commit; returns the commit id."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(root),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    work = root / "work"
    work.mkdir()
    (work / "README").write_text("hello from git.test\n")

    def git(*args: str, cwd: Path = work) -> str:
        return subprocess.run(
            ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True, timeout=30
        ).stdout.strip()

    git("init", "-q", "-b", "main")
    git("add", "README")
    git("commit", "-q", "-m", "first")
    git("clone", "-q", "--bare", str(work), str(root / "repo.git"), cwd=root)
    return git("rev-parse", "HEAD")
