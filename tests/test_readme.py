"""The tutorial's five-minute walkthrough (docs/tutorial.md), run as written against a real proxy
and upstream.

Each `$ command` of the walkthrough's console blocks runs in bash, in a directory of its own,
with only the token and the proxy's port substituted; its output is compared with the lines
the page shows under it, and the proxy's audit lines with the page's JSON blocks. What
varies from run to run (tokens, key ids, fingerprints, ports, request ids, times, sizes) is
masked on both sides; JSON is compared by its keys and its fixed values. So a change of any
output (a deny body, an audit field, a table column) fails here until the tutorial shows it.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trustme

from addon.runtime.greeting import greeting as run_greeting
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"
UPSTREAM_HOST = "api.github.com"  # the walkthrough's; --resolve takes it to a local upstream
FAKE_TOKEN = "ghp_readme_fake_0123456789abcdef"

# Values that differ from run to run, in text and in JSON.
MASKS = [
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


def read_walkthrough(text: str) -> Walkthrough:
    section = text.split("# Five-minute walkthrough", 1)[1].split("\n## ", 1)[0]
    steps: list[Step] = []
    audit: list[dict[str, Any]] = []
    for kind, body in re.findall(r"^```(console|json)\n(.*?)^```", section, re.M | re.S):
        if kind == "json":
            audit += [json.loads(line) for line in body.splitlines() if line.strip()]
            continue
        lines = iter(body.splitlines())
        for line in lines:
            if line.startswith("$ "):
                command = line[2:]
                while command.endswith("\\"):
                    command = command[:-1] + next(lines).strip()
                steps.append(Step(command))
            elif line.startswith(".venv/bin/"):  # what make echoes: a command it runs
                steps.append(Step(line.removeprefix(".venv/bin/")))
            elif line.startswith("..."):
                continue  # make's own noise while it sets up .venv
            else:
                steps[-1].expected.append(line)
    return Walkthrough(steps, audit)


def test_the_walkthrough_is_read_as_expected() -> None:
    walkthrough = read_walkthrough(TUTORIAL.read_text())
    commands = [step.command.split()[:3] for step in walkthrough.steps]
    assert commands[:3] == [
        ["make", "run"],
        ["credproxy", "init"],
        ["credproxy", "run", "--listen"],
    ]
    assert sum(c[0] == "curl" for c in commands) == 3
    assert [line["event"] for line in walkthrough.audit] == ["request"] * 3


def test_make_run_runs_what_the_walkthrough_shows() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "LISTEN ?= 127.0.0.1:8080" in makefile
    assert (
        "\t$(BIN)/credproxy init\n\t$(BIN)/credproxy run --listen $(LISTEN) $(ARGS)\n" in makefile
    )


# -- the walkthrough, run ----------------------------------------------------------------


@dataclass
class Terminal:
    """The operator's terminal: a directory, an environment, bash."""

    home: Path
    env: dict[str, str]
    proxy: subprocess.Popen[bytes] | None = None
    port: int = 0
    token: str | None = None

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
    def audit(self) -> list[dict[str, Any]]:
        text = (self.home / "proxy.out").read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def wait(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if done():
                return
            time.sleep(0.05)
        raise AssertionError(f"no {what} within 10 s")


@pytest.fixture(scope="module")
def terminal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Terminal]:
    home = tmp_path_factory.mktemp("walkthrough")
    shim = home / ".venv" / "bin"
    shim.mkdir(parents=True)
    # `source .venv/bin/activate` puts a `credproxy` on PATH that runs this checkout.
    (shim / "credproxy").write_text(f'#!/bin/sh\nexec {sys.executable} -m addon.cli.cli "$@"\n')
    (shim / "credproxy").chmod(stat.S_IRWXU)
    (shim / "activate").write_text(f'export PATH="{shim}:$PATH"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CREDPROXY_")}
    env |= {"PYTHONPATH": str(ROOT), "GITHUB_TOKEN": FAKE_TOKEN, "PYTHONUNBUFFERED": "1"}
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "NO_PROXY", "no_proxy"):
        env.pop(name, None)
    env["PATH"] = f"{shim}:{env['PATH']}"
    env["HOME"] = str(home)  # no ~/.curlrc of the machine's
    term = Terminal(home, env)
    yield term
    if term.proxy is not None:
        term.proxy.terminate()
        term.proxy.wait(15)


@dataclass
class Outputs:
    steps: list[tuple[Step, str]]
    audit: list[dict[str, Any]]
    upstream_saw: list[str]


@pytest.fixture(scope="module")
def walked(terminal: Terminal) -> Iterator[Outputs]:
    ca = trustme.CA()
    with Upstream(ca, [UPSTREAM_HOST]) as upstream:
        ca.cert_pem.write_to_path(str(terminal.home / "upstream-ca.pem"))
        walkthrough = read_walkthrough(TUTORIAL.read_text())
        outputs = [(step, run_step(terminal, step, upstream.port)) for step in walkthrough.steps]
        terminal.wait(lambda: len(requests(terminal.audit)) >= 3, "audit lines")
        saw = [f"{r.method} {r.target} {r.header('authorization')}" for r in upstream.log.requests]
        yield Outputs(outputs, terminal.audit, saw)


def requests(audit: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in audit if line["event"] == "request"]


def run_step(term: Terminal, step: Step, upstream_port: int) -> str:
    command = step.command.replace("127.0.0.1:8080", f"127.0.0.1:{term.port}")
    if term.token is not None:
        command = command.replace(SAMPLE_TOKEN, term.token)
    if command == "make run":
        return ""  # its two commands are the next steps
    if command.startswith("credproxy run "):
        # As `make run` starts it, plus what takes api.github.com to the local upstream.
        argv = command.split()[1:]
        argv[argv.index("--listen") + 1] = "127.0.0.1:0"
        argv += ["--upstream-ca", "upstream-ca.pem"]
        argv += ["--resolve", f"{UPSTREAM_HOST}=127.0.0.1:{upstream_port}"]
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
        return json.dumps(started)
    if command == "source .venv/bin/activate":
        return ""  # the shim is on PATH already
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


def _steps() -> list[Any]:
    steps = read_walkthrough(TUTORIAL.read_text()).steps
    return [pytest.param(i, id=f"{i}: $ {s.command[:60]}") for i, s in enumerate(steps)]


@pytest.mark.parametrize("index", _steps())
def test_each_command_prints_what_the_walkthrough_shows(walked: Outputs, index: int) -> None:
    step, output = walked.steps[index]
    expected = "\n".join(step.expected)
    if step.command.startswith("credproxy run "):
        # On a terminal, as the page shows it, one line for a person comes first; the proxy
        # here writes to a file, so that line is checked against what run would print.
        (greeting, line) = step.expected
        started = json.loads(output)
        said = run_greeting(started["listen"], [], started["db"], Path("certs/credproxy-ca.pem"))
        assert mask(greeting) == mask(said)
        same_json(json.loads(line), started, "proxy.started")
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
    assert walked.upstream_saw == [
        f"GET /repos/acme/widgets/issues?state=open ['Bearer {FAKE_TOKEN}']"
    ]
    for _, output in walked.steps:
        assert FAKE_TOKEN not in output
