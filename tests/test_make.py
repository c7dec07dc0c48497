"""`make help`, and a bare `make` printing it: the targets a newcomer can run, one line each."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
HELP = """\
make help         this list (a bare `make` prints it too)
make venv         create .venv and install credproxy into it
make demo         a trial, offline: a local TLS upstream, a real proxy, five requests shown
make run          credproxy init, then credproxy run on 127.0.0.1:8080 (LISTEN=, ARGS= change it)
make lint         ruff and mypy
make docs-build   the strict documentation build
make docs         serve the documentation on http://127.0.0.1:8000
make test         lint, docs-build, every test but the slow: about 25 min on 2 cores (PYTEST_ARGS=)
make bench        the benchmark (ARGS= for its flags)
make clean        remove .venv and the caches
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize(
    "args", [pytest.param(["help"], id="make help"), pytest.param([], id="make")]
)
def test_make_help_lists_every_target_with_one_line(args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    result = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, HELP, "")
