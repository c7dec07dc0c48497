"""The destination guard's view of the proxy's own listeners, in every spelling."""

from __future__ import annotations

import ipaddress

import pytest

from addon.guard import DestinationGuard, reachable

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
