"""`python -m bench.suggest`: `credproxy policy suggest` over a large audit (issue 41).

Writes LINES audit lines (half uses of one wide grant, half denials, over a few thousand
distinct paths, one line in 100 malformed), then times the command as an operator runs it (a
new process, the file as its argument) and reports lines per second and the child's peak
resident memory. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.processes import CREDPROXY, ROOT, credproxy_env, credproxy_init
from store.crypto import Secret, load_master_key
from store.repository import Store


def _audit(path: Path, lines: int, paths: int, compress: bool) -> None:
    opener = gzip.open if compress else open
    with opener(path, "wt") as f:  # type: ignore[operator]
        for i in range(lines):
            n = i % paths
            line = {
                "event": "request",
                "ts": f"2026-12-07T10:{(i // 60) % 60:02d}:{i % 60:02d}.{i % 999999:06d}Z",
                "request_id": f"r{i}",
                "principal": "agent",
                "client": "10.0.0.5:40000",
                "method": "GET",
                "host": "api.github.com",
                "port": 443,
                "status": 200,
                "duration_ms": 12,
            }
            if i % 100 == 99:
                f.write('{"event": "request", "path": "/\\u001b[31m torn\n')
                continue
            if i % 2:
                line |= {
                    "path": f"/repos/acme/app/issues/{n}",
                    "decision": "allow",
                    "grant_id": 1,
                    "credential": "github",
                }
            else:
                line |= {
                    "path": f"/orgs/acme/teams/{n}/members",
                    "decision": "deny",
                    "reason": "path-not-allowed",
                    "grant_id": None,
                    "status": 403,
                }
            f.write(json.dumps(line) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.suggest", description=__doc__)
    parser.add_argument("--lines", type=int, default=1_000_000, help="audit lines (1000000)")
    parser.add_argument("--paths", type=int, default=5000, help="distinct paths of each kind")
    parser.add_argument("--gzip", action="store_true", help="a gzip audit file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-suggest-") as tmp:
        work = Path(tmp)
        env = credproxy_env(work, work / "credproxy.db")
        credproxy_init(env)
        store = Store(env["CREDPROXY_DB"], load_master_key(work / "credproxy.key", {}))
        store.add_principal("agent")
        store.add_credential("github", "bearer", ["api.github.com"], Secret(b"bench"))
        store.add_grant("agent", ["GET", "POST"], credential="github", paths=["/repos/"])
        store.close()
        audit = work / ("audit.jsonl.gz" if args.gzip else "audit.jsonl")
        started = time.monotonic()
        _audit(audit, args.lines, args.paths, args.gzip)
        print(f"wrote {args.lines} lines in {time.monotonic() - started:.1f} s", file=sys.stderr)
        started = time.monotonic()
        done = subprocess.run(
            [*CREDPROXY, "policy", "suggest", str(audit), "--json"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        seconds = time.monotonic() - started
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        out = json.loads(done.stdout)
        child = resource.getrusage(resource.RUSAGE_CHILDREN)  # init's too: a second or so
        peak_mb = child.ru_maxrss / 1024
        print(
            json.dumps(
                {
                    "lines": args.lines,
                    "gzip": args.gzip,
                    "seconds": round(seconds, 2),
                    "lines_per_second": round(args.lines / seconds),
                    "cpu_seconds": round(child.ru_utime + child.ru_stime, 2),
                    "peak_rss_mb": round(peak_mb, 1),
                    "read": out["read"],
                    "add": [a["paths"] for a in out["add"]],
                    "narrow": [n["paths"]["after"] for n in out["narrow"]],
                    "skipped": out["skipped"],
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
