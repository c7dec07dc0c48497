"""Running `credproxy` (`addon.cli:main`) as a subprocess in a directory of its own: the CLI tests'
helpers, shared by tests/cli/test_cli.py and tests/store/tables/test_access_requests.py."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from store.crypto import load_master_key
from store.repository import Store

# The installed console script may predate the checkout; `-m` runs the checkout's own main().
COMMAND = [sys.executable, "-m", "addon.cli.cli"]
ADVERTISE = "10.0.0.5:3128"


class Call(NamedTuple):
    args: tuple[str, ...]
    stdin: bytes = b""
    env: dict[str, str] = {}


@dataclass
class Cli:
    """Runs credproxy in `root` with CREDPROXY_* pointing there; remembers every output."""

    root: Path
    outputs: list[bytes] = field(default_factory=list)

    @property
    def db_file(self) -> Path:
        return self.root / "credproxy.db"

    @property
    def key_file(self) -> Path:
        return self.root / "credproxy.key"

    @property
    def flags(self) -> tuple[str, ...]:
        return (
            "--db",
            f"sqlite:///{self.db_file}",
            "--key-file",
            str(self.key_file),
            "--certs",
            str(self.root / "certs"),
        )

    def run(self, call: Call) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CREDPROXY_")}
        env |= {
            "CREDPROXY_DB": f"sqlite:///{self.db_file}",
            "CREDPROXY_KEY_FILE": str(self.key_file),
            "CREDPROXY_CERTS": str(self.root / "certs"),
            "CREDPROXY_ADVERTISE": ADVERTISE,
        } | call.env
        result = subprocess.run(
            [*COMMAND, *call.args],
            input=call.stdin,
            capture_output=True,
            cwd=self.root,
            env=env,
            timeout=60,
        )
        self.outputs += [result.stdout, result.stderr]
        return subprocess.CompletedProcess(
            result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
        )

    def ok(self, *calls: Call) -> list[str]:
        """Run independent commands concurrently; each must succeed silently on stderr."""
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            results = list(pool.map(self.run, calls))
        for result in results:
            assert (result.returncode, result.stderr) == (0, ""), (result.args, result.stderr)
        return [result.stdout for result in results]

    def store(self) -> Store:
        return Store(f"sqlite:///{self.db_file}", load_master_key(self.key_file, {}))
