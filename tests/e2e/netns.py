"""A sandbox network namespace joined to the host by a veth pair: compose's internal network."""

from __future__ import annotations

import ipaddress
import os
import random
import re
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = "credproxy-sbx-"
NETNS_DIR = Path("/var/run/netns")
# Addresses only ever live on the veth pairs this module creates.
POOL = ipaddress.IPv4Network("10.203.0.0/16")

_STALE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-[0-9a-f]+$")


class Unavailable(Exception):
    """Network namespaces cannot be created here; the message says why."""


def ip(*args: str) -> str:
    """Run `ip ARGS`; returns stdout. Raises CalledProcessError with ip's stderr."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    return done.stdout


@dataclass(frozen=True)
class Sandbox:
    """A namespace whose only link is `eth0`, the peer of `host_veth` on the host."""

    name: str
    host_veth: str
    host_ip: str
    sandbox_ip: str
    prefixlen: int

    def exec(
        self, args: list[str], env: dict[str, str], timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run `args` inside the namespace with exactly `env`."""
        return subprocess.run(
            ["ip", "netns", "exec", self.name, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def destroy(self) -> None:
        """Delete the veth pair and the namespace; safe on a half-built sandbox."""
        if _link_exists(self.host_veth):
            ip("link", "del", self.host_veth)
        if (NETNS_DIR / self.name).exists():
            ip("netns", "del", self.name)


def create() -> Sandbox:
    """A fresh sandbox on a /30 no host interface uses yet.

    Raises:
        Unavailable: namespaces cannot be listed or added (no iproute2, privilege or support).
    """
    token = secrets.token_hex(4)
    name = f"{PREFIX}{os.getpid()}-{token}"
    try:
        remove_stale()
        host, inside = _free_pair()
        ip("netns", "add", name)
    except FileNotFoundError as e:
        raise Unavailable("`ip` (iproute2) is not installed") from e
    except subprocess.CalledProcessError as e:
        raise Unavailable(f"`{' '.join(e.cmd)}` failed: {e.stderr.strip()}") from e
    box = Sandbox(name, f"cps{token}", str(host), str(inside), 30)
    try:
        _wire(box)
    except BaseException:
        box.destroy()
        raise
    return box


def _wire(box: Sandbox) -> None:
    cidr = f"/{box.prefixlen}"
    # The peer is born inside the namespace, so the pair never outlives it on the host.
    ip("link", "add", box.host_veth, "type", "veth", "peer", "name", "eth0", "netns", box.name)
    # No IPv6 link-local addresses: the sandbox's only address is its IPv4 one.
    ip("link", "set", box.host_veth, "addrgenmode", "none")
    ip("-n", box.name, "link", "set", "eth0", "addrgenmode", "none")
    ip("addr", "add", box.host_ip + cidr, "dev", box.host_veth)
    ip("link", "set", box.host_veth, "up")
    ip("-n", box.name, "addr", "add", box.sandbox_ip + cidr, "dev", "eth0")
    ip("-n", box.name, "link", "set", "eth0", "up")
    ip("-n", box.name, "link", "set", "lo", "up")


def _free_pair() -> tuple[ipaddress.IPv4Address, ipaddress.IPv4Address]:
    """Host and sandbox addresses of a random /30 in POOL that no interface overlaps."""
    used = [
        ipaddress.ip_interface(word).network
        for line in ip("-o", "-4", "addr", "show").splitlines()
        for word in line.split()[3:4]
    ]
    subnets = list(POOL.subnets(new_prefix=30))
    for _ in range(100):
        net = random.choice(subnets)
        if not any(net.overlaps(other) for other in used):
            host, inside = net.hosts()
            return host, inside
    raise AssertionError(f"no free /30 in {POOL}")


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def remove_stale() -> list[str]:
    """Delete namespaces left by runs whose process is gone; returns their names."""
    removed = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _STALE.match(name)
        if match and not Path("/proc", match.group(1)).exists():
            ip("netns", "del", name)
            removed.append(name)
    return removed
