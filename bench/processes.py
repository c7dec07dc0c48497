"""The processes under test: the upstream, bare mitmproxy and `credproxy run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from addon.proxy.chain import REQUIRED_OPTIONS
from addon.runtime.upstreamca import UpstreamCA

ROOT = Path(__file__).resolve().parent.parent
CREDPROXY = [sys.executable, "-m", "addon.cli.cli"]
START_TIMEOUT = 60.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """A process under test did not start or misbehaved; the run cannot go on."""


@dataclass
class Running:
    """A started process, its first JSON line, and how long it took to print it."""

    name: str
    process: subprocess.Popen[bytes]
    output: Path
    announce: dict[str, Any]
    startup_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def port(self) -> int:
        if "port" in self.announce:
            return int(self.announce["port"])
        return int(self.announce["listen"][0].rsplit(":", 1)[1])

    def rss_mb(self) -> float:
        return rss_mb(self.process.pid)

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process and its children (`--workers`), so far."""
        return sum(_cpu_s(pid) for pid in [self.process.pid, *_children(self.process.pid)])

    def own_cpu_s(self) -> float:
        """User + system CPU seconds of the process itself, without its children."""
        return _cpu_s(self.process.pid)

    def has_workers(self) -> bool:
        return bool(_children(self.process.pid))

    def stop(self) -> None:
        for process in (self.process, self.extra.get("reader")):
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0  # a child that exited meanwhile
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def rss_mb(pid: int) -> float:
    """Resident set size from /proc/PID/status (VmRSS), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise BenchError(f"no VmRSS for process {pid}")


# CPU sets by role, when the run pins processes (see split_cpus); None: not pinned.
AFFINITY: dict[str, set[int]] | None = None


def split_cpus() -> dict[str, set[int]] | None:
    """The proxy under test on a CPU of its own; the client and the upstream on the rest.

    On a 2-CPU machine the client, the upstream and the proxy otherwise compete for both
    CPUs and the scheduler's choices differ from cell to cell. None with fewer than 2 CPUs.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {"proxy": {cpus[-1]}, "client": set(cpus[:-1])}


def start(
    name: str,
    args: list[str],
    env: dict[str, str],
    output: Path,
    marker: str,
    role: str = "proxy",
    pin: bool = True,
) -> Running:
    """Run `args` with stdout to `output`; wait for the first JSON line containing `marker`."""
    out = output.open("wb")
    began = time.perf_counter()
    cpus = AFFINITY[role] if AFFINITY and pin else None
    reader = None
    if role == "proxy":
        # A proxy's stdout is a pipe, read by another process, as in a container: `cat`
        # copies it to the file, on the client's CPUs.
        others = AFFINITY["client"] if AFFINITY else None
        reader = subprocess.Popen(
            ["cat"],
            stdin=subprocess.PIPE,
            stdout=out,
            preexec_fn=(lambda: os.sched_setaffinity(0, others)) if others else None,
        )
    process = subprocess.Popen(
        args,
        env=env,
        cwd=ROOT,
        stdout=reader.stdin if reader is not None else out,
        stderr=subprocess.STDOUT,
        # Set in the child before exec, so every thread the proxy starts inherits it.
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    if reader is not None and reader.stdin is not None:
        reader.stdin.close()  # the proxy holds the only write end: cat ends when it does
    out.close()
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        for line in output.read_text(errors="replace").splitlines():
            if marker in line:
                try:
                    announce = json.loads(line)
                except json.JSONDecodeError:
                    continue
                found = Running(name, process, output, announce, time.perf_counter() - began)
                found.extra["reader"] = reader
                return found
        if process.poll() is not None:
            if reader is not None:
                reader.wait(5)
            raise BenchError(f"{name} exited with {process.returncode}: {_tail(output)}")
        time.sleep(0.005)
    process.kill()
    process.wait()
    if reader is not None:
        reader.wait(5)
    raise BenchError(f"{name} did not start within {START_TIMEOUT:.0f} s: {_tail(output)}")


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:].strip()


def start_upstream(workdir: Path, cert: Path, key: Path) -> Running:
    args = [sys.executable, "-m", "bench.upstream", str(cert), str(key)]
    return start(
        "upstream", args, dict(os.environ), workdir / "upstream.out", '"port"', role="client"
    )


def start_bare_mitmproxy(
    workdir: Path,
    certs: Path,
    upstream_ca: Path,
    name: str = "mitmproxy",
    stream: str | None = None,
) -> Running:
    """Bare mitmproxy; `stream` sets its stream_large_bodies (None: bodies are buffered).

    `mitmproxy-lean` is credproxy's own master without credproxy's addons."""
    # Built here, so that the bare process imports neither credproxy nor its store.
    bundle = UpstreamCA.read(upstream_ca).bundle(workdir)
    options = json.dumps({**REQUIRED_OPTIONS, "stream_large_bodies": stream})
    args = [sys.executable, "-m", "bench.bare_mitmproxy", str(certs), str(bundle), options]
    if name == "mitmproxy-lean":
        args.append("lean")
    return start(name, args, dict(os.environ), workdir / f"{name}.out", '"proxy.started"')


def credproxy_env(workdir: Path, db: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "CREDPROXY_DB": f"sqlite:///{db}",
        "CREDPROXY_KEY_FILE": str(workdir / "credproxy.key"),
        "CREDPROXY_CERTS": str(workdir / "certs"),
    }
    env.pop("CREDPROXY_MASTER_KEY", None)
    return env


def credproxy_init(env: dict[str, str]) -> None:
    result = subprocess.run(
        [*CREDPROXY, "init"], env=env, cwd=ROOT, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise BenchError(f"credproxy init failed: {result.stderr.strip()}")


def start_credproxy(
    name: str,
    workdir: Path,
    env: dict[str, str],
    upstream_ca: Path,
    resolve: str | None,
    flags: tuple[str, ...] = (),
    pin: bool = True,
) -> Running:
    """credproxy dialling the upstream by `--resolve`, or (resolve None) by the system
    resolver, with loopback opened to the destination guard."""
    args = [*CREDPROXY, "run", "--listen", "127.0.0.1:0", "--upstream-ca", str(upstream_ca)]
    if resolve is not None:
        args += ["--resolve", resolve]
    else:
        args += ["--allow-private", "127.0.0.0/8", "--allow-private", "::1/128"]
    args += flags
    return start(name, args, env, workdir / f"{name}.out", '"proxy.started"', pin=pin)
