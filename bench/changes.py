"""`python -m bench.changes`: what a change to the store costs running proxies (issue 24 item 1).

Two `credproxy run` replicas on one SQLite store of 100,000 grants (10,000 principals x 10,
population.py), a trustme upstream. Figures:
- proxy CPU per once-use, on the replica that serves it and on the one that only applies it
  (each net of the replica's idle CPU; the serving one also net of an ordinary request's CPU);
- the worst latency of standing requests while once-uses are applied, against their p99 with
  no change;
- the change lag across replicas: a grant added, until both replicas serve it;
- the full reload's own cost (SIGHUP): wall time, CPU, and the worst request latency meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import trustme

from bench import processes
from bench.client import Target, _Connection
from bench.population import HOST, PATH, Population, populate
from bench.processes import (
    CREDPROXY,
    BenchError,
    Running,
    credproxy_env,
    credproxy_init,
    split_cpus,
    start,
    start_upstream,
)
from bench.run import _context
from store.ca import PUBLIC_CERT, ensure_ca
from store.crypto import load_master_key
from store.repository import Store

SPACING = 0.6  # s between once-uses: each poll (500 ms) then applies about one change


def _log(message: str) -> None:
    print(f"[changes] {message}", file=sys.stderr, flush=True)


def _request(path: str) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nUser-Agent: credproxy-bench\r\n\r\n").encode()


class Prober:
    """Standing requests one after another on one keep-alive connection, in a thread."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.latencies: list[tuple[float, float]] = []  # (when it ended, seconds)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    async def _run(self) -> None:
        conn = await _Connection.dial(self.target, 0)
        request = _request(PATH)
        while not self._stop.is_set():
            began = time.perf_counter()
            status = await conn.get(request)
            ended = time.perf_counter()
            if status == 200:
                self.latencies.append((ended, ended - began))
            else:
                self.errors += 1
            await asyncio.sleep(0.002)
        await conn.close()

    def between(self, start: float, end: float) -> list[float]:
        return [s for t, s in self.latencies if start <= t <= end]


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _ms(value: float) -> float:
    return round(value * 1000, 2)


async def _gets(target: Target, paths: list[str], spacing: float) -> list[int]:
    conn = await _Connection.dial(target, 0)
    statuses = []
    for path in paths:
        statuses.append(await conn.get(_request(path)))
        await asyncio.sleep(spacing)
    await conn.close()
    return statuses


def _reloads(running: Running) -> list[dict[str, Any]]:
    found = []
    for line in running.output.read_text(errors="replace").splitlines():
        if '"policy.reloaded"' in line:
            found.append(json.loads(line))
    return found


def _full_reload(running: Running) -> float:
    """SIGHUP; returns when the full reload's line is written (its wall time)."""
    seen = len(_reloads(running))
    t0 = time.perf_counter()
    running.process.send_signal(signal.SIGHUP)
    while time.perf_counter() - t0 < 120:
        # A credproxy before the change log writes no mode: every reload is full.
        if any(r.get("mode", "full") == "full" for r in _reloads(running)[seen:]):
            return time.perf_counter() - t0
        time.sleep(0.01)
    raise BenchError("no full reload within 120 s of SIGHUP")


def measure(settings: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    processes.AFFINITY = split_cpus()
    ca = trustme.CA()
    upstream_ca = workdir / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(upstream_ca))
    leaf = ca.issue_cert(HOST, "127.0.0.1")
    cert, key_file = workdir / "upstream.pem", workdir / "upstream.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key_file))
    started: list[Running] = [start_upstream(workdir, cert, key_file)]
    try:
        return _measure(settings, workdir, upstream_ca, started)
    finally:
        for running in reversed(started):
            running.stop()


def _measure(
    settings: argparse.Namespace, workdir: Path, upstream_ca: Path, started: list[Running]
) -> dict[str, Any]:
    port = started[0].port
    certs = workdir / "certs"
    ensure_ca(certs)
    db = workdir / "store.db"
    env = credproxy_env(workdir, db)
    credproxy_init(env)
    key = load_master_key(workdir / "credproxy.key", {})
    store = Store(env["CREDPROXY_DB"], key)
    population = Population(settings.principals, max(1, settings.principals // 10), 10)
    began = time.perf_counter()
    tokens = populate(store, key, population)
    agent = tokens[0][0]
    for k in range(2 * settings.once):
        store.add_grant(agent, ["GET"], hosts=[HOST], paths=[f"/once/{k}/"], once=True)
    _log(f"{population.grants:,} grants written in {time.perf_counter() - began:.1f} s")

    args = [*CREDPROXY, "run", "--listen", "127.0.0.1:0", "--upstream-ca", str(upstream_ca)]
    args += ["--resolve", f"{HOST}=127.0.0.1:{port}"]
    # Replica A on the proxy's own CPU, serving; B beside the client, mostly applying.
    a = start("replica-a", args, env, workdir / "a.out", '"proxy.started"')
    started.append(a)
    b = start("replica-b", args, env, workdir / "b.out", '"proxy.started"', role="client")
    started.append(b)
    _log(f"replicas up ({a.announce['grants']:,} grants); start-up {a.startup_s:.1f} s")
    context = _context(certs / PUBLIC_CERT)
    base = Target(HOST, 443, PATH, context, credentials=(tokens[0],))
    ta, tb = replace(base, proxy=("127.0.0.1", a.port)), replace(base, proxy=("127.0.0.1", b.port))
    time.sleep(2)

    # Idle CPU (the 500 ms poll), then requests with no change.
    idle_s = 5.0
    cpu_a, cpu_b = a.cpu_s(), b.cpu_s()
    time.sleep(idle_s)
    idle_a, idle_b = (a.cpu_s() - cpu_a) / idle_s, (b.cpu_s() - cpu_b) / idle_s
    with Prober(ta) as quiet:
        cpu_a = a.cpu_s()
        t0 = time.perf_counter()
        time.sleep(settings.quiet)
        t1 = time.perf_counter()
        cpu_quiet = a.cpu_s() - cpu_a
    still = quiet.between(t0, t1)
    per_request = (cpu_quiet - idle_a * (t1 - t0)) / max(1, len(still))
    _log(f"no change: {len(still)} requests, p99 {_ms(_p(still, 0.99))} ms")

    # The periodic full read comes 60 s after the last one: start that minute now, so that
    # it stays out of the phases below (its own cost is measured at the end).
    _full_reload(a)
    _full_reload(b)
    periodic = len([r for r in _reloads(a) if r.get("mode") == "full"])
    # Once-uses on A, one per SPACING, nothing else: their CPU on A (served and applied)
    # and on B (applied only).
    n = max(1, settings.once)
    cpu_a, cpu_b = a.cpu_s(), b.cpu_s()
    t0 = time.perf_counter()
    statuses = asyncio.run(_gets(ta, [f"/once/{k}/x" for k in range(n)], SPACING))
    time.sleep(1.0)  # the last change reaches B
    t1 = time.perf_counter()
    used_a, used_b = a.cpu_s() - cpu_a, b.cpu_s() - cpu_b
    served = statuses.count(200)
    once_cpu_a = (used_a - idle_a * (t1 - t0)) / n
    once_cpu_b = (used_b - idle_b * (t1 - t0)) / n
    incremental = [r for r in _reloads(b) if r.get("mode") == "incremental"]
    _log(f"once-uses: {served}/{n} served; B applied {len(incremental)} incremental updates")
    # The same again, while the prober measures A's standing requests.
    with Prober(ta) as busy:
        t0 = time.perf_counter()
        asyncio.run(_gets(ta, [f"/once/{k}/x" for k in range(n, 2 * n)], SPACING))
        t1 = time.perf_counter()
    during = busy.between(t0, t1)
    if len([r for r in _reloads(a) if r.get("mode") == "full"]) != periodic:
        raise BenchError("a periodic full reload ran inside the change phases")

    # Change lag: a grant added, until both replicas serve it.
    lags = []
    for r in range(settings.lag_rounds):
        path = f"/lag/{r}/"
        store.add_grant(agent, ["GET"], hosts=[HOST], paths=[path])
        t0 = time.perf_counter()
        pending = {"a": ta, "b": tb}
        while pending and time.perf_counter() - t0 < 10:
            for name, target in list(pending.items()):
                if asyncio.run(_gets(target, [path + "x"], 0))[0] == 200:
                    del pending[name]
            time.sleep(0.02)
        lags.append(time.perf_counter() - t0 if not pending else float("inf"))
        time.sleep(0.3)
    _log(f"lag: max {max(lags):.2f} s")

    # The full reload's own cost: SIGHUP to A, with the prober running.
    full = []
    with Prober(ta) as reload_probe:
        for _ in range(settings.full_rounds):
            cpu_a = a.cpu_s()
            t0 = time.perf_counter()
            _full_reload(a)
            t1 = time.perf_counter()
            cpu = a.cpu_s() - cpu_a - idle_a * (t1 - t0)
            worst = max(reload_probe.between(t0, t1), default=float("nan"))
            full.append({"wall_s": round(t1 - t0, 2), "cpu_s": round(cpu, 2), "worst_ms": worst})
            time.sleep(1.0)
    store.close()
    return {
        "grants": int(a.announce["grants"]),
        "once_uses": n,
        "once_served": served,
        "idle_cpu_ms_per_s": {"a": _ms(idle_a), "b": _ms(idle_b)},
        "request_cpu_ms": _ms(per_request),
        "once_use_cpu_ms": {
            "serving_and_applying": _ms(once_cpu_a),
            "applying_only": _ms(once_cpu_b),
        },
        "incremental_updates_b": len(incremental),
        "quiet": {
            "requests": len(still),
            "p50_ms": _ms(_p(still, 0.5)),
            "p99_ms": _ms(_p(still, 0.99)),
            "p999_ms": _ms(_p(still, 0.999)),
            "max_ms": _ms(max(still, default=float("nan"))),
        },
        "during_changes": {
            "requests": len(during),
            "p99_ms": _ms(_p(during, 0.99)),
            "p999_ms": _ms(_p(during, 0.999)),
            "max_ms": _ms(max(during, default=float("nan"))),
        },
        "worst_over_quiet_p99": round(max(during, default=0) / _p(still, 0.99), 2),
        "quiet_max_over_quiet_p99": round(max(still, default=0) / _p(still, 0.99), 2),
        "lag_s": {"median": round(statistics.median(lags), 2), "max": round(max(lags), 2)},
        "full_reload": [
            {**f, "worst_ms": _ms(f["worst_ms"])}
            for f in full  # type: ignore[arg-type]
        ],
        "prober_errors": quiet.errors + busy.errors + reload_probe.errors,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.changes", description=__doc__)
    p.add_argument("--principals", type=int, default=10_000, help="10 grants each")
    p.add_argument("--once", type=int, default=30, help="once-uses, one per 0.6 s")
    p.add_argument("--quiet", type=float, default=10.0, help="seconds of requests, no change")
    p.add_argument("--lag-rounds", type=int, default=10, help="grants added, lag measured")
    p.add_argument("--full-rounds", type=int, default=3, help="full reloads (SIGHUP)")
    p.add_argument("--out", type=Path, help="write the figures as JSON here too")
    settings = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="credproxy-changes-") as tmp:
        result = measure(settings, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if settings.out is not None:
        settings.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
