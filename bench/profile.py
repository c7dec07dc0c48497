"""`python -m bench.profile`: where a proxy's CPU goes, per function, under cProfile.

Each chosen proxy starts under `python -m cProfile`, serves one warm-up cell and one counted
cell, and is stopped (SIGTERM: credproxy and the bare mitmproxy runner both exit through
their normal path, so cProfile writes its file). Start-up is in the profile too; run enough
requests that it is a small share. cProfile's own overhead inflates every Python call, so
compare the two proxies' profiles with each other, not with the rps figures. `--download
SIZE` profiles downloads of SIZE bytes instead (`--configs mitmproxy-stream,credproxy-10`).
"""

from __future__ import annotations

import argparse
import pstats
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import processes
from bench.bodies import KINDS, parse_sizes
from bench.run import POPULATIONS, Bench, Settings


def measure(
    configs: tuple[str, ...],
    requests: int,
    concurrency: int,
    out: Path,
    size: int | None = None,
    body: str = "binary",
) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="credproxy-profile-"))
    launch = processes.start

    def start_profiled(name: str, args: list[str], *rest: Any, **kw: Any) -> Any:
        if name in configs:
            args = [args[0], "-m", "cProfile", "-o", str(out / f"{name}.prof"), *args[1:]]
        return launch(name, args, *rest, **kw)

    processes.start = start_profiled  # type: ignore[assignment]
    download = (size,) if size else ()
    settings = Settings.one_cell(
        configs, requests, concurrency, workdir, download=download, body=body
    )
    bench = Bench(settings, workdir)
    try:
        bench.start()
        for config in configs:
            bench.cell(config, concurrency, max(2, requests // 10), size=size)  # warm-up
            bench.cell(config, concurrency, requests, size=size)
    finally:
        bench.stop()
        processes.start = launch  # type: ignore[assignment]
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    p.add_argument("--configs", default="mitmproxy,credproxy-10", help="proxies to profile")
    p.add_argument("--requests", type=int, default=3000, help="requests in the counted cell")
    p.add_argument("--concurrency", type=int, default=1, help="connections in flight")
    p.add_argument("--out", type=Path, default=Path("/tmp/credproxy-profile"), help="folder")
    p.add_argument("--top", type=int, default=40, help="functions printed per proxy")
    p.add_argument("--download", type=parse_sizes, help="profile downloads of this size (1m)")
    p.add_argument("--body", choices=KINDS, default="binary", help="download body kind")
    args = p.parse_args(argv)
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    bare = ("mitmproxy", "mitmproxy-lean", "mitmproxy-stream")
    unknown = [c for c in configs if c not in bare and c not in POPULATIONS]
    if unknown or not configs:
        p.error(f"unknown config {', '.join(unknown) or '(none)'}")
    args.out.mkdir(parents=True, exist_ok=True)
    size = args.download[0] if args.download else None
    measure(configs, args.requests, args.concurrency, args.out, size, args.body)
    for config in configs:
        print(f"## {config} ({args.out / (config + '.prof')})")
        pstats.Stats(str(args.out / f"{config}.prof")).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
