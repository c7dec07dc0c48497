"""Figures per cell, the comparison with bare mitmproxy, the targets, and the two outputs."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.client import Outcome

BASELINE = "mitmproxy"
CREDPROXY_CONFIGS = ("credproxy-10", "credproxy-10k")
MIN_RPS_RATIO = 0.90
MAX_P50_ADDED_MS = 0.5
MAX_RSS_GROWTH_MIB = 20.0
MAX_STARTUP_S = 2.0
STARTUP_CONFIG = "credproxy-10k"


@dataclass
class Cell:
    """One configuration at one concurrency, summed over the repetitions."""

    config: str
    concurrency: int
    mode: str
    requests: int = 0
    errors: int = 0
    elapsed: float = 0.0
    cpu_s: float | None = None
    latencies: list[float] = field(default_factory=list)
    rps_reps: list[float] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)
    rss_mb: float | None = None

    def add(self, outcome: Outcome) -> None:
        self.requests += outcome.requests
        self.errors += outcome.errors
        self.elapsed += outcome.elapsed
        if outcome.probed is not None:
            self.cpu_s = (self.cpu_s or 0.0) + outcome.probed
        self.latencies += outcome.latencies
        self.rps_reps.append(outcome.requests / outcome.elapsed if outcome.elapsed else 0.0)
        for kind, n in outcome.error_kinds.items():
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + n

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed if self.elapsed else 0.0

    def percentile_ms(self, q: int) -> float | None:
        if not self.latencies:
            return None
        if len(self.latencies) == 1:
            return self.latencies[0] * 1000
        cuts = statistics.quantiles(self.latencies, n=100, method="inclusive")
        return cuts[q - 1] * 1000

    def row(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "concurrency": self.concurrency,
            "mode": self.mode,
            "requests": self.requests,
            "errors": self.errors,
            "rps": _round(self.rps, 1),
            "p50_ms": _round(self.percentile_ms(50), 3),
            "p99_ms": _round(self.percentile_ms(99), 3),
            "rss_mb": _round(self.rss_mb, 1),
            "cpu_ms": _round(self.cpu_s * 1000 / self.requests, 3)
            if self.cpu_s is not None and self.requests
            else None,
            "rps_reps": [round(r, 1) for r in self.rps_reps],
            "error_kinds": self.error_kinds,
        }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _by_key(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["config"], r["concurrency"]): r for r in rows}


def compare(rows: list[dict[str, Any]]) -> None:
    """Add `rps_ratio` and `p50_added_ms` against bare mitmproxy at the same concurrency."""
    index = _by_key(rows)
    for row in rows:
        base = index.get((BASELINE, row["concurrency"]))
        row["rps_ratio"] = row["p50_added_ms"] = row["cpu_ratio"] = None
        if base is None or row["config"] == BASELINE:
            continue
        if base["rps"]:
            row["rps_ratio"] = round(row["rps"] / base["rps"], 3)
        if row["cpu_ms"] is not None and base["cpu_ms"]:
            row["cpu_ratio"] = round(row["cpu_ms"] / base["cpu_ms"], 3)
        if row["p50_ms"] is not None and base["p50_ms"] is not None:
            row["p50_added_ms"] = round(row["p50_ms"] - base["p50_ms"], 3)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what was measured and whether it was met."""
    checks: list[dict[str, Any]] = []

    def check(name: str, measured: float | None, limit: float, higher_is_better: bool) -> None:
        met = None
        if measured is not None:
            met = measured >= limit if higher_is_better else measured < limit
        checks.append({"target": name, "measured": measured, "limit": limit, "met": met})

    for row in results["rows"]:
        if row["config"] not in CREDPROXY_CONFIGS or row["rps_ratio"] is None:
            continue
        name = f"{row['config']} rps ≥ {MIN_RPS_RATIO:.2f} × mitmproxy at c={row['concurrency']}"
        check(name, row["rps_ratio"], MIN_RPS_RATIO, True)
        if row["concurrency"] == 1:
            name = f"{row['config']} p50 added ≤ {MAX_P50_ADDED_MS} ms at c=1"
            added = row["p50_added_ms"]
            met = None if added is None else added <= MAX_P50_ADDED_MS
            checks.append(
                {"target": name, "measured": added, "limit": MAX_P50_ADDED_MS, "met": met}
            )
    growth = results.get("rss_growth")
    if growth:
        name = f"{growth['config']} RSS growth < {MAX_RSS_GROWTH_MIB:.0f} MiB over "
        name += f"{growth['requests']:,} requests"
        check(name, growth["growth_mb"], MAX_RSS_GROWTH_MIB, False)
    startup = results["startup_s"].get(STARTUP_CONFIG)
    if startup is not None:
        check(
            f"{STARTUP_CONFIG} start-up to listening < {MAX_STARTUP_S:.0f} s",
            startup,
            MAX_STARTUP_S,
            False,
        )
    return checks


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "–"
    return format(value, spec)


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        "# credproxy benchmark",
        "",
        f"{meta['mode']} connections, {meta['client']} client, {meta['repeat']} interleaved "
        f"repetition(s) per cell; {meta['cpus']} CPUs, Python {meta['python']}, "
        f"mitmproxy {meta['mitmproxy']}; {meta['started']}.",
        "",
        "| config | c | requests | errors | rps (per rep) | rps ÷ mitmproxy | p50 ms | p99 ms "
        "| p50 − mitmproxy ms | proxy CPU ms/req | CPU ÷ mitmproxy | RSS MiB |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results["rows"]:
        reps = r["rps_reps"]
        spread = f" ({min(reps):.0f}–{max(reps):.0f})" if len(reps) > 1 else ""
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['requests']} | {r['errors']} "
            f"| {_fmt(r['rps'], '.0f')}{spread} | {_fmt(r['rps_ratio'], '.2f')} "
            f"| {_fmt(r['p50_ms'], '.2f')} | {_fmt(r['p99_ms'], '.2f')} "
            f"| {_fmt(r['p50_added_ms'], '+.2f')} | {_fmt(r['cpu_ms'], '.2f')} "
            f"| {_fmt(r['cpu_ratio'], '.2f')} | {_fmt(r['rss_mb'], '.1f')} |"
        )
    lines += [
        "",
        "| proxy | start-up to listening, median (s) | each start (s) | grants |",
        "|---|--:|--:|--:|",
    ]
    for config, seconds in results["startup_s"].items():
        each = ", ".join(f"{s:.2f}" for s in results["startup_samples_s"][config])
        grants = results["grants"].get(config)
        lines.append(f"| {config} | {seconds:.2f} | {each} | {_fmt(grants)} |")
    growth = results.get("rss_growth")
    if growth:
        samples = ", ".join(f"{s:.1f}" for s in growth["samples_mb"])
        lines += [
            "",
            f"RSS growth of {growth['config']} over {growth['requests']:,} requests "
            f"(c={growth['concurrency']}, a new connection every {growth['per_connection']} "
            f"requests): {growth['before_mb']:.1f} → {growth['after_mb']:.1f} MiB "
            f"(**{growth['growth_mb']:+.1f} MiB**; samples {samples}); "
            f"{growth['errors']} errors.",
        ]
    if results["targets"]:
        lines += ["", "| target | measured | met |", "|---|--:|:-:|"]
        for t in results["targets"]:
            met = {True: "yes", False: "**no**", None: "–"}[t["met"]]
            lines.append(f"| {t['target']} | {_fmt(t['measured'], '.3f')} | {met} |")
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], out: Path) -> str:
    """Write `out` (JSON) and its .md sibling; returns the markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    out.with_suffix(".md").write_text(text)
    return text
