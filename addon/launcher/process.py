"""CMD as a child of exec: started with the caller's signal mask, signals passed on, its exit
status returned; exec's own memory closed to it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from store.errors import CredproxyError

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WATCHED = {*FORWARDED, signal.SIGCHLD}
SI_KERNEL = 0x80  # siginfo's si_code for a signal the kernel sent (a terminal's ^C)


PR_SET_DUMPABLE = 4


def undumpable() -> None:
    """Make this process undumpable; raises CommandFailed if the kernel refuses."""
    # Loaded where it is used: ctypes costs exec's start-up, and only Linux needs it.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise CommandFailed(2, "cannot protect exec's memory from the command (prctl)")


@contextmanager
def held_signals() -> Iterator[set[int | signal.Signals]]:
    """Block the signals exec waits for; yields the mask CMD should start with."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    try:
        yield previous
    finally:
        # What arrives after CMD has ended was meant for CMD: drop it rather than die of it.
        handlers = {s: signal.signal(s, signal.SIG_IGN) for s in FORWARDED}
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        for s, handler in handlers.items():
            signal.signal(s, handler)


def spawn(command: Sequence[str], env: dict[str, str], mask: set[int | signal.Signals]) -> int:
    """Start CMD with the caller's signal mask and dispositions Python changed reset."""
    try:
        return os.posix_spawnp(
            command[0],
            list(command),
            env,
            setsigmask=mask,
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )
    except FileNotFoundError as e:
        raise CommandFailed(127, f"cannot run {command[0]!r}: command not found") from e
    except OSError as e:
        raise CommandFailed(126, f"cannot run {command[0]!r}: {e.strerror}") from e


class CommandFailed(CredproxyError):
    """CMD could not be started; exits with the shell's status for it (127 or 126)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def supervise(command: Sequence[str], env: dict[str, str], mask: set[int | signal.Signals]) -> int:
    """Run CMD to its end, forwarding signals; its exit status, 128+N for a signal N."""
    pid = spawn(command, env, mask)
    return wait_forwarding(pid)


def wait_forwarding(pid: int, target: int | None = None, every_signal: bool = False) -> int:
    """Wait for `pid`, passing signals sent to exec on to `target` (else `pid`); a terminal's
    too with `every_signal`."""
    while True:
        info = signal.sigwaitinfo(WATCHED)
        if info.si_signo == signal.SIGCHLD:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                return code if code >= 0 else 128 - code
        elif every_signal or info.si_code != SI_KERNEL:
            # A terminal's ^C reaches CMD itself (the same process group): only what was
            # sent to exec alone is passed on.
            try:
                os.kill(pid if target is None else target, info.si_signo)
            except ProcessLookupError:
                pass
