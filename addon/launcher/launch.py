"""`credproxy exec` and `credproxy env`: a session token and a contained environment.

exec creates a session token that expires at --ttl, waits until the proxy accepts it, runs
CMD in the caller's environment minus anything secret-shaped plus the proxy and trust
variables, forwards signals, passes CMD's exit status on and revokes the token on the way out.
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from addon.core.argtypes import ttl
from addon.launcher import envscrub, launchenv, runas, sandbox
from addon.launcher.process import (
    FORWARDED,
    CommandFailed,
    held_signals,
    supervise,
    undumpable,
)
from addon.launcher.truststore import java_truststore
from store.ca import PUBLIC_CERT
from store.db.models import utcnow
from store.errors import CredproxyError, InvalidInput
from store.repository import Store
from store.rules.grammar import BadAuthority, parse_authority
from store.settings import Settings

# How long exec waits for the proxy to load a new session token (it polls every 0.5 s).
PROBE_TIMEOUT = 15.0
PROBE_PATH = "/access-requests/0"  # answered by the proxy itself, after authentication


class ProxyUnavailable(CredproxyError):
    pass


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "exec", parents=[common], help="run a command behind the proxy with a session token"
    )
    _session_flags(p)
    p.add_argument(
        "--keep-env",
        action="append",
        default=[],
        metavar="NAME",
        help="keep this variable even if it looks like a secret (repeatable)",
    )
    p.add_argument(
        "--isolate",
        action="store_true",
        help="run CMD in a bubblewrap sandbox: no network but the proxy, no token, no "
        "credproxy state, no other process in sight",
    )
    p.add_argument(
        "--ro",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="--isolate: also show PATH read-only (under /tmp or /run, say; repeatable)",
    )
    p.add_argument(
        "--rw",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="--isolate: make PATH writable too (repeatable)",
    )
    p.add_argument(
        "--hide",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="--isolate: hide PATH as well (repeatable)",
    )
    p.add_argument("--user", metavar="NAME", help="run CMD as this user (exec as root)")
    p.add_argument(
        "--unsafe-state-access",
        action="store_true",
        help="without --isolate, run CMD even if its user can read the master key or the "
        "CA's key, or change the store",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")
    p.set_defaults(func=cmd_exec)
    p = sub.add_parser("env", parents=[common], help="print a session's variables")
    _session_flags(p)
    p.add_argument(
        "--format", choices=launchenv.FORMATS, default="sh", help="sh (default), dotenv or json"
    )
    p.set_defaults(func=cmd_env)


def _session_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--principal", required=True, help="whose session")
    p.add_argument(
        "--ttl", type=ttl, default=timedelta(hours=8), help="session lifetime (default 8h)"
    )
    p.add_argument("--proxy", metavar="HOST:PORT", help="the proxy [CREDPROXY_ADVERTISE]")


# -- the session ---------------------------------------------------------------------


def _address(text: str) -> tuple[str, int]:
    try:
        host, port = parse_authority(text)
    except BadAuthority as e:
        raise InvalidInput(f"invalid --proxy {text!r}: use HOST:PORT") from e
    if port is None:
        raise InvalidInput(f"invalid --proxy {text!r}: use HOST:PORT")
    return host, port


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _ca_file(settings: Settings) -> Path:
    ca = settings.certs / PUBLIC_CERT
    if not ca.is_file():
        raise InvalidInput(f"no CA at {ca}: run credproxy init")
    return ca


def placeholders(store: Store, principal: str) -> tuple[str, ...]:
    """The placeholder variables the principal's granted credentials declare."""
    granted = {g.credential for g in store.list_grants(principal) if g.state == "active"}
    return launchenv.placeholder_names(
        c.options["placeholder_env"]
        for c in store.list_credentials()
        if c.name in granted and c.options.get("placeholder_env")
    )


def probe(host: str, port: int, principal: str, token: str, counter: int) -> None:
    """Return once the proxy accepts the token; ProxyUnavailable if it is down or never does.

    Until the proxy has loaded the store's change `counter` (the token's), it answers 503
    without reading the credentials: no denial is written for a token it has not seen yet.
    """
    auth = base64.b64encode(f"{principal}:{token}".encode()).decode()
    request = (
        f"GET http://credproxy.internal{PROBE_PATH}?loaded={counter} HTTP/1.1\r\n"
        "Host: credproxy.internal\r\n"
        f"Proxy-Authorization: Basic {auth}\r\nConnection: close\r\n\r\n"
    ).encode()
    deadline = time.monotonic() + PROBE_TIMEOUT
    while True:
        try:
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.sendall(request)
                head = b""
                while b"\r\n" not in head and len(head) < 64:
                    chunk = sock.recv(64)
                    if not chunk:
                        break
                    head += chunk
        except OSError as e:
            raise ProxyUnavailable(
                f"the proxy at {host}:{port} is unreachable ({e.strerror or type(e).__name__})"
            ) from e
        status = head.split(b" ", 2)[1:2]
        if not head.startswith(b"HTTP/1.") or not status:
            raise ProxyUnavailable(f"{host}:{port} does not answer as credproxy")
        if status not in ([b"407"], [b"503"]):
            return
        if time.monotonic() > deadline:
            raise ProxyUnavailable(
                f"the proxy at {host}:{port} did not accept the session token within "
                f"{PROBE_TIMEOUT:g} s: does it use this store?"
            )
        time.sleep(0.1)


def _note(command: Sequence[str]) -> str:
    name = os.path.basename(command[0]) if command else ""
    return "".join(c for c in f"{'exec' if command else 'env'}: {name}" if c.isprintable())[:80]


@contextmanager
def session(
    store: Store, args: argparse.Namespace, settings: Settings, command: Sequence[str]
) -> Iterator[launchenv.Session]:
    """A session token for the principal, accepted by the proxy; revoked at the end for exec."""
    host, port = _address(args.proxy or settings.advertise)
    ca = _ca_file(settings)
    names = placeholders(store, args.principal)
    token_id, token = store.add_token(args.principal, utcnow() + args.ttl, _note(command))
    try:
        probe(host, port, args.principal, token, store.change_counter())
        yield launchenv.Session(
            proxy_url=f"http://{args.principal}:{token}@{_bracketed(host)}:{port}",
            proxy_host=host,
            proxy_port=port,
            ca_file=ca.resolve(),
            truststore=java_truststore(
                ca.resolve(), [ca.parent.resolve(), Path(tempfile.gettempdir())]
            ),
            placeholders=names,
        )
    except BaseException:
        _revoke(store, token_id)
        raise
    else:
        if command:
            _revoke(store, token_id)


def _revoke(store: Store, token_id: int) -> None:
    try:
        store.revoke_token(token_id)
    except CredproxyError as e:
        print(
            f"credproxy: warning: could not revoke session token {token_id} ({e}); "
            "it ends at its expiry",
            file=sys.stderr,
        )


# -- exec ----------------------------------------------------------------------------


def _command(raw: Sequence[str]) -> list[str]:
    # argparse (3.11) keeps the `--` in a REMAINDER: it is how exec knows one was given.
    if not raw or raw[0] != "--":
        raise InvalidInput("give the command after --: credproxy exec [...] -- CMD [ARG...]")
    if len(raw) == 1:
        raise InvalidInput("no command after --")
    return list(raw[1:])


def cmd_exec(args: argparse.Namespace, settings: Settings) -> int:
    try:
        return _exec(args, settings)
    except CommandFailed as e:
        print(f"credproxy: error: {e}", file=sys.stderr)
        return e.status


def _exec(args: argparse.Namespace, settings: Settings) -> int:
    command = _command(args.command)
    own = sorted(n for n in args.keep_env if n.upper().startswith("CREDPROXY_"))
    if own:
        raise InvalidInput(f"--keep-env {own[0]}: credproxy's own settings never reach CMD")
    if not args.isolate and (args.ro or args.rw or args.hide):
        raise InvalidInput("--ro, --rw and --hide shape the sandbox of --isolate")
    user = runas.named(args.user) if args.user else None
    view = None
    python = sys.executable
    if args.isolate:
        if user is None and os.geteuid() == 0:
            # Root inside a user namespace is still root to the kernel's permission checks:
            # it could change kernel settings through /proc/sys and read root's files.
            raise InvalidInput(
                "exec runs as root: give --isolate a --user NAME to run the sandbox as"
            )
        sandbox.check()
        python = _python_for(user) if user is not None else sys.executable
        view = sandbox.view(
            settings,
            Path.cwd(),
            read_write=args.rw,
            read_only=args.ro,
            hide=args.hide,
            exposed=_helper_paths() if user is None else [],
        )
        stack_fds = view.fds()
    elif not args.unsafe_state_access:
        exposed = runas.exposed_state(settings, user or runas.current())
        if exposed is not None:
            raise InvalidInput(
                f"the command would run as {(user or runas.current()).name}, who can {exposed}:"
                " use --isolate, --user NAME (exec as root) or a container, or pass "
                "--unsafe-state-access to run it anyway"
            )
    prefix = runas.switch(user) if user is not None else []
    # Never outside the sandbox: the node on PATH may be one the sandboxed CMD could write.
    notice = _node_notice(command, prefix) if view is None else None
    # CMD runs as this user: it must read neither the token nor the scrubbed variables from
    # this process (/proc/PID/environ, its memory).
    undumpable()
    with held_signals() as previous, ExitStack() as stack:
        if view is not None:
            stack.callback(sandbox.release_fds, stack_fds)
        store = settings.store()
        with session(store, args, settings, command) as sess:
            base, scrubbed = envscrub.scrub(os.environ, set(args.keep_env))
            # What exec sets itself is replaced, not withheld: only the rest is named.
            removed = sorted(
                [n for n in scrubbed if not launchenv.set_by_session(n)]
                + [n for n in launchenv.SCRUBBED_TRUST if n in base]
            )
            if removed:
                # Names only, each printable: a name may not forge lines or escape sequences.
                shown = " ".join(name.encode("unicode_escape").decode("ascii") for name in removed)
                print(f"credproxy: not passed to the command: {shown}", file=sys.stderr)
            pending = signal.sigpending() & set(FORWARDED)
            if pending:  # interrupted before CMD started: it never does
                return 128 + int(min(pending))
            if user is not None:
                base.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
                sess = stack.enter_context(_readable_ca(sess))
            if view is not None:
                # Only for --isolate: bubblewrap's view is built by this module alone.
                from addon.launcher import isolate

                public = (sess.ca_file, *([sess.truststore] if sess.truststore else []))
                view = sandbox.shown(view, public)
                return isolate.run(command, base, sess, previous, view, python, prefix)
            if notice is not None:
                print(notice, file=sys.stderr)
            return supervise([*prefix, *command], launchenv.contained(base, sess), previous)


def _node_notice(command: Sequence[str], prefix: Sequence[str]) -> str | None:
    """The notice for a Node CMD whose Node ignores the proxy variables; None otherwise, or
    when its version cannot be had. Asked of the Node CMD would run, as CMD's user."""
    if not launchenv.runs_node(command):
        return None
    own = os.path.basename(command[0]) in ("node", "nodejs")
    path = os.environ.get("PATH", os.defpath)
    node = shutil.which(command[0] if own else "node", path=path)
    if node is None:
        return None
    try:
        answer = subprocess.run(  # noqa: S603 - the operator's CMD, or the node on its PATH
            [*prefix, node, "--version"],
            env={"PATH": path},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return launchenv.node_notice(answer.stdout.decode("ascii", "replace"))


def _python_for(user: runas.User) -> str:
    """A Python `user` can run, for the sandbox's helper (exec's own may be in a folder
    closed to it)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if Path(candidate).exists() and runas.may_run(Path(candidate), user):
            return candidate
    raise InvalidInput(f"--isolate --user {user.name}: no python3 that {user.name} can run")


def _helper_paths() -> list[Path]:
    """What the sandbox's helper (`python -m addon.launcher.isolate`) needs to start."""
    import addon

    here = Path(addon.__file__).resolve().parent.parent
    return [Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent, here]


@contextmanager
def _readable_ca(sess: launchenv.Session) -> Iterator[launchenv.Session]:
    """The session with a copy of the CA (and its truststore) that any user can read."""
    with tempfile.TemporaryDirectory(prefix="credproxy-ca-") as tmp:
        folder = Path(tmp)
        folder.chmod(0o755)
        ca = folder / sess.ca_file.name
        ca.write_bytes(sess.ca_file.read_bytes())
        ca.chmod(0o644)
        store = java_truststore(ca, [folder])
        if store is not None:
            store.chmod(0o644)
        yield replace(sess, ca_file=ca, truststore=store)


def cmd_env(args: argparse.Namespace, settings: Settings) -> int:
    store = settings.store()
    with session(store, args, settings, ()) as sess:
        env = launchenv.variables(sess)
        env["JAVA_TOOL_OPTIONS"] = launchenv.java_options(sess, None)
        sys.stdout.write(launchenv.render(env, "json" if settings.json else args.format))
    return 0
