"""Memory at start as a user sees it: `python -m bench.startmem`.

A fresh `credproxy init` in an empty folder, then `credproxy run` and `mitmdump` started side
by side, as their console scripts, unpinned, output to a file; each one's resident memory
(VmRSS, and /proc/PID/smaps_rollup's anonymous and file-backed parts) `--settle` seconds
after it listens, then again after one HTTPS request through it (curl, CONNECT, TLS both
ways) to a local upstream. credproxy's request is granted (one principal, one grant, no
credential); mitmdump's is the same request. `--rounds` repeats it all; the figures are each
round's, and the difference credproxy - mitmdump per round.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trustme

from bench.processes import BenchError, start, start_upstream

BIN = Path(sys.executable).parent
ANNOUNCE = re.compile(rb"listening at (?:http://)?[^\s]*?:(\d+)")


def memory(pid: int) -> dict[str, float]:
    """VmRSS and smaps_rollup's Anonymous and file-backed resident parts, in MiB."""
    rollup: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        rollup[name] = int(value.split()[0])
    return {
        "rss": round(rollup["Rss"] / 1024, 1),
        "anon": round(rollup["Anonymous"] / 1024, 1),
        "file": round((rollup["Rss"] - rollup["Anonymous"]) / 1024, 1),
    }


def _credproxy(folder: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [str(BIN / "credproxy"), "--json", *args],
        cwd=folder,
        env=_env(folder),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise BenchError(f"credproxy {args[0]} failed: {done.stderr.strip()}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1] or "{}")
    return found


def _env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CREDPROXY_")}
    return env | {
        "CREDPROXY_DB": f"sqlite:///{folder / 'credproxy.db'}",
        "CREDPROXY_KEY_FILE": str(folder / "credproxy.key"),
        "CREDPROXY_CERTS": str(folder / "certs"),
    }


def _mitmdump(folder: Path, upstream_ca: Path) -> subprocess.Popen[bytes]:
    out = (folder / "mitmdump.out").open("wb")
    args = [str(BIN / "mitmdump"), "--listen-host", "127.0.0.1", "--listen-port", "0"]
    args += ["--set", f"confdir={folder / 'mitmproxy'}"]
    args += ["--set", f"ssl_verify_upstream_trusted_ca={upstream_ca}"]
    return subprocess.Popen(args, cwd=folder, stdout=out, stderr=subprocess.STDOUT)


def _port(output: Path, process: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = ANNOUNCE.search(output.read_bytes())
        if found:
            return int(found.group(1))
        if process.poll() is not None:
            raise BenchError(f"mitmdump exited: {output.read_text()[-500:]}")
        time.sleep(0.02)
    raise BenchError("mitmdump did not listen within 60 s")


def _curl(proxy: str, user: str | None, cacert: Path, url: str) -> None:
    config = f'proxy = "{proxy}"\n' + (f'proxy-user = "{user}"\n' if user else "")
    args = ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-K", "-"]
    args += ["--cacert", str(cacert), "--max-time", "30", url]
    done = subprocess.run(args, input=config, capture_output=True, text=True, check=False)
    if done.stdout.strip() != "200":
        raise BenchError(f"a request through {proxy} answered {done.stdout} {done.stderr}")


def one_round(settle: float) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="credproxy-startmem-"))
    try:
        ca = trustme.CA()
        upstream_ca = folder / "upstream-ca.pem"
        ca.cert_pem.write_to_path(str(upstream_ca))
        leaf = ca.issue_cert("bench.test", "127.0.0.1")
        cert, key = folder / "upstream.pem", folder / "upstream.key"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        upstream = start_upstream(folder, cert, key)
        _credproxy(folder, "init")
        token = _credproxy(folder, "principal", "add", "agent")["token"]
        _credproxy(folder, "grant", "add", "agent", "--host", "bench.test", "--method", "GET")
        args = [str(BIN / "credproxy"), "run", "--listen", "127.0.0.1:0"]
        args += ["--upstream-ca", str(upstream_ca)]
        args += ["--resolve", f"bench.test:443=127.0.0.1:{upstream.port}"]
        proxy = start(
            "credproxy", args, _env(folder), folder / "credproxy.out", '"proxy.started"', pin=False
        )
        bare = _mitmdump(folder, upstream_ca)
        try:
            bare_port = _port(folder / "mitmdump.out", bare)
            time.sleep(settle)
            result: dict[str, Any] = {
                "start": {"credproxy": memory(proxy.process.pid), "mitmdump": memory(bare.pid)}
            }
            _curl(
                f"http://127.0.0.1:{proxy.port}",
                f"agent:{token}",
                folder / "certs" / "credproxy-ca.pem",
                "https://bench.test/",
            )
            _curl(
                f"http://127.0.0.1:{bare_port}",
                None,
                folder / "mitmproxy" / "mitmproxy-ca-cert.pem",
                f"https://127.0.0.1:{upstream.port}/",
            )
            time.sleep(settle)
            result["first_request"] = {
                "credproxy": memory(proxy.process.pid),
                "mitmdump": memory(bare.pid),
            }
        finally:
            proxy.stop()
            bare.terminate()
            bare.wait(10)
            upstream.stop()
        for when in ("start", "first_request"):
            row = result[when]
            row["difference"] = round(row["credproxy"]["rss"] - row["mitmdump"]["rss"], 1)
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startmem", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle", type=float, default=3.0, help="seconds before each reading")
    p.add_argument("--out", type=Path, help="write the rounds as JSON here too")
    args = p.parse_args(argv)
    rounds = [one_round(args.settle) for _ in range(args.rounds)]
    for i, r in enumerate(rounds):
        cells = [
            f"{when}: credproxy {r[when]['credproxy']['rss']} MiB, mitmdump "
            f"{r[when]['mitmdump']['rss']} MiB, +{r[when]['difference']}"
            for when in ("start", "first_request")
        ]
        print(f"[startmem] round {i + 1}: " + "; ".join(cells), file=sys.stderr)
    text = json.dumps({"settle_s": args.settle, "rounds": rounds}, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
