"""The line `credproxy run` prints for a person at a terminal."""

from __future__ import annotations

from pathlib import Path

from addon.runtime.greeting import greeting


def test_the_greeting_says_where_it_listens_the_store_the_ca_and_how_to_stop() -> None:
    line = greeting(["127.0.0.1:8080"], [], "sqlite:///credproxy.db", Path("certs/ca.pem"))
    assert line == (
        "credproxy listening on 127.0.0.1:8080; store sqlite:///credproxy.db; "
        "clients must trust certs/ca.pem; Ctrl-C stops it. JSON lines follow."
    )


def test_every_address_and_the_admin_listener_are_named() -> None:
    line = greeting(["127.0.0.1:8080", "[::1]:8080"], ["127.0.0.1:9090"], "db", Path("ca.pem"))
    assert line.startswith(
        "credproxy listening on 127.0.0.1:8080, [::1]:8080 (admin 127.0.0.1:9090);"
    )
    assert "\n" not in line
