"""The tutorial's five-minute walkthrough (docs/tutorial.md), run as written, offline, on the
upstream and proxy of `credproxy demo --keep`.

Each `$ command` of the walkthrough's console blocks runs in bash, in a directory of its own,
with only the token, the demo's directory and the proxy's port substituted; its output is
compared with the lines the page shows under it, what terminal 1 prints with its text and JSON
blocks. What varies from run to run (tokens, key ids, fingerprints, ports, directories,
request ids, times, sizes) is masked on both sides; JSON is compared by its keys and its fixed
values. So a change of any output (a deny body, an audit field, a table column, a line of the
demo's) fails here until the tutorial shows it. The page's GitHub variant is set up, as
written, on a store of its own: only its curl needs the internet.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"
FAKE_TOKEN = "ghp_readme_fake_0123456789abcdef"  # the GitHub variant's $GITHUB_TOKEN

# Values that differ from run to run, in text and in JSON.
MASKS = [
    (re.compile(r"(?:/[^\s/]+)*/credproxy-demo-[a-z0-9_]+"), "<demo-dir>"),
    (re.compile(r"\bid [0-9a-f]{12}\b"), "id <key-id>"),
    (re.compile(r"\bfp-[0-9a-f]{12}\b"), "fp-<fingerprint>"),
    (re.compile(r"\b127\.0\.0\.1:\d+"), "127.0.0.1:<port>"),
    (re.compile(r"(?i)^(content-length|date): .*$", re.M), r"\1: <varies>"),
]
VARYING_FIELDS = {
    "request_id",
    "ts",
    "pid",
    "client",
    "duration_ms",
    "dns_ms",
    "bytes_in",
    "listen",
}


def mask(text: str, token: str | None = None) -> str:
    if token:
        text = text.replace(token, "<token>")
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


def same_json(expected: Any, actual: Any, where: str) -> None:
    """Same keys, in the same order, and the same values but for VARYING_FIELDS."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert list(actual) == list(expected), f"{where}: keys differ"
        for key, value in expected.items():
            if key in VARYING_FIELDS:
                assert type(actual[key]) is type(value), f"{where}: {key}"
            else:
                same_json(value, actual[key], f"{where}.{key}")
    else:
        if isinstance(expected, str) and isinstance(actual, str):
            expected, actual = mask(expected), mask(actual)
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# -- the tutorial, read ------------------------------------------------------------------


@dataclass
class Step:
    command: str  # as the tutorial writes it, continuation lines joined
    expected: list[str] = field(default_factory=list)


@dataclass
class Walkthrough:
    steps: list[Step]  # the console blocks, in order
    audit: list[dict[str, Any]]  # every JSON line of the json blocks, in order
    upstream: list[str]  # every line of the text blocks: what the demo's upstream says it got


def _section(text: str, title: str) -> str:
    return text.split(f"# {title}\n", 1)[1].split("\n## ", 1)[0]


def read_walkthrough(text: str) -> Walkthrough:
    section = _section(text, "Five-minute walkthrough")
    steps: list[Step] = []
    audit: list[dict[str, Any]] = []
    upstream: list[str] = []
    for kind, body in re.findall(r"^```(console|json|text)\n(.*?)^```", section, re.M | re.S):
        if kind == "json":
            audit += [json.loads(line) for line in body.splitlines() if line.strip()]
            continue
        if kind == "text":
            upstream += body.splitlines()
            continue
        lines = iter(body.splitlines())
        for line in lines:
            if line.startswith("$ "):
                command = line[2:]
                while command.endswith("\\"):
                    command = command[:-1] + next(lines).strip()
                steps.append(Step(command))
            elif line.startswith("..."):
                continue  # make's own noise while it sets up .venv
            else:
                steps[-1].expected.append(line)
    return Walkthrough(steps, audit, upstream)


def test_the_walkthrough_is_read_as_expected() -> None:
    walkthrough = read_walkthrough(TUTORIAL.read_text())
    commands = [step.command.split()[:3] for step in walkthrough.steps]
    assert commands[:4] == [
        ["make", "venv"],
        [".venv/bin/credproxy", "demo", "--keep"],
        ["source", ".venv/bin/activate"],
        ["source", f"{SAMPLE_DIR}/env"],
    ]
    assert sum(c[0] == "curl" for c in commands) == 3
    assert [line["event"] for line in walkthrough.audit] == ["request"] * 3
    assert len(walkthrough.upstream) == 1


def test_make_run_runs_what_the_real_api_variant_says() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "LISTEN ?= 127.0.0.1:8080" in makefile
    assert (
        "\t$(BIN)/credproxy init\n\t$(BIN)/credproxy run --listen $(LISTEN) $(ARGS)\n" in makefile
    )
    assert _real_api_lines()[0] == "make run"


def _real_api_lines() -> list[str]:
    """The GitHub variant's sh block, continuation lines joined, comments dropped."""
    section = _section(TUTORIAL.read_text(), "Against a real API")
    (body,) = re.findall(r"^```sh\n(.*?)^```", section, re.M | re.S)
    return [
        line.partition("  #")[0].strip()
        for line in re.sub(r"\\\n\s*", "", body).splitlines()
        if line.strip()
    ]


def test_the_real_api_variant_sets_up_as_written(tmp_path: Path) -> None:
    """Its commands but make run (its two commands are checked above) and curl (the internet)."""
    setup = [
        line
        for line in _real_api_lines()
        if not line.startswith(("make ", "curl ", "source .venv/", "export HTTPS_PROXY="))
    ]
    assert [line.split()[:3] for line in setup] == [
        ["credproxy", "principal", "add"],
        ["printf", "'%s'", '"$GITHUB_TOKEN"'],
        ["credproxy", "grant", "add"],
    ]
    env = _env(tmp_path) | {"GITHUB_TOKEN": FAKE_TOKEN}
    script = "set -e\ncredproxy init >/dev/null\n" + "\n".join(setup) + "\n"
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stdout
    assert "added credential github (bearer, fp-" in done.stdout
    assert "added grant 1 for agent" in done.stdout
    assert FAKE_TOKEN not in done.stdout


# -- the walkthrough, run ----------------------------------------------------------------


@dataclass
class Terminal:
    """The operator's terminal: a directory, an environment, bash."""

    home: Path
    env: dict[str, str]
    proxy: subprocess.Popen[bytes] | None = None  # `credproxy demo --keep`: terminal 1
    port: int = 0
    token: str | None = None
    demo_dir: str | None = None

    def bash(self, command: str) -> str:
        """Run `command` with a terminal for its output, as the operator does: curl, for one,
        shows a progress meter on a pipe, and interleaves stdout and stderr otherwise."""
        ours, theirs = pty.openpty()
        process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.home,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=theirs,
            stderr=theirs,
        )
        os.close(theirs)
        output = b""
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                if select.select([ours], [], [], 0.1)[0]:
                    try:
                        chunk = os.read(ours, 65536)
                    except OSError:  # EIO: the terminal's other side is closed
                        break
                    if not chunk:
                        break
                    output += chunk
                elif process.poll() is not None:
                    break
        finally:
            os.close(ours)
            process.wait(10)
        # What the operator reads: no colours, lines ended as text (HTTP's own CR included).
        return re.sub(r"\r+\n", "\n", re.sub(r"\x1b\[[0-9;]*m", "", output.decode()))

    @property
    def terminal1(self) -> list[str]:
        return (self.home / "proxy.out").read_text().splitlines()

    @property
    def audit(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.terminal1 if line.startswith("{")]

    def wait(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if done():
                return
            time.sleep(0.05)
        raise AssertionError(f"no {what} within 10 s")


def _env(home: Path) -> dict[str, str]:
    """A terminal's environment: a `credproxy` on PATH (as `source .venv/bin/activate` puts one)
    that runs this checkout, and nothing of credproxy's or of a proxy's from the machine."""
    shim = home / ".venv" / "bin"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "credproxy").write_text(f'#!/bin/sh\nexec {sys.executable} -m addon.cli.cli "$@"\n')
    (shim / "credproxy").chmod(stat.S_IRWXU)
    (shim / "activate").write_text(f'export PATH="{shim}:$PATH"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CREDPROXY_")}
    env |= {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "NO_PROXY", "no_proxy"):
        env.pop(name, None)
    env["PATH"] = f"{shim}:{env['PATH']}"
    env["HOME"] = str(home)  # no ~/.curlrc of the machine's
    return env


@pytest.fixture(scope="module")
def terminal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Terminal]:
    home = tmp_path_factory.mktemp("walkthrough")
    term = Terminal(home, _env(home))
    yield term
    if term.proxy is not None:
        term.proxy.send_signal(signal.SIGINT)  # Ctrl-C, as the page says
        assert term.proxy.wait(30) == 0
        assert term.demo_dir is not None and not Path(term.demo_dir).exists()


@dataclass
class Outputs:
    steps: list[tuple[Step, str]]
    terminal1: list[str]
    audit: list[dict[str, Any]]
    secret: str  # DEMO_SECRET, from the demo's env file


@pytest.fixture(scope="module")
def walked(terminal: Terminal) -> Outputs:
    walkthrough = read_walkthrough(TUTORIAL.read_text())
    outputs = [(step, run_step(terminal, step)) for step in walkthrough.steps]
    terminal.wait(lambda: len(requests(terminal.audit)) >= 3, "audit lines")
    return Outputs(outputs, terminal.terminal1, terminal.audit, terminal.env["DEMO_SECRET"])


def requests(audit: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in audit if line["event"] == "request"]


def run_step(term: Terminal, step: Step) -> str:
    command = step.command.replace("127.0.0.1:8080", f"127.0.0.1:{term.port}")
    if term.token is not None:
        command = command.replace(SAMPLE_TOKEN, term.token)
    if term.demo_dir is not None:
        command = command.replace(SAMPLE_DIR, term.demo_dir)
    if command == "make venv":
        return ""  # the shim stands for .venv
    if command.startswith(".venv/bin/credproxy demo --keep"):
        # As the page starts it, on a free port rather than 8080.
        argv = [*command.split()[1:], "--listen", "127.0.0.1:0"]
        with (term.home / "proxy.out").open("wb") as out:
            term.proxy = subprocess.Popen(
                [sys.executable, "-m", "addon.cli.cli", *argv],
                cwd=term.home,
                env=term.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        term.wait(lambda: any(e["event"] == "proxy.started" for e in term.audit), "start")
        started = next(e for e in term.audit if e["event"] == "proxy.started")
        term.port = int(started["listen"][0].rpartition(":")[2])
        term.demo_dir = re.search(  # type: ignore[union-attr]
            r"^In another terminal, `source (\S+)/env` sets:$", "\n".join(term.terminal1), re.M
        ).group(1)
        lines = term.terminal1
        return "\n".join(lines[: lines.index(json.dumps(started)) + 1])
    if command == "source .venv/bin/activate":
        return ""  # the shim is on PATH already
    if command.startswith("source "):
        # What the file sets, into the environment of the commands that follow.
        dump = subprocess.run(
            ["bash", "-c", f"{command} && env -0"], env=term.env, capture_output=True, check=True
        ).stdout.decode()
        term.env = dict(entry.split("=", 1) for entry in dump.split("\0") if entry)
        return ""
    if command.startswith("export "):
        name, _, value = command.removeprefix("export ").partition("=")
        term.env[name] = value
        return ""
    if command.startswith("curl "):
        # The proxy reloads a change within about half a second: wait for the grant.
        term.wait(lambda: any(e.get("grants", 0) > 0 for e in term.audit), "grant loaded")
    output = term.bash(command)
    if command.startswith("credproxy principal add"):
        term.token = re.search(r"^token +(\S+)$", output, re.M).group(1)  # type: ignore[union-attr]
    return output


SAMPLE_TOKEN = re.search(  # type: ignore[union-attr]
    r"^token +(\S+)$", TUTORIAL.read_text(), re.M
).group(1)
SAMPLE_DIR = re.search(  # type: ignore[union-attr]
    r"^\$ source (\S+)/env$", TUTORIAL.read_text(), re.M
).group(1)


def _steps() -> list[Any]:
    steps = read_walkthrough(TUTORIAL.read_text()).steps
    return [pytest.param(i, id=f"{i}: $ {s.command[:60]}") for i, s in enumerate(steps)]


@pytest.mark.parametrize("index", _steps())
def test_each_command_prints_what_the_walkthrough_shows(walked: Outputs, index: int) -> None:
    step, output = walked.steps[index]
    expected = "\n".join(step.expected)
    if step.command.startswith(".venv/bin/credproxy demo --keep"):
        # What the demo says, then the proxy's first line, as JSON.
        *said, started = output.split("\n")
        *page, page_started = step.expected
        assert [mask(line) for line in said] == [mask(line) for line in page]
        same_json(json.loads(page_started), json.loads(started), "proxy.started")
        return
    if re.fullmatch(r"\[ \.\.\. .* \.\.\. \]", expected):
        assert output.strip(), "a placeholder stands for some output"
        return
    actual = output.rstrip("\n")
    expected_head, _, expected_body = expected.partition("\n\n{")
    actual_head, _, actual_body = actual.partition("\n\n{")
    if expected_body:  # an HTTP answer: its head as text, its body as JSON
        same_json(json.loads("{" + expected_body), json.loads("{" + actual_body), step.command)
    # Line by line, trailing blanks aside (curl ends a status line with one, editors trim it).
    actual_lines = [line.rstrip() for line in mask(actual_head, walked_token(walked)).split("\n")]
    expected_lines = [line.rstrip() for line in mask(expected_head, SAMPLE_TOKEN).split("\n")]
    assert actual_lines == expected_lines


def walked_token(walked: Outputs) -> str:
    for step, output in walked.steps:
        if step.command.startswith("credproxy principal add"):
            return re.search(r"^token +(\S+)$", output, re.M).group(1)  # type: ignore[union-attr]
    raise AssertionError("no principal add in the walkthrough")


def test_the_audit_lines_are_the_walkthroughs(walked: Outputs) -> None:
    expected = read_walkthrough(TUTORIAL.read_text()).audit
    actual = requests(walked.audit)
    assert len(actual) == len(expected)
    for i, (want, got) in enumerate(zip(expected, actual, strict=True)):
        same_json(want, got, f"audit line {i}")


def test_the_upstream_got_the_secret_and_only_the_granted_request(walked: Outputs) -> None:
    # The demo's upstream masks the secret it got as the page shows it: "Bearer demo-sk-…" is
    # printed only for the whole secret, and nothing but it.
    got = [line for line in walked.terminal1 if line.startswith("upstream got ")]
    assert got == read_walkthrough(TUTORIAL.read_text()).upstream
    assert walked.secret.startswith("demo-sk-") and len(walked.secret) > len("demo-sk-")
    for _, output in walked.steps:
        assert walked.secret not in output
    assert walked.secret not in "\n".join(walked.terminal1)
