"""`python -m bench.cli`: how long one CLI call takes, and the proxy's memory at start.

Wall time of `credproxy grant add`, `grant list --json` and `principal add` (each run as a
new process, as an operator or a script runs it) on a store of 1,000 grants; what each one
imports (`python -X importtime`); and the resident memory of `credproxy run` and of bare
mitmproxy once each listens (issue 24 item 3).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trustme

from bench.population import Population, populate
from bench.processes import (
    CREDPROXY,
    ROOT,
    credproxy_env,
    credproxy_init,
    rss_mb,
    start_bare_mitmproxy,
    start_credproxy,
)
from store.ca import ensure_ca
from store.crypto import load_master_key
from store.repository import Store

# importlib.metadata is not among them: SQLAlchemy imports it.
HEAVY = ("mitmproxy", "alembic", "botocore", "cryptography.x509", "sqlalchemy")


CPU: list[float] = []  # the child's user + system CPU seconds of each _time run


def _time(args: list[str], env: dict[str, str], runs: int) -> list[float]:
    """Wall seconds of each run; its CPU seconds go to CPU (less moved by a busy machine)."""
    samples = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        subprocess.run(args, env=env, cwd=ROOT, capture_output=True, check=True)
        samples.append(time.perf_counter() - began)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        CPU.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return samples


def _imports(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """What the command imports: the heavy packages it loads, and the total import time."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args[1:]],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    modules: dict[str, int] = {}
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3:
            own = parts[0].split(":", 1)[1].strip()
            if own.isdigit():
                modules[parts[2].strip()] = int(own)
    heavy = sorted(h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in modules))
    return {
        "modules": len(modules),
        "import_ms": round(sum(modules.values()) / 1000),
        "heavy": heavy,
    }


def measure(runs: int, workdir: Path) -> dict[str, Any]:
    env = credproxy_env(workdir, workdir / "store.db")
    credproxy_init(env)
    key = load_master_key(workdir / "credproxy.key", {})
    store = Store(env["CREDPROXY_DB"], key)
    populate(store, key, Population(100, 100, 10))
    store.close()
    commands = {
        "grant add": [
            "grant",
            "add",
            "agent-0000",
            "--host",
            "pypi.org",
            "--method",
            "GET",
        ],
        "grant list --json": ["grant", "list", "--json"],
        "principal add": ["principal", "add"],
    }
    result: dict[str, Any] = {
        "python_bare_s": round(min(_time([sys.executable, "-c", "pass"], env, runs)), 3)
    }
    for label, command in commands.items():
        samples = []
        CPU.clear()
        for i in range(runs):
            args = [*CREDPROXY, *command]
            if label == "principal add":
                args.append(f"new-{i}")
            samples.extend(_time(args, env, 1))
        args = [*CREDPROXY, *command] + (["probe"] if label == "principal add" else [])
        result[label] = {
            "median_s": round(statistics.median(samples), 3),
            "min_s": round(min(samples), 3),
            "cpu_median_s": round(statistics.median(CPU), 3),
            **_imports(args, env),
        }
    # Memory at start: bare mitmproxy and credproxy run, each once it listens.
    ca = trustme.CA()
    upstream_ca = workdir / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(upstream_ca))
    ensure_ca(workdir / "certs")
    bare = start_bare_mitmproxy(workdir, workdir / "certs", upstream_ca)
    proxy = start_credproxy("credproxy", workdir, env, upstream_ca, "bench.test=127.0.0.1:9")
    try:
        time.sleep(1.0)
        result["rss_at_start_mib"] = {
            "mitmproxy": round(rss_mb(bare.process.pid), 1),
            "credproxy": round(rss_mb(proxy.process.pid), 1),
        }
    finally:
        proxy.stop()
        bare.stop()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__)
    p.add_argument("--runs", type=int, default=10, help="runs of each command")
    p.add_argument("--out", type=Path, help="write the figures as JSON here too")
    settings = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="credproxy-cli-") as tmp:
        result = measure(settings.runs, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if settings.out is not None:
        settings.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    os.environ.pop("CREDPROXY_MASTER_KEY", None)
    sys.exit(main())
