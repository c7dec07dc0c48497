"""The benchmark's figures: `python -m bench.figure RESULTS.json [--memory MEMORY.json]`.

`make bench` calls `draw` after writing its JSON, so each run leaves an SVG beside its
tables (`bench/results.svg` by default). Four panels, from one run:

- throughput ratio against bare mitmproxy (paired median, with its middle half as an error
  bar), per configuration and concurrency; 1.0 is mitmproxy, the dashed line;
- p50 and p99 latency per configuration and concurrency, direct and mitmproxy included;
- RSS per configuration once it served its cells (what a grant costs: credproxy-10 against
  credproxy-10k), and the memory-growth run's samples;
- RSS per held connection (`python -m bench.memory`'s JSON, when `--memory` names one).

matplotlib is the `bench` extra's (pyproject.toml): the figure is skipped, with a line on
stderr, where it is not installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FIGURE_SUFFIX = ".svg"


def draw(results: dict[str, Any], out: Path, memory: dict[str, Any] | None = None) -> Path | None:
    """Write the figure of `results` to `out`; returns it, or None without matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415 - the bench extra's, imported only to draw

        matplotlib.use("Agg")
        from matplotlib import pyplot  # noqa: PLC0415
    except ImportError:
        print("[bench] no figure: matplotlib is not installed (the bench extra)", file=sys.stderr)
        return None
    rows = [r for r in results.get("rows", []) if r.get("size") is None]
    fig, axes = pyplot.subplots(2, 2, figsize=(13, 9))
    _ratios(axes[0][0], rows)
    _latency(axes[0][1], rows)
    _rss(axes[1][0], rows, results.get("rss_growth"))
    _per_connection(axes[1][1], memory)
    meta = results.get("meta", {})
    fig.suptitle(
        f"credproxy against bare mitmproxy: {meta.get('started', '?')}, {meta.get('cpus', '?')} "
        f"CPUs, mitmproxy {meta.get('mitmproxy', '?')}, Python {meta.get('python', '?')}, "
        f"{meta.get('repeat', '?')} repetitions, {meta.get('mode', '')}",
        fontsize=10,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Date": None})  # no timestamp inside: runs diff by figures
    pyplot.close(fig)
    return out


def _configs(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["config"] for r in rows))


def _levels(rows: list[dict[str, Any]]) -> list[int]:
    return sorted({r["concurrency"] for r in rows})


def _grouped(ax: Any, rows: list[dict[str, Any]], configs: list[str], value: Any) -> None:
    """Bars per concurrency (groups) and configuration (bars), `value(row)` -> (y, err)."""
    levels = _levels(rows)
    width = 0.8 / max(1, len(configs))
    index = {(r["config"], r["concurrency"]): r for r in rows}
    for n, config in enumerate(configs):
        xs, ys, errs = [], [], []
        for i, level in enumerate(levels):
            row = index.get((config, level))
            got = value(row) if row is not None else None
            if got is None:
                continue
            xs.append(i + n * width)
            ys.append(got[0])
            errs.append(got[1])
        if xs:
            ax.bar(xs, ys, width, yerr=list(zip(*errs, strict=True)), label=config, capsize=2)
    ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(levels))])
    ax.set_xticklabels([f"c={c}" for c in levels])


def _ratios(ax: Any, rows: list[dict[str, Any]]) -> None:
    # Direct is in the latency panel: its ratio (several times mitmproxy's) would flatten these.
    mine = [r for r in rows if r.get("rps_ratio") is not None and r["config"] != "direct"]

    def value(row: dict[str, Any]) -> tuple[float, tuple[float, float]] | None:
        ratio, iqr = row["rps_ratio"], row.get("rps_ratio_iqr") or [row["rps_ratio"]] * 2
        return ratio, (ratio - iqr[0], iqr[1] - ratio)

    _grouped(ax, mine, _configs(mine), value)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_title("requests/s ÷ bare mitmproxy's (paired median, middle half)")
    if mine:
        ax.legend(fontsize=7)


def _latency(ax: Any, rows: list[dict[str, Any]]) -> None:
    configs = _configs(rows)
    levels = _levels(rows)
    index = {(r["config"], r["concurrency"]): r for r in rows}
    for config in configs:
        for q, style in (("p50_ms", "-o"), ("p99_ms", ":x")):
            pts = [
                (level, index[(config, level)][q])
                for level in levels
                if (config, level) in index and index[(config, level)][q] is not None
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=f"{config} {q[:3]}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("ms")
    ax.set_title("latency: p50 (solid) and p99 (dotted)")
    if rows:
        ax.legend(fontsize=6, ncol=2)


def _rss(ax: Any, rows: list[dict[str, Any]], growth: dict[str, Any] | None) -> None:
    configs = [c for c in _configs(rows) if c != "direct"]
    peak = {c: max((r["rss_mb"] or 0) for r in rows if r["config"] == c) for c in configs}
    ax.barh(list(peak), list(peak.values()))
    ax.set_xlabel("RSS after its cells, MiB")
    ax.set_title("memory per configuration (10 grants, 10,000 grants)")
    if growth and growth.get("samples_mb"):
        inset = ax.inset_axes((0.6, 0.1, 0.37, 0.35))
        samples = growth["samples_mb"]
        step = growth["requests"] / len(samples)
        inset.plot([step * (i + 1) for i in range(len(samples))], samples, "-o", markersize=3)
        inset.set_title(f"{growth['config']} RSS over requests", fontsize=7)
        inset.tick_params(labelsize=6)


def _per_connection(ax: Any, memory: dict[str, Any] | None) -> None:
    ax.set_title("RSS per held connection (python -m bench.memory)")
    if not memory:
        ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center")
        ax.set_axis_off()
        return
    rows = memory["rows"]
    names = list(rows)
    held = [rows[n]["kib_per_connection"] for n in names]
    kept = [rows[n]["kib_kept_per_connection"] for n in names]
    ys = range(len(names))
    ax.barh([y + 0.2 for y in ys], held, 0.4, label="held")
    ax.barh([y - 0.2 for y in ys], kept, 0.4, label="kept after the close")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(names)
    ax.set_xlabel(f"KiB a connection ({memory['connections']} tunnels)")
    ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.figure", description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--memory", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    results = json.loads(args.results.read_text())
    memory = json.loads(args.memory.read_text()) if args.memory else None
    out = args.out or args.results.with_suffix(FIGURE_SUFFIX)
    if draw(results, out, memory) is None:
        sys.exit(1)
    print(out)


if __name__ == "__main__":
    main()
