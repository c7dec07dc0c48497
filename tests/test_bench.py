"""The benchmark's smoke run, so that it never rots. Nothing here asserts a timing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# The benchmark's own machinery, not the proxy's properties: out of the default run.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 2)


def _bench(out: Path, configs: tuple[str, ...], requests: int, *extra: str) -> dict[str, Any]:
    args = [
        *("--smoke", "--out", str(out), "--configs", ",".join(configs)),
        *("--concurrency", ",".join(map(str, CONCURRENCY)), "--requests", str(requests)),
        *extra,
    ]
    result = subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results: dict[str, Any] = json.loads(out.read_text())
    return results


def _rows(results: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["config"], r["concurrency"]): r for r in results["rows"]}


@pytest.mark.parametrize(
    ("mode", "configs", "requests", "extra"),
    [
        pytest.param(
            "keep-alive",
            ("direct", "mitmproxy", "credproxy-10", "credproxy-graphql"),
            20,
            (),
            id="keep-alive through every proxy and direct gives a row per config and level "
            "(a GraphQL body decided per request among them)",
        ),
        pytest.param(
            "new-connection",
            ("mitmproxy", "credproxy-10"),
            6,
            ("--new-connection",),
            id="a new connection per request gives the same rows",
        ),
        pytest.param(
            "keep-alive",
            ("mitmproxy", "credproxy-10-dns", "credproxy-10-dns-miss"),
            6,
            (),
            id="the system resolver's path, cached and missing every time, gives rows too",
        ),
    ],
)
def test_smoke_run(
    tmp_path: Path, mode: str, configs: tuple[str, ...], requests: int, extra: tuple[str, ...]
) -> None:
    out = tmp_path / "results.json"
    results = _bench(out, configs, requests, *extra)

    rows = _rows(results)
    assert set(rows) == {(config, c) for config in configs for c in CONCURRENCY}
    for row in rows.values():
        assert row["mode"] == mode
        assert (row["requests"], row["errors"]) == (requests, 0), row["error_kinds"]
        assert row["rps"] > 0
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        if row["config"] == "direct":
            assert row["rss_mb"] is None
        else:
            assert row["rss_mb"] > 0
            assert row["cpu_ms"] is not None
    ours = [config for config in configs if config.startswith("credproxy")]
    for config in ours:
        for c in CONCURRENCY:
            assert rows[(config, c)]["rps_ratio"] > 0

    proxies = {config for config in configs if config != "direct"}
    assert set(results["startup_s"]) == proxies
    assert results["grants"] == dict.fromkeys(ours, 10)
    assert results["rss_growth"] is None
    memory = results["memory_per_connection"]
    if {"mitmproxy", "credproxy-10"} <= set(configs):
        assert set(memory["rows"]) == {"mitmproxy", "credproxy-10"}
        assert memory["rows"]["credproxy-10"]["kib_per_connection"] is not None
        at_start = results["memory_at_start"]
        assert at_start["start"]["mitmdump"]["rss"] > 0
        assert at_start["first_request"]["credproxy"]["rss"] > 0
    else:
        assert memory is None
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra
        assert out.with_suffix(".svg").read_text().lstrip().startswith("<?xml")
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("# credproxy benchmark")
    assert all(f"| {config} | 1 |" in markdown for config in ours)


def test_download_smoke_run(tmp_path: Path) -> None:
    """Downloads larger than what credproxy holds whole: MB/s against streaming mitmproxy."""
    out = tmp_path / "results.json"
    configs = ("mitmproxy", "mitmproxy-stream", "credproxy-10")
    results = _bench(out, configs, 2, "--download", "100k,1m", "--body", "json")
    rows = {(r["config"], r["concurrency"], r["size"]): r for r in results["rows"]}
    sizes = (100 * 1024, 1024 * 1024)
    assert set(rows) == {(k, c, n) for k in configs for c in CONCURRENCY for n in sizes}
    for row in rows.values():
        assert row["mode"] == "download-json"
        assert (row["requests"], row["errors"]) == (2, 0), row["error_kinds"]
        assert row["mb_s"] > 0
        assert row["cpu_ns_per_byte"] is not None
        # Downloads compare with streaming mitmproxy, which has no ratio of its own.
        assert (row["rps_ratio"] is None) == (row["config"] == "mitmproxy-stream")
    kinds = {r["body"] for r in results["redactor"]}
    assert kinds == {"binary", "text", "json"}
    assert all(r["ns_per_byte"] > 0 for r in results["redactor"])
    assert results["rss_growth"] is None
    names = [t["target"] for t in results["targets"]]
    assert any("credproxy-10 1 MiB downloads" in n for n in names)
    assert "÷ streaming mitmproxy" in out.with_suffix(".md").read_text()


def test_the_comparison_pairs_each_repetition_with_mitmproxys() -> None:
    """A repetition that the machine slowed for everyone moves the totals, not the pairs."""
    from bench.report import compare

    def row(config: str, rps: list[float], p50: list[float]) -> dict[str, Any]:
        return {
            "config": config,
            "concurrency": 1,
            "rps": sum(rps) / len(rps),
            "rps_reps": rps,
            "p50_ms": sorted(p50)[len(p50) // 2],
            "p50_ms_reps": p50,
            "cpu_ms": None,
        }

    base = row("mitmproxy", [100, 300, 100], [10, 3, 10])
    ours = row("credproxy-10", [95, 285, 95], [10.5, 3.5, 10.5])
    compare([base, ours])
    assert ours["rps_ratio"] == 0.95
    assert ours["rps_ratio_iqr"] == [0.95, 0.95]
    assert ours["rps_ratio_pooled"] == 0.95
    assert ours["p50_added_ms"] == 0.5
    slowed = row("credproxy-10", [95, 150, 95], [10.5, 6, 10.5])  # the second rep hit hard
    compare([base, slowed])
    assert slowed["rps_ratio"] == 0.95
    assert slowed["rps_ratio_pooled"] == 0.68
    assert slowed["p50_added_ms"] == 0.5


def test_the_graphql_configuration_has_its_throughput_target() -> None:
    from bench.report import targets

    rows = [
        {"config": "credproxy-graphql", "concurrency": 10, "rps_ratio": 0.92},
        {"config": "credproxy-10-otlp", "concurrency": 10, "rps_ratio": 0.5},  # no target
    ]
    checks = targets({"rows": rows, "rss_growth": None, "startup_s": {}})
    assert checks == [
        {
            "target": "credproxy-graphql rps ≥ 0.90 × mitmproxy at c=10",
            "measured": 0.92,
            "limit": 0.9,
            "met": True,
        }
    ]


def test_instruction_counts_run(tmp_path: Path) -> None:
    """python -m bench.instructions under callgrind, tiny: it starts, counts and compares."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.instructions", "--configs", "mitmproxy,credproxy-10"]
        + ["--requests", "20", "--concurrency", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout
    assert "| mitmproxy | " in table and "| credproxy-10 | " in table
    counts = [line.split("|")[2] for line in table.splitlines()[2:]]
    assert all(float(c.strip().removesuffix(" M")) > 0 for c in counts)


def test_shared_rates_cost_runs() -> None:
    """python -m bench.shared_rates, tiny: in memory and SQLite at least, each with a figure."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.shared_rates", "--takes", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = result.stdout.splitlines()[2:]
    assert {row.split("|")[1].strip() for row in rows} >= {"in memory (per replica)", "SQLite"}
    assert all(float(row.split("|")[3]) > 0 for row in rows)
