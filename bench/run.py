"""One benchmark run: set up the upstream and the proxies, then interleave the cells."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import trustme

from bench import processes, redaction, report
from bench.client import BadResponse, Outcome, Target, run_cell, run_cell_httpx
from bench.population import HOST, PATH, Population, populate
from bench.processes import (
    BenchError,
    Running,
    credproxy_env,
    credproxy_init,
    start_bare_mitmproxy,
    start_credproxy,
    start_upstream,
)
from bench.upstream import BLOB
from store.ca import PUBLIC_CERT, ensure_ca
from store.crypto import load_master_key
from store.repository import Store

POPULATIONS = {
    "credproxy-10": Population(principals=10, credentials=10, grants_per_principal=1),
    # The same, served by `run --workers 2`, never pinned to one CPU (see --no-pin).
    "credproxy-10-w2": Population(principals=10, credentials=10, grants_per_principal=1),
    "credproxy-10k": Population(principals=1000, credentials=1000, grants_per_principal=10),
    # The upstream named `localhost` and found through the system resolver, as in production:
    # no --resolve.
    "credproxy-10-dns": Population(principals=10, credentials=10, grants_per_principal=1),
    # The same with `--dns-ttl 0`: every request misses the cache and waits for a lookup.
    "credproxy-10-dns-miss": Population(principals=10, credentials=10, grants_per_principal=1),
    # The same with `--upstream-idle 0`: no upstream connection outlives its client connection
    # (what one-shot clients paid before addon/mitm/reuse.py).
    "credproxy-10-nokeep": Population(principals=10, credentials=10, grants_per_principal=1),
    # Every request a 2 KiB GraphQL query, decided on its body by the grant's graphql rule.
    "credproxy-graphql": Population(
        principals=10, credentials=10, grants_per_principal=1, graphql=True
    ),
    # credproxy-10 exporting every audit line over OTLP/HTTP (to the bench's upstream, which
    # answers 200 to anything): the cost of --otlp-endpoint.
    "credproxy-10-otlp": Population(principals=10, credentials=10, grants_per_principal=1),
    # Every request signed with AWS SigV4 (botocore) at the edge.
    "credproxy-sigv4": Population(
        principals=10, credentials=10, grants_per_principal=1, scheme="sigv4"
    ),
}
# About 2 KiB: a GitHub-style query of a repository's issues and their comments.
GRAPHQL_QUERY = json.dumps(
    {
        "query": "query Issues($owner: String!, $name: String!) { repository(owner: $owner, "
        "name: $name) { issues(first: 50, states: OPEN) { nodes { number title body "
        "author { login } labels(first: 10) { nodes { name color } } comments(first: 20) "
        "{ nodes { body author { login } createdAt } } } pageInfo { hasNextPage endCursor } "
        "} } } " + "# " + "padding " * 200,
        "variables": {"owner": "acme", "name": "widgets"},
    }
).encode()
OTLP_CONFIGS = frozenset({"credproxy-10-otlp"})
DNS_CONFIGS = frozenset({"credproxy-10-dns", "credproxy-10-dns-miss"})
# Extra `credproxy run` flags per configuration.
RUN_FLAGS = {
    "credproxy-10-dns-miss": ("--dns-ttl", "0"),
    "credproxy-10-w2": ("--workers", "2"),
    "credproxy-10-nokeep": ("--upstream-idle", "0"),
}
# Several processes: given every CPU even in a pinned run.
UNPINNED = frozenset({"credproxy-10-w2"})
DNS_HOST = "localhost"
# Bare mitmproxy streaming bodies over this size, as credproxy streams what it does not hold.
STREAM_LARGE_BODIES = "64k"
# mitmproxy-lean: credproxy's master (mitmproxy's serving addons only) without credproxy's addons.
CONFIGS = ("direct", "mitmproxy", "mitmproxy-lean", "mitmproxy-stream", *POPULATIONS)
# What runs without --configs: every configuration with a target (not the cache-miss one);
# streaming mitmproxy is the reference of the download mode only.
DEFAULT_CONFIGS = tuple(
    c
    for c in CONFIGS
    if c
    not in (
        "credproxy-10-dns-miss",
        "credproxy-10-nokeep",
        "mitmproxy-lean",
        "mitmproxy-stream",
        *UNPINNED,
    )
)
DOWNLOAD_CONFIGS = ("mitmproxy", "mitmproxy-stream", "credproxy-10")
# Bytes each download cell moves when --requests is not given.
DOWNLOAD_BYTES = 256 * 1024 * 1024
RSS_CONFIG = "credproxy-10k"
RSS_CONCURRENCY = 10
RSS_PER_CONNECTION = 100
RSS_WARMUP = 2000
RSS_SAMPLES = 5


@dataclass(frozen=True)
class Settings:
    requests: int
    duration: float | None
    concurrency: tuple[int, ...]
    configs: tuple[str, ...]
    repeat: int
    starts: int
    new_connection: bool
    client: str
    rss_requests: int
    out: Path
    keep_workdir: bool
    pin: bool = True
    # Download mode: body sizes (the rows), their kind (bench.bodies); requests 0 = by bytes.
    download: tuple[int, ...] = ()
    body: str = "binary"
    download_bytes: int = DOWNLOAD_BYTES
    connection_close: bool = False  # the client's requests say `Connection: close`
    memory_connections: int = 0  # tunnels held for RSS per connection (bench.memory); 0: none

    @classmethod
    def one_cell(
        cls, configs: tuple[str, ...], requests: int, concurrency: int, workdir: Path, **more: Any
    ) -> Settings:
        """One repetition at one concurrency, raw client, unpinned, nothing written: the
        settings of a run under a profiler or valgrind (bench.profile, bench.instructions)."""
        return cls(
            requests=requests,
            duration=None,
            concurrency=(concurrency,),
            configs=configs,
            repeat=1,
            starts=1,
            new_connection=False,
            client="raw",
            rss_requests=0,
            out=workdir / "unused.json",
            keep_workdir=False,
            pin=False,
            **more,
        )


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _context(cafile: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(cafile))
    context.set_alpn_protocols(["http/1.1"])
    return context


class Bench:
    """The processes of one run and a Target for each configuration."""

    def __init__(self, settings: Settings, workdir: Path) -> None:
        self.settings = settings
        self.workdir = workdir
        self.processes: dict[str, Running] = {}
        self.targets: dict[str, Target] = {}
        self.grants: dict[str, int] = {}
        self.populate_s: dict[str, float] = {}
        self.startup: dict[str, list[float]] = {}

    def start(self) -> None:
        upstream_ca = self._upstream()
        port = self.processes["upstream"].port
        certs = self.workdir / "certs"
        ensure_ca(certs)
        proxy_context = _context(certs / PUBLIC_CERT)
        resolve = f"{HOST}=127.0.0.1:{port}"
        for config in self.settings.configs:
            launch: Callable[[], Running]
            if config in ("mitmproxy", "mitmproxy-lean", "mitmproxy-stream"):
                stream = STREAM_LARGE_BODIES if config == "mitmproxy-stream" else None
                launch = partial(
                    start_bare_mitmproxy, self.workdir, certs, upstream_ca, config, stream
                )
                # Bare mitmproxy has no --resolve: it dials the address, as direct does.
                target = Target("127.0.0.1", port, PATH, proxy_context)
            elif config in DNS_CONFIGS:
                population = replace(POPULATIONS[config], host=f"{DNS_HOST}:{port}")
                tokens = self._store(config, population)
                env = credproxy_env(self.workdir, self.workdir / f"{config}.db")
                launch = partial(
                    start_credproxy,
                    config,
                    self.workdir,
                    env,
                    upstream_ca,
                    None,
                    RUN_FLAGS.get(config, ()),
                )
                target = Target(DNS_HOST, port, PATH, proxy_context, credentials=tuple(tokens))
            elif config in POPULATIONS:
                tokens = self._store(config, POPULATIONS[config])
                env = credproxy_env(self.workdir, self.workdir / f"{config}.db")
                flags = RUN_FLAGS.get(config, ())
                if config in OTLP_CONFIGS:
                    flags += ("--otlp-endpoint", f"https://127.0.0.1:{port}")
                    env["OTEL_EXPORTER_OTLP_CERTIFICATE"] = str(upstream_ca)
                launch = partial(
                    start_credproxy,
                    config,
                    self.workdir,
                    env,
                    upstream_ca,
                    resolve,
                    flags,
                    pin=config not in UNPINNED,
                )
                target = Target(
                    HOST,
                    443,
                    PATH,
                    proxy_context,
                    credentials=tuple(tokens),
                    body=GRAPHQL_QUERY if POPULATIONS[config].graphql else None,
                )
            else:
                continue
            running = self._launch(config, launch)
            if config in POPULATIONS:
                self.grants[config] = int(running.announce["grants"])
                if self.grants[config] != POPULATIONS[config].grants:
                    raise BenchError(f"{config} loaded {self.grants[config]} grants")
            self.targets[config] = replace(target, proxy=("127.0.0.1", running.port))

    def _upstream(self) -> Path:
        """Start the upstream with a trustme certificate; returns the CA file that trusts it."""
        ca = trustme.CA()
        upstream_ca = self.workdir / "upstream-ca.pem"
        ca.cert_pem.write_to_path(str(upstream_ca))
        leaf = ca.issue_cert(HOST, DNS_HOST, "127.0.0.1")
        cert, key = self.workdir / "upstream.pem", self.workdir / "upstream.key"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        upstream = start_upstream(self.workdir, cert, key)
        self.processes["upstream"] = upstream
        self.targets["direct"] = Target("127.0.0.1", upstream.port, PATH, _context(upstream_ca))
        return upstream_ca

    def _launch(self, config: str, launch: Callable[[], Running]) -> Running:
        """Start `config` --starts times, one after the other; keep the last one running."""
        samples = []
        for attempt in range(self.settings.starts):
            running = launch()
            samples.append(running.startup_s)
            if attempt < self.settings.starts - 1:
                running.stop()
        self.processes[config] = running
        self.startup[config] = samples
        _log(f"{config} listening on :{running.port}; start-up {_seconds(samples)}")
        return running

    def _store(self, config: str, population: Population) -> list[tuple[str, str]]:
        db = self.workdir / f"{config}.db"
        env = credproxy_env(self.workdir, db)
        credproxy_init(env)
        began = time.perf_counter()
        key = load_master_key(self.workdir / "credproxy.key", {})
        store = Store(env["CREDPROXY_DB"], key)
        try:
            tokens = populate(store, key, population)
        finally:
            store.close()
        self.populate_s[config] = round(time.perf_counter() - began, 2)
        _log(f"{config}: {population.grants:,} grants written in {self.populate_s[config]} s")
        return tokens

    def cell(
        self,
        config: str,
        concurrency: int,
        requests: int | None,
        duration: float | None = None,
        per_connection: int | None = None,
        size: int | None = None,
    ) -> Outcome:
        target = replace(self.targets[config], close=self.settings.connection_close)
        if size is not None:
            target = replace(target, path=f"{BLOB.decode()}{self.settings.body}/{size}")
        running = self.processes.get(config)
        probe = running.cpu_s if running is not None else None
        own = running.own_cpu_s if running is not None and running.has_workers() else None
        supervisor = own() if own is not None else 0.0
        try:
            if self.settings.client == "httpx":
                assert requests is not None
                outcome = asyncio.run(run_cell_httpx(target, concurrency, requests, probe))
            else:
                outcome = asyncio.run(
                    run_cell(
                        target,
                        concurrency,
                        requests,
                        duration,
                        per_connection=per_connection,
                        probe=probe,
                    )
                )
            if own is not None:  # over the whole cell, its connections' set-up included
                outcome.supervisor_s = own() - supervisor
            return outcome
        except (BadResponse, OSError, ssl.SSLError, TimeoutError) as e:
            log = running.output if running is not None else None
            raise BenchError(f"{config} at c={concurrency}: {e!r} (log: {log})") from e

    def stop(self) -> None:
        for running in reversed(self.processes.values()):
            running.stop()


def _seconds(samples: list[float]) -> str:
    return ", ".join(f"{s:.2f}" for s in samples) + " s"


def _share(total: int, parts: int, index: int) -> int:
    return total // parts + (1 if index < total % parts else 0)


def _mode(settings: Settings) -> str:
    if settings.download:
        return f"download-{settings.body}"
    return "new-connection" if settings.new_connection else "keep-alive"


def _cell_requests(settings: Settings, size: int | None) -> int:
    """Requests of one cell over all repetitions: --requests, or a download's share of bytes."""
    if size is None or settings.requests:
        return settings.requests
    return max(settings.repeat, settings.download_bytes // size)


def _matrix(bench: Bench, settings: Settings) -> list[dict[str, Any]]:
    mode = _mode(settings)
    per_connection = 1 if settings.new_connection else None
    configs = [c for c in settings.configs if c in bench.targets]
    sizes: tuple[int | None, ...] = settings.download or (None,)
    levels = [(c, size) for size in sizes for c in settings.concurrency]
    cells = {
        (config, c, size): report.Cell(config, c, mode, size)
        for c, size in levels
        for config in configs
    }
    for rep in range(settings.repeat):
        for concurrency, size in levels:
            # Rotate the order each repetition, so no configuration always runs first.
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            for config in order:
                requests = (
                    None
                    if settings.duration
                    else _share(_cell_requests(settings, size), settings.repeat, rep)
                )
                duration = settings.duration / settings.repeat if settings.duration else None
                outcome = bench.cell(config, concurrency, requests, duration, per_connection, size)
                cell = cells[(config, concurrency, size)]
                cell.add(outcome)
                if config in bench.processes:
                    cell.rss_mb = bench.processes[config].rss_mb()
                rate = outcome.requests / outcome.elapsed
                shown = f"{rate * size / 1e6:8.1f} MB/s" if size else f"{rate:8.0f} rps"
                _log(
                    f"rep {rep + 1}/{settings.repeat} c={concurrency:<3} "
                    f"{'' if size is None else f'{size:>9} B '}{config:<16} "
                    f"{shown}, {outcome.errors} errors"
                )
    rows = [cells[(config, c, size)].row() for c, size in levels for config in configs]
    report.compare(rows)
    return rows


def _rss_growth(bench: Bench, settings: Settings) -> dict[str, Any] | None:
    if settings.rss_requests <= 0 or RSS_CONFIG not in bench.processes:
        return None
    running = bench.processes[RSS_CONFIG]
    bench.cell(RSS_CONFIG, RSS_CONCURRENCY, RSS_WARMUP, None, RSS_PER_CONNECTION)
    before = running.rss_mb()
    samples, errors, done = [], 0, 0
    for i in range(RSS_SAMPLES):
        n = _share(settings.rss_requests, RSS_SAMPLES, i)
        errors += bench.cell(RSS_CONFIG, RSS_CONCURRENCY, n, None, RSS_PER_CONNECTION).errors
        done += n
        samples.append(running.rss_mb())
        _log(f"RSS growth: {done:,} requests, {samples[-1]:.1f} MiB")
    return {
        "config": RSS_CONFIG,
        "requests": settings.rss_requests,
        "concurrency": RSS_CONCURRENCY,
        "per_connection": RSS_PER_CONNECTION,
        "warmup_requests": RSS_WARMUP,
        "before_mb": round(before, 1),
        "after_mb": round(samples[-1], 1),
        "growth_mb": round(samples[-1] - before, 1),
        "samples_mb": [round(s, 1) for s in samples],
        "errors": errors,
    }


def _memory(bench: Bench, settings: Settings) -> dict[str, Any] | None:
    """RSS per held connection of bare mitmproxy and credproxy-10 (bench.memory), when both
    run; last, since it leaves their heaps larger."""
    # Here, not at the top: bench.memory builds on this module's Bench.
    from bench import memory  # noqa: PLC0415

    configs = [c for c in memory.CONFIGS if c in bench.processes]
    if settings.memory_connections <= 0 or len(configs) < len(memory.CONFIGS):
        return None
    rows = {}
    # The trim after a close waits for 5 quiet seconds (addon/proxy/limits.py): a smoke run's
    # few connections are not enough for it, and need not wait for it.
    settle = 8.0 if settings.memory_connections >= 100 else 1.0
    for config in configs:
        rows[config] = memory.measure(bench, config, settings.memory_connections, settle=settle)
        _log(f"memory per connection: {config} {rows[config]['kib_per_connection']} KiB")
    return memory.summary(rows, settings.memory_connections, 1, traced=False)


def _at_start() -> dict[str, Any]:
    """`credproxy run` after a fresh `credproxy init`, beside mitmdump (bench.startmem)."""
    from bench import startmem  # noqa: PLC0415 - only for this part of the run

    found = startmem.one_round(3.0)
    _log(f"memory at start: credproxy - mitmdump {found['start']['difference']:+.1f} MiB")
    return found


def run(settings: Settings) -> str:
    """Run everything; write the JSON and markdown; return the markdown."""
    workdir = Path(tempfile.mkdtemp(prefix="credproxy-bench-"))
    affinity = processes.split_cpus() if settings.pin else None
    processes.AFFINITY = affinity
    if affinity is not None:
        os.sched_setaffinity(0, affinity["client"])  # this process is the client
    bench = Bench(settings, workdir)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        bench.start()
        rows = _matrix(bench, settings)
        growth = None if settings.download else _rss_growth(bench, settings)
        memory = None if settings.download else _memory(bench, settings)
    finally:
        bench.stop()
        # After the others stopped, as a user starts it: a fresh store, beside mitmdump.
        at_start = None if settings.download or not settings.memory_connections else _at_start()
        if settings.keep_workdir:
            _log(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    results: dict[str, Any] = {
        "meta": {
            "started": started,
            "mode": _mode(settings),
            "client": settings.client,
            "connection_close": settings.connection_close,
            "repeat": settings.repeat,
            "requests_per_cell": None if settings.duration else settings.requests,
            "duration_per_cell_s": settings.duration,
            "cpus": os.cpu_count(),
            "pinned": {role: sorted(cpus) for role, cpus in affinity.items()} if affinity else None,
            "python": platform.python_version(),
            "mitmproxy": version("mitmproxy"),
        },
        "rows": rows,
        "startup_s": {
            name: round(statistics.median(samples), 3) for name, samples in bench.startup.items()
        },
        "startup_samples_s": {
            name: [round(s, 3) for s in samples] for name, samples in bench.startup.items()
        },
        "grants": bench.grants,
        "populate_s": bench.populate_s,
        "rss_growth": growth,
        "memory_per_connection": memory,
        "memory_at_start": at_start,
        "redactor": redaction.costs(settings.body if settings.download else None),
    }
    results["targets"] = report.targets(results)
    return report.write(results, settings.out)
