"""`credproxy demo` (`make demo`), run as a newcomer runs it: a subprocess, offline."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from addon.cli.demostage import Stage
from tests.clihelp import COMMAND

pytestmark = pytest.mark.e2e

SECRET = re.compile(r"demo-sk-[0-9a-f]{24}")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CREDPROXY_")}
    return env | {"COLUMNS": "120", "PYTHONPATH": str(Path(__file__).parents[2])}


def _directory(output: str) -> Path:
    found = re.search(r"^credproxy demo(?: --keep)?, in (\S+) ", output, re.M)
    assert found, output
    return Path(found.group(1))


def _processes_in(directory: Path) -> list[int]:
    """Processes whose command line names the demo's directory (its proxy, say)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(directory).encode() in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def demo() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, "demo"], capture_output=True, text=True, timeout=120, env=_env(), cwd="/"
    )


def test_the_demo_succeeds_quietly(demo: subprocess.CompletedProcess[str]) -> None:
    assert (demo.returncode, demo.stderr) == (0, ""), demo.stdout + demo.stderr


@pytest.mark.parametrize(
    "shown",
    [
        pytest.param(
            r"^\$ credproxy run --listen 127\.0\.0\.1:0 --upstream-ca \S+ --resolve "
            r"api\.demo\.test=127\.0\.0\.1:\d+$",
            id="the proxy wired to the upstream",
        ),
        pytest.param(r"^agent sent +upstream received +agent got back$", id="three columns"),
        pytest.param(
            r"^Authorization: Bearer placeholder +Authorization: Bearer demo-sk-… +"
            r'\{"ok": true, "path": "/v1/models"\}$',
            id="a stamped request, the secret masked where the upstream got it",
        ),
        pytest.param(
            r"^GET https://api\.demo\.test/admin/users +\(nothing\) +403 Forbidden\n"
            r"Authorization: Bearer placeholder +X-Credproxy-Reason: path-not-allowed$",
            id="a denied path and its reason, the upstream untouched",
        ),
        pytest.param(r"\[REDACTED\]", id="an echoed secret redacted"),
        pytest.param(
            r"^POST https://api\.demo\.test/v1/messages +\(nothing\) +403 Forbidden\n"
            r"Authorization: Bearer placeholder +X-Credproxy-Reason: grant-consumed$",
            id="a once-grant used twice",
        ),
        pytest.param(
            r"^audit: decision=deny reason=path-not-allowed status=403$",
            id="the audit line's decision",
        ),
    ],
)
def test_the_demo_shows(demo: subprocess.CompletedProcess[str], shown: str) -> None:
    assert re.search(shown, demo.stdout, re.M), demo.stdout


def test_the_demo_never_prints_the_secret_nor_the_token(
    demo: subprocess.CompletedProcess[str],
) -> None:
    assert not SECRET.search(demo.stdout + demo.stderr)
    # What `principal add` prints (the token, the proxy URL holding it) is never shown.
    assert not re.search(r"^ *(token|proxy_url) ", demo.stdout, re.M)
    assert "agent:" not in demo.stdout


def test_the_demo_cleans_up(demo: subprocess.CompletedProcess[str]) -> None:
    directory = _directory(demo.stdout)
    assert not directory.exists()
    assert _processes_in(directory) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_an_interrupted_demo_cleans_up(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "demo.out"
    with out.open("w") as stdout:
        process = subprocess.Popen(
            [*COMMAND, "demo"], stdout=stdout, stderr=subprocess.PIPE, env=_env(), cwd="/"
        )
    # Interrupted while its proxy starts or serves: well before the demo could end.
    deadline = time.monotonic() + 60
    while "$ credproxy run" not in out.read_text() and time.monotonic() < deadline:
        assert process.poll() is None, out.read_text()
        time.sleep(0.02)
    directory = _directory(out.read_text())
    while not _processes_in(directory) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(_processes_in(directory)) == 1  # `credproxy run`, started by the demo
    process.send_signal(sig)
    assert process.wait(30) == 130
    assert process.stderr is not None and process.stderr.read() == b""
    assert not directory.exists()
    assert _processes_in(directory) == []


def test_a_step_interrupted_is_an_interrupt_not_a_failure(tmp_path: Path) -> None:
    # main() answers Ctrl-C with status 130: the demo must stop as interrupted, never say
    # "credproxy init failed:" with an empty reason.
    with pytest.raises(KeyboardInterrupt):
        Stage(tmp_path, lambda argv: 130).cli("init")


def test_ctrl_c_at_the_first_step_exits_130_quietly(tmp_path: Path) -> None:
    out = tmp_path / "demo.out"
    with out.open("w") as stdout:
        process = subprocess.Popen(
            [*COMMAND, "demo"], stdout=stdout, stderr=subprocess.PIPE, env=_env(), cwd="/"
        )
    deadline = time.monotonic() + 60
    while "$ credproxy init" not in out.read_text() and time.monotonic() < deadline:
        assert process.poll() is None, out.read_text()
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    assert process.wait(30) == 130
    assert process.stderr is not None and process.stderr.read() == b""
    assert not _directory(out.read_text()).exists()


def test_make_demo_runs_it() -> None:
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    assert re.search(r"\ndemo: \$\(STAMP\)( ## [^\n]*)?\n\t\$\(BIN\)/credproxy demo\n", makefile)


# -- demo --keep: the walkthrough's upstream and proxy (tests/test_readme.py runs it through) --


def _keep(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / "keep.out"
    with out.open("w") as stdout:
        process = subprocess.Popen(
            [*COMMAND, "demo", "--keep", *args],
            stdout=stdout,
            stderr=subprocess.PIPE,
            env=_env(),
            cwd="/",
        )
    return process, out


def test_the_kept_demo_serves_until_ctrl_c_then_cleans_up(tmp_path: Path) -> None:
    process, out = _keep(tmp_path, "--listen", "127.0.0.1:0")
    deadline = time.monotonic() + 60
    while '"proxy.started"' not in out.read_text() and time.monotonic() < deadline:
        assert process.poll() is None, out.read_text()
        time.sleep(0.05)
    directory = _directory(out.read_text())
    env_file = directory / "env"
    assert env_file.stat().st_mode & 0o777 == 0o600
    exported = dict(
        line.removeprefix("export ").split("=", 1) for line in env_file.read_text().splitlines()
    )
    assert list(exported) == [
        "CREDPROXY_DB",
        "CREDPROXY_KEY_FILE",
        "CREDPROXY_CERTS",
        "CREDPROXY_ADVERTISE",
        "DEMO_SECRET",
    ]
    assert SECRET.fullmatch(exported["DEMO_SECRET"])
    assert re.search(
        rf"^  CREDPROXY_DB=sqlite:///{directory}/credproxy\.db$", out.read_text(), re.M
    )
    assert "  DEMO_SECRET=demo-sk-…\n" in out.read_text()
    assert len(_processes_in(directory)) == 1  # its `credproxy run`
    process.send_signal(signal.SIGINT)
    assert process.wait(30) == 0
    assert process.stderr is not None and process.stderr.read() == b""
    assert not directory.exists()
    assert _processes_in(directory) == []
    assert not SECRET.search(out.read_text())
    assert json.loads(out.read_text().splitlines()[-1])["event"] == "proxy.stopped"


def test_the_kept_demo_on_a_port_taken_says_so(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process, out = _keep(tmp_path, "--listen", f"127.0.0.1:{port}")
        assert process.wait(60) == 2
    assert process.stderr is not None
    assert process.stderr.read().decode() == (
        f"credproxy: error: credproxy run exited: cannot listen on --listen 127.0.0.1:{port}: "
        f"127.0.0.1:{port} is already in use\n"
    )
    assert not _directory(out.read_text()).exists()


def test_listen_goes_with_keep() -> None:
    done = subprocess.run(
        [*COMMAND, "demo", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "credproxy: error: --listen goes with --keep: the demo's own proxy takes any free port\n"
    )


def test_an_interrupt_while_a_child_starts_is_held_until_the_child_is_known() -> None:
    """Ctrl-C or SIGTERM during Popen would orphan `credproxy run` (CI saw one left running):
    the interrupt waits for the end of the block that starts the child, then stops the demo."""
    from addon.cli.demostage import interrupt, uninterrupted

    started = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            interrupt(signal.SIGTERM, None)  # held: the child is being started
            started.append("child")
    assert started == ["child"]
    with pytest.raises(KeyboardInterrupt):
        interrupt(signal.SIGINT, None)  # outside: at once
    with uninterrupted():
        pass  # nothing held is left over
