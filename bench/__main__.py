"""`python -m bench` (`make bench`): run the benchmark, print and write the results."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.bodies import KINDS, parse_sizes
from bench.processes import BenchError
from bench.run import CONFIGS, DEFAULT_CONFIGS, DOWNLOAD_BYTES, DOWNLOAD_CONFIGS, Settings, run

DEFAULT_OUT = Path(__file__).parent / "results.json"


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive")
    return values


def _configs(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in values if v not in CONFIGS]
    if unknown or not values:
        raise argparse.ArgumentTypeError(
            f"unknown config {', '.join(unknown) or '(none)'}: use {', '.join(CONFIGS)}"
        )
    return values


def parse(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--requests", type=int, help="requests per cell (default 9600; smoke 20)")
    p.add_argument("--duration", type=float, help="seconds per cell instead of --requests")
    p.add_argument("--concurrency", type=_ints, help="levels, e.g. 1,10,50 (smoke 1,2)")
    p.add_argument(
        "--configs",
        type=_configs,
        help=f"any of {', '.join(CONFIGS)} (default: all but credproxy-10-dns-miss, "
        "credproxy-10-nokeep, mitmproxy-lean and mitmproxy-stream; with --download "
        f"{','.join(DOWNLOAD_CONFIGS)})",
    )
    p.add_argument("--repeat", type=int, help="interleaved repetitions per cell (default 32)")
    p.add_argument(
        "--starts", type=int, help="starts per proxy; start-up is the median (default 3)"
    )
    p.add_argument(
        "--new-connection",
        action="store_true",
        help="a new CONNECT + TLS connection per request instead of keep-alive",
    )
    p.add_argument(
        "--connection-close",
        action="store_true",
        help="every request says Connection: close (one-shot clients that send it)",
    )
    p.add_argument(
        "--download",
        type=parse_sizes,
        help="download mode: GET bodies of these sizes (e.g. 1m,16m) through a redacted grant "
        "and compare MB/s with bare mitmproxy streaming them",
    )
    p.add_argument(
        "--body",
        choices=KINDS,
        default="binary",
        help="what the download bodies hold (default binary)",
    )
    p.add_argument(
        "--client", choices=("raw", "httpx"), default="raw", help="the load generator (raw)"
    )
    p.add_argument(
        "--rss-requests",
        type=int,
        help="requests for credproxy-10k's RSS-growth run (default 50000; smoke 0 = skip)",
    )
    p.add_argument(
        "--memory-connections",
        type=int,
        help="tunnels held for RSS per connection, mitmproxy and credproxy-10 "
        "(default 300; smoke 20; 0 = skip)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny counts, to check that it runs")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results; .md beside it")
    p.add_argument("--keep-workdir", action="store_true", help="keep stores and proxy logs")
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="do not give the proxy a CPU of its own (default: pinned with 2+ CPUs)",
    )
    args = p.parse_args(argv)
    if args.client == "httpx" and (args.new_connection or args.connection_close):
        p.error("--client httpx measures keep-alive only")
    if args.download and (args.client == "httpx" or args.new_connection or args.duration):
        p.error("--download runs keep-alive cells of a request count with the raw client")
    smoke = args.smoke
    download = args.download or ()
    configs = args.configs or (DOWNLOAD_CONFIGS if download else DEFAULT_CONFIGS)
    # Downloads: by default each cell moves DOWNLOAD_BYTES (smoke: two requests).
    requests = args.requests or (20 if smoke else 9600)
    if download and not args.requests:
        requests = 2 if smoke else 0
    repeat = args.repeat or (1 if smoke else 8 if download else 32)
    settings = Settings(
        requests=requests,
        duration=args.duration,
        concurrency=args.concurrency or ((1, 2) if smoke else (1,) if download else (1, 10, 50)),
        configs=configs,
        repeat=repeat,
        starts=args.starts or (1 if smoke else 3),
        new_connection=args.new_connection,
        client=args.client,
        rss_requests=args.rss_requests
        if args.rss_requests is not None
        else (0 if smoke else 50_000),
        out=args.out,
        keep_workdir=args.keep_workdir,
        pin=not args.no_pin,
        download=download,
        body=args.body,
        download_bytes=DOWNLOAD_BYTES,
        connection_close=args.connection_close,
        memory_connections=args.memory_connections
        if args.memory_connections is not None
        else (20 if smoke else 300),
    )
    if settings.repeat < 1 or (settings.requests or settings.repeat) < settings.repeat:
        p.error("--requests must be at least --repeat, and --repeat at least 1")
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse(argv)
    try:
        print(run(settings), end="")
    except BenchError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
