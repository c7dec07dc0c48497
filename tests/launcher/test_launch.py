"""exec's own decisions, without processes: which signals it passes on, its exit status, --ttl."""

from __future__ import annotations

import argparse
import signal
from datetime import timedelta
from types import SimpleNamespace

import pytest

from addon.core.argtypes import ttl
from addon.launcher import launch, process


def test_only_signals_sent_to_exec_alone_are_passed_on(monkeypatch) -> None:
    infos = iter(
        [
            SimpleNamespace(si_signo=signal.SIGINT, si_code=process.SI_KERNEL),  # a terminal's ^C
            SimpleNamespace(si_signo=signal.SIGINT, si_code=0),  # kill -INT exec
            SimpleNamespace(si_signo=signal.SIGHUP, si_code=0),
            SimpleNamespace(si_signo=signal.SIGTERM, si_code=0),
            SimpleNamespace(si_signo=signal.SIGCHLD, si_code=1),
        ]
    )
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(process.signal, "sigwaitinfo", lambda _: next(infos))
    monkeypatch.setattr(process.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(process.os, "waitpid", lambda pid, _: (pid, 3 << 8))
    assert process.wait_forwarding(42) == 3
    assert sent == [(42, signal.SIGINT), (42, signal.SIGHUP), (42, signal.SIGTERM)]


@pytest.mark.parametrize(
    ("status", "code"),
    [
        pytest.param(0, 0, id="success"),
        pytest.param(7 << 8, 7, id="an exit status"),
        pytest.param(signal.SIGKILL, 128 + 9, id="a signal N is 128+N"),
    ],
)
def test_the_exit_status_is_the_commands(monkeypatch, status: int, code: int) -> None:
    monkeypatch.setattr(
        process.signal, "sigwaitinfo", lambda _: SimpleNamespace(si_signo=signal.SIGCHLD)
    )
    monkeypatch.setattr(process.os, "waitpid", lambda pid, _: (pid, status))
    assert process.wait_forwarding(42) == code


@pytest.mark.parametrize("text", ["0", "0s", "soon", "8", "-1h", "1.5h", "31d", "8 h", "١h"])
def test_a_bad_ttl_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        ttl(text)


def test_a_ttl_is_a_duration() -> None:
    assert ttl("30s") == timedelta(seconds=30)
    assert ttl("8h") == timedelta(hours=8)
    assert ttl("30d") == timedelta(days=30)


@pytest.mark.parametrize(
    "raw", [[], ["curl"], ["--"]], ids=["nothing", "no --", "nothing after --"]
)
def test_the_command_must_follow_a_double_dash(raw: list[str]) -> None:
    from store.errors import InvalidInput

    with pytest.raises(InvalidInput):
        launch._command(raw)
    assert launch._command(["--", "curl", "--", "-x"]) == ["curl", "--", "-x"]
