"""`credproxy run`'s start-up checks that need no proxy: the --listen probe."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from addon.runtime.config import check_listen
from store.errors import InvalidInput


@pytest.fixture
def taken() -> Iterator[int]:
    """A port listened on at 127.0.0.1 only."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_free_address_passes() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    check_listen("127.0.0.1", port)


def test_a_taken_address_is_named(taken: int) -> None:
    with pytest.raises(InvalidInput) as refused:
        check_listen("127.0.0.1", taken)
    assert str(refused.value) == (
        f"cannot listen on --listen 127.0.0.1:{taken}: 127.0.0.1:{taken} is already in use"
    )


def test_every_address_of_a_name_is_probed(taken: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A name for two addresses, the free one first (as `localhost` may give ::1 first):
    # mitmproxy listens on both, so the taken second one must be found.
    def two(host: str, port: int, *args: object, **kwargs: object) -> list[object]:
        assert host == "proxy.local"
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", two)
    with pytest.raises(InvalidInput) as refused:
        check_listen("proxy.local", taken)
    assert f"127.0.0.1:{taken} is already in use" in str(refused.value)


def test_a_name_that_does_not_resolve_is_one_line() -> None:
    with pytest.raises(InvalidInput) as refused:
        check_listen("no-such-host.invalid", 8080)
    assert str(refused.value).startswith("cannot listen on --listen no-such-host.invalid:8080: ")
