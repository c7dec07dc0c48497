"""The destination guard's view of the proxy's own listeners, in every spelling."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from addon.core.guard import DestinationGuard, is_public, reachable

OPEN = ["127.0.0.0/8", "::ffff:0:0/96", "::/96", "::ffff:0:0:0/96", "0.0.0.0/8", "::/128"]


@pytest.mark.parametrize(
    ("listener", "address"),
    [
        pytest.param("127.0.0.1", "::ffff:127.0.0.1", id="IPv4-mapped spelling of the listener"),
        pytest.param("127.0.0.1", "::ffff:7f00:1", id="IPv4-mapped in hex"),
        pytest.param("127.0.0.1", "::127.0.0.1", id="IPv4-compatible spelling"),
        pytest.param("127.0.0.1", "::ffff:0:7f00:1", id="IPv4-translated spelling"),
        pytest.param("127.0.0.1", "0.0.0.0", id="0.0.0.0 connects to the local host"),
        pytest.param("::1", "::", id=":: connects to the local host"),
        pytest.param("0.0.0.0", "::ffff:127.0.0.1", id="a wildcard listener, mapped loopback"),
        pytest.param("::ffff:127.0.0.1", "127.0.0.1", id="a listener given in mapped form"),
    ],
)
def test_no_spelling_of_a_listening_address_is_dialled(listener: str, address: str) -> None:
    guard = DestinationGuard.parse(OPEN).listening_on([(listener, 9090)])
    assert guard.vet([address], 9090) is None
    assert guard.vet([address], 9091) is not None, "another port in the opened ranges stays open"


def test_reachable_lists_the_ipv4_address_an_ipv6_form_carries() -> None:
    v4 = ipaddress.ip_address("127.0.0.1")
    assert v4 in reachable(ipaddress.ip_address("::ffff:7f00:1"))
    assert reachable(v4) == [v4]


def ip(text: str) -> Any:
    return ipaddress.ip_address(text)


@pytest.mark.parametrize(
    "address",
    [
        pytest.param("224.0.0.251", id="IPv4 multicast"),
        pytest.param("ff0e::1", id="IPv6 global-scope multicast"),
        pytest.param("64:ff9b::7f00:1", id="NAT64 of loopback"),
        pytest.param("64:ff9b::a00:1", id="NAT64 of 10/8"),
        pytest.param("2002:7f00:1::1", id="6to4 of loopback"),
        pytest.param("::127.0.0.1", id="IPv4-compatible loopback"),
        pytest.param("::8.8.8.8", id="IPv4-compatible, even of a public address"),
        pytest.param("::ffff:0:127.0.0.1", id="IPv4-translated loopback"),
        pytest.param("fec0::1", id="site-local"),
    ],
)
def test_non_public_addresses_python_calls_global_are_refused(address: str) -> None:
    assert not is_public(ip(address))
    assert DestinationGuard().vet([address], 443) is None


def test_public_addresses_pass_the_guard() -> None:
    assert DestinationGuard().vet(["93.184.216.34", "2606:2800:220:1::1"], 443) == ip(
        "93.184.216.34"
    )


@pytest.mark.parametrize(
    "answers",
    [
        pytest.param(["93.184.216.34", "127.0.0.1"], id="a private answer after a public one"),
        pytest.param(["93.184.216.34", "fd00::1"], id="a ULA answer after a public one"),
        pytest.param(["93.184.216.34", "not-an-address"], id="an unparsable answer"),
    ],
)
def test_every_dns_answer_must_pass_the_guard(answers: list[str]) -> None:
    assert DestinationGuard().vet(answers, 443) is None


@pytest.mark.parametrize(
    ("listener", "address"),
    [
        pytest.param(("127.0.0.1", 8080), "127.0.0.1", id="a listener on one address"),
        pytest.param(("0.0.0.0", 8080), "127.0.0.1", id="a listener on every address"),
        pytest.param(("::", 8080), "::1", id="a listener on every IPv6 address"),
    ],
)
def test_the_proxys_own_listeners_are_refused_even_in_an_opened_range(
    listener: tuple[str, int], address: str
) -> None:
    guard = DestinationGuard.parse(["127.0.0.0/8", "::1/128"]).listening_on([listener])
    assert not guard.permits(ip(address), 8080)
    assert guard.vet([address], 8080) is None
    assert guard.permits(ip(address), 8081), "another port in the opened range stays open"
