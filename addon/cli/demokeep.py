"""`credproxy demo --keep`: the demo's upstream and a proxy on an empty store, up until Ctrl-C,
with an env file that says where, for the walkthrough (docs/tutorial.md) to run on them."""

from __future__ import annotations

import contextlib
import shlex
import threading
import time
from collections.abc import Callable, Iterator

from addon.cli.demostage import DemoFailed, Stage, run_argv
from addon.cli.demoupstream import HOST, Seen
from store.ca import PUBLIC_CERT


class Keep(Stage):
    """Sends nothing: the operator's own terminal sends the walkthrough's requests."""

    def keep(self, listen: str) -> None:
        """The upstream and a proxy on an empty store, until Ctrl-C: what the walkthrough
        needs, and an env file for the operator's other terminal."""
        with self.upstream() as (upstream, upstream_ca):
            port = upstream.server_address[1]
            argv = run_argv(listen, upstream_ca, port)
            self.say(f"credproxy demo --keep, in {self.root} (removed when it stops)")
            self.say(f"upstream  https://{HOST} on 127.0.0.1:{port}, with a CA of its own")
            self.say(f"proxy     credproxy {' '.join(argv)}")
            self.cli("init", shown=False)
            with self._following() as follow, self.proxy(argv) as started:
                certs = self.root / "certs"
                settings = {
                    "CREDPROXY_DB": f"sqlite:///{self.root / 'credproxy.db'}",
                    "CREDPROXY_KEY_FILE": str(self.root / "credproxy.key"),
                    "CREDPROXY_CERTS": str(certs),
                    "CREDPROXY_ADVERTISE": started["listen"][0],
                    "DEMO_SECRET": self.secret,
                }
                env_file = self.root / "env"
                env_file.touch(0o600)
                env_file.write_text(
                    "".join(f"export {k}={shlex.quote(v)}\n" for k, v in settings.items())
                )
                self.say(f"store     {settings['CREDPROXY_DB']}, empty")
                self.say(f"In another terminal, `source {env_file}` sets:")
                for name, value in settings.items():
                    self.say(f"  {name}={value}")
                self.say("DEMO_SECRET is a fake secret, for credential add; it is shown masked.")
                self.say(
                    f"Clients must trust {certs / PUBLIC_CERT} ($CREDPROXY_CERTS/{PUBLIC_CERT}). "
                    "Ctrl-C stops it all."
                )
                self.say("A line for each request the upstream gets; JSON lines follow.")
                upstream.heard = self._heard
                follow()
                self._serve()

    def _heard(self, seen: Seen) -> None:
        authorization = f"Authorization: {seen.authorization}" if seen.authorization else "none"
        line = f"upstream got {seen.method} {seen.path} with {authorization}"
        # What a client sent, on the operator's terminal: no escape sequence gets through.
        self.say("".join(c if c.isprintable() else "?" for c in line))

    @contextlib.contextmanager
    def _following(self) -> Iterator[Callable[[], None]]:
        """Yields what starts copying the proxy's lines to our stdout, from its first; the
        lines it writes as it stops are copied on the way out."""
        offset = 0
        done = threading.Event()
        follower = None

        def read() -> None:
            nonlocal offset
            with self.audit_file.open("rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n")
            offset += end + 1
            for line in data[: end + 1].decode(errors="replace").splitlines():
                self.say(line)

        def copy() -> None:
            while not done.wait(0.05):
                read()

        def start() -> None:
            nonlocal follower
            follower = threading.Thread(target=copy, daemon=True)
            follower.start()

        try:
            yield start
        finally:
            done.set()
            if follower is not None:
                follower.join()
                read()

    def _serve(self) -> None:
        try:
            while self.process is not None and self.process.poll() is None:
                time.sleep(0.1)
        except KeyboardInterrupt:
            return  # the way to stop it: exit 0, as `credproxy run` does
        raise DemoFailed(f"credproxy run exited: {self._errors()}")
