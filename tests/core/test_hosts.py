import re

import pytest

from addon.core.hosts import ResolveMap


def test_a_name_resolves_to_its_entry_and_keeps_the_port_unless_one_is_given() -> None:
    resolve = ResolveMap.parse(["api.test=127.0.0.1", "API.test:8443=[::1]:9443"])
    assert resolve.lookup("api.test", 443) == ("127.0.0.1", 443)
    assert resolve.lookup("api.test", 8443) == ("::1", 9443)
    assert resolve.lookup("other.test", 443) is None


def test_an_entry_with_a_port_wins_over_one_without() -> None:
    resolve = ResolveMap.parse(["api.test=10.0.0.1:1", "api.test:443=10.0.0.2:2"])
    assert resolve.lookup("api.test", 443) == ("10.0.0.2", 2)
    assert resolve.lookup("api.test", 80) == ("10.0.0.1", 1)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        pytest.param("api.test", "use NAME[:PORT]=ADDRESS[:PORT]", id="no target"),
        pytest.param("api.test=::1", "unbracketed IPv6", id="an unbracketed IPv6 target"),
        pytest.param("api.test:0=127.0.0.1", "invalid port", id="port zero"),
        pytest.param("user@api.test=127.0.0.1", "userinfo", id="userinfo in the name"),
    ],
)
def test_a_malformed_entry_is_refused_at_start(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        ResolveMap.parse([spec])
