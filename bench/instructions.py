"""`python -m bench.instructions`: instructions per request under callgrind, per proxy.

Timings on a shared machine move by more than the few per cent a hot-path change is worth;
instruction counts do not. Each proxy starts under `valgrind --tool=callgrind` with
instrumentation off, serves a warm-up cell, then the counted cell with instrumentation on
(`callgrind_control -i on`); the count is read from the dump. PYTHONHASHSEED is fixed so
that dict layouts, and so the counts, repeat. Instructions are not time (cache misses and
system calls are not in them), but a change that removes instructions from the hot path
shows here, run after run. `--download SIZE` counts instructions per byte of SIZE-byte
downloads instead, against bare mitmproxy streaming them (`mitmproxy-stream`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import processes
from bench.bodies import KINDS, parse_sizes
from bench.report import BASELINE, DOWNLOAD_BASELINE
from bench.run import POPULATIONS, Bench, Settings

VALGRIND = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no"]
START_TIMEOUT = 600.0  # start-up under valgrind, instrumentation off: 10-40 s here


def _callgrind(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def _wait_for_dump(workdir: Path, name: str) -> int:
    """The instruction total of a dump; valgrind writes it after callgrind_control returns."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        path = workdir / name
        if path.exists():
            for line in path.read_text().splitlines():
                if line.startswith("totals:"):
                    return int(line.split()[1])
        time.sleep(0.2)
    raise RuntimeError(f"callgrind wrote no totals to {name}")


def measure(
    configs: tuple[str, ...],
    requests: int,
    concurrency: int,
    size: int | None = None,
    body: str = "binary",
) -> dict[str, Any]:
    """Instructions per request of each proxy (and per byte, for downloads of `size`)."""
    workdir = Path(tempfile.mkdtemp(prefix="credproxy-instructions-"))
    launch = processes.start

    def start_under_valgrind(name: str, args: list[str], *rest: Any, **kw: Any) -> Any:
        if name in configs:
            args = [*VALGRIND, f"--callgrind-out-file={workdir}/cg.{name}.%p", *args]
        return launch(name, args, *rest, **kw)

    processes.start = start_under_valgrind  # type: ignore[assignment]
    processes.START_TIMEOUT = START_TIMEOUT
    settings = Settings.one_cell(
        configs,
        requests,
        concurrency,
        workdir,
        download=(size,) if size else (),
        body=body,
    )
    bench = Bench(settings, workdir)
    counts: dict[str, float] = {}
    try:
        bench.start()
        for config in configs:
            pid = bench.processes[config].process.pid
            warm = 2 if size else max(20, requests // 10)
            bench.cell(config, concurrency, warm, size=size)
            _callgrind(pid, "-z")
            _callgrind(pid, "-i", "on")
            done = bench.cell(config, concurrency, requests, size=size).requests
            _callgrind(pid, "-i", "off")
            _callgrind(pid, "-d")
            counts[config] = _wait_for_dump(workdir, f"cg.{config}.{pid}.1") / done
            print(
                f"[instructions] {config}: {counts[config] / 1e6:.3f} M per request",
                file=sys.stderr,
            )
    finally:
        bench.stop()
        processes.start = launch  # type: ignore[assignment]
        shutil.rmtree(workdir, ignore_errors=True)
    base = counts.get(DOWNLOAD_BASELINE if size else BASELINE)
    return {
        "requests": requests,
        "concurrency": concurrency,
        "size": size,
        "instructions_per_request": {k: round(v) for k, v in counts.items()},
        "instructions_per_byte": {k: round(v / size, 2) for k, v in counts.items()}
        if size
        else None,
        "ratio": {k: round(v / base, 4) for k, v in counts.items()} if base else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    p.add_argument("--configs", default="mitmproxy,credproxy-10,credproxy-10k")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument(
        "--download",
        type=parse_sizes,
        help="count per byte of downloads of this size (e.g. 1m) against mitmproxy-stream",
    )
    p.add_argument("--body", choices=KINDS, default="binary", help="download body kind")
    args = p.parse_args(argv)
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    bare = ("mitmproxy", "mitmproxy-lean", "mitmproxy-stream")
    unknown = [c for c in configs if c not in bare and c not in POPULATIONS]
    if unknown or not configs:
        p.error(f"unknown config {', '.join(unknown) or '(none)'}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        p.error("valgrind is not installed (Debian: apt-get install valgrind)")
    if os.environ.get("PYTHONHASHSEED") != "0":
        # Same dict layouts in every proxy and every run: re-run with the seed fixed.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        cmd = [sys.executable, "-m", "bench.instructions", *(argv or sys.argv[1:])]
        return subprocess.run(cmd, env=env, check=False).returncode
    size = args.download[0] if args.download else None
    result = measure(configs, args.requests, args.concurrency, size, args.body)
    base = DOWNLOAD_BASELINE if size else BASELINE
    rows = [f"| config | instructions per request | per byte | ÷ {base} |", "|---|--:|--:|--:|"]
    for config, n in result["instructions_per_request"].items():
        ratio = result["ratio"][config] if result["ratio"] else None
        per_byte = f"{n / size:.2f}" if size else "–"
        rows.append(
            f"| {config} | {n / 1e6:.3f} M | {per_byte} | {ratio if ratio is not None else '–'} |"
        )
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
