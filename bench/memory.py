"""Memory per connection, beside bare mitmproxy: `python -m bench.memory`.

For each proxy, in one run against the same upstream: RSS at start, then `--connections`
tunnels opened and held (CONNECT, TLS, and with `--requests 1` one keep-alive request each),
RSS with all of them open, then RSS once they are closed and the proxy had `--settle`
seconds. Per connection is (held - before) / connections, in KiB. Tunnels are opened
`--batch` at a time, so the proxy never holds more unauthenticated connections than that.

`--trace` starts each proxy with tracemalloc on (a `sitecustomize` in the run's folder, which
neither proxy imports otherwise) and writes the 30 source lines whose live allocations grew
most since the baseline, while the connections are held to `<out>.<config>.held.trace.txt`
and after they closed to `<out>.<config>.closed.trace.txt`: where the memory of a held
connection goes, and what outlives it. tracemalloc slows the proxy and adds its own memory:
take the per-connection figures from a run without it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.client import _Connection, request_bytes
from bench.processes import rss_mb
from bench.run import Bench, Settings

CONFIGS = ("mitmproxy", "credproxy-10")
TRACE_SIGNAL = signal.SIGUSR2
# Imported by the proxies' interpreters when --trace is given (PYTHONPATH points at it).
SITECUSTOMIZE = """
import os, signal, tracemalloc
tracemalloc.start(int(os.environ.get("BENCH_TRACE_FRAMES", "1")))
_base = []

def _dump(signum, frame):
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    if not _base:  # the first signal: the baseline
        _base.append(snapshot)
        return
    path = os.environ["BENCH_TRACE_OUT"] + "." + str(os.getpid()) + "." + str(len(_base))
    _base.append(None)
    diff = snapshot.compare_to(_base[0], "lineno")
    with open(path + ".part", "w") as out:
        out.write("grown since the baseline: %.1f KiB in %d blocks\\n" % (
            sum(d.size_diff for d in diff) / 1024, sum(d.count_diff for d in diff)))
        for d in diff[:30]:
            out.write("%9.1f KiB %7d blocks  %s\\n" % (
                d.size_diff / 1024, d.count_diff, d.traceback))
    os.rename(path + ".part", path)

signal.signal(signal.SIGUSR2, _dump)
"""


async def _hold(
    bench: Bench, config: str, connections: int, requests: int, batch: int
) -> list[_Connection]:
    target = bench.targets[config]
    request = request_bytes(target)
    held: list[_Connection] = []

    async def one(slot: int) -> _Connection:
        conn = await asyncio.wait_for(_Connection.dial(target, slot), 30)
        for _ in range(requests):
            status = await asyncio.wait_for(conn.get(request), 30)
            if status != 200:
                raise RuntimeError(f"{config}: status {status}")
        return conn

    for first in range(0, connections, batch):
        held += await asyncio.gather(
            *(one(slot) for slot in range(first, min(first + batch, connections)))
        )
    return held


def measure(
    bench: Bench,
    config: str,
    connections: int,
    requests: int = 1,
    batch: int = 20,
    settle: float = 8.0,
    trace: Path | None = None,
) -> dict[str, Any]:
    pid = bench.processes[config].process.pid

    # One warm request first, so that what is paid once (the upstream's first handshake,
    # imports on first use, the policy's compiled form) is in `before`.
    async def warm() -> None:
        await _closed(await _hold(bench, config, 2, 1, 2))

    asyncio.run(warm())
    time.sleep(settle)
    before = rss_mb(pid)
    if trace is not None:
        os.kill(pid, TRACE_SIGNAL)  # the baseline snapshot
        time.sleep(settle + 3)

    async def cycle() -> tuple[float, float]:
        held = await _hold(bench, config, connections, requests, batch)
        await asyncio.sleep(0.5)
        peak = rss_mb(pid)
        fds_held = len(os.listdir(f"/proc/{pid}/fd"))
        if trace is not None:
            os.kill(pid, TRACE_SIGNAL)
            await _dumped(trace.parent / f"trace.{pid}.1")
        await _closed(held)
        await asyncio.sleep(settle)
        closed = rss_mb(pid)
        fds = (fds_held, len(os.listdir(f"/proc/{pid}/fd")))
        print(f"[memory] {config}: open files held / closed {fds}", file=sys.stderr)
        if trace is not None:
            os.kill(pid, TRACE_SIGNAL)
            await _dumped(trace.parent / f"trace.{pid}.2")
        return peak, closed

    peak, after = asyncio.run(cycle())
    return {
        "rss_start_mb": round(before, 1),
        "rss_held_mb": round(peak, 1),
        "rss_closed_mb": round(after, 1),
        "kib_per_connection": round((peak - before) * 1024 / connections, 1),
        "kib_kept_per_connection": round((after - before) * 1024 / connections, 1),
    }


async def _dumped(path: Path) -> None:
    for _ in range(240):  # a snapshot of a large heap takes seconds
        if path.exists():
            return
        await asyncio.sleep(0.5)


async def _closed(held: list[_Connection]) -> None:
    """Close each connection as a client does; a TLS shutdown the proxy does not answer within
    the client's second is cut at the socket, so every connection is closed when this returns."""
    await asyncio.gather(*(c.close() for c in held))
    for c in held:
        c.writer.transport.abort()


def summary(rows: dict[str, Any], connections: int, requests: int, traced: bool) -> dict[str, Any]:
    """The JSON of a run: each proxy's row, and per-connection ratios to bare mitmproxy's."""
    base = rows.get("mitmproxy")
    return {
        "connections": connections,
        "requests_per_connection": requests,
        "traced": traced,
        "rows": rows,
        "ratio_per_connection": {
            k: round(v["kib_per_connection"] / base["kib_per_connection"], 2)
            for k, v in rows.items()
        }
        if base and base["kib_per_connection"] > 0
        else None,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--connections", type=int, default=300)
    p.add_argument("--requests", type=int, default=1, help="per connection (0: idle tunnels)")
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--settle", type=float, default=8.0)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/results/memory.json"))
    args = p.parse_args(argv)
    configs = tuple(args.configs.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="credproxy-memory-"))
    trace = None
    if args.trace:
        (workdir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(workdir), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        trace = workdir / "trace"
        os.environ["BENCH_TRACE_OUT"] = str(trace)
    bench = Bench(Settings.one_cell(configs, 1, 1, workdir), workdir)
    rows: dict[str, Any] = {}
    try:
        bench.start()
        for config in configs:
            rows[config] = measure(
                bench, config, args.connections, args.requests, args.batch, args.settle, trace
            )
            print(f"[memory] {config}: {json.dumps(rows[config])}", file=sys.stderr)
            if trace is not None:
                pid = bench.processes[config].process.pid
                for n, when in ((1, "held"), (2, "closed")):
                    dumped = workdir / f"trace.{pid}.{n}"
                    target = args.out.with_suffix(f".{config}.{when}.trace.txt")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(dumped.read_text() if dumped.exists() else "no dump\n")
    finally:
        bench.stop()
    result = summary(rows, args.connections, args.requests, args.trace)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
