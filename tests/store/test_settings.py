"""Where the store, the key and the CA live: a flag first, then CREDPROXY_*, then the default."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from store.errors import InvalidInput
from store.settings import DEFAULT_ADVERTISE, DEFAULT_DB, Settings

VARIABLES = ("CREDPROXY_DB", "CREDPROXY_KEY_FILE", "CREDPROXY_CERTS", "CREDPROXY_ADVERTISE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _args(**flags: object) -> argparse.Namespace:
    return argparse.Namespace(**{"db": None, "key_file": None, "certs": None, **flags})


def test_without_flags_or_variables_the_defaults_hold() -> None:
    settings = Settings.resolve(_args())
    assert settings == Settings(
        DEFAULT_DB, Path("credproxy.key"), Path("certs"), DEFAULT_ADVERTISE, json=False
    )


def test_a_variable_overrides_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CREDPROXY_DB", "sqlite:///env.db")
    monkeypatch.setenv("CREDPROXY_KEY_FILE", "/env/key")
    monkeypatch.setenv("CREDPROXY_CERTS", "/env/certs")
    monkeypatch.setenv("CREDPROXY_ADVERTISE", "10.0.0.2:8080")
    settings = Settings.resolve(_args())
    assert (settings.db, settings.key_file, settings.certs, settings.advertise) == (
        "sqlite:///env.db",
        Path("/env/key"),
        Path("/env/certs"),
        "10.0.0.2:8080",
    )


def test_a_flag_overrides_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CREDPROXY_DB", "sqlite:///env.db")
    monkeypatch.setenv("CREDPROXY_KEY_FILE", "/env/key")
    monkeypatch.setenv("CREDPROXY_CERTS", "/env/certs")
    args = _args(db="postgresql://u@db/credproxy", key_file="/flag/key", certs="/flag/certs")
    settings = Settings.resolve(args)
    assert (settings.db, settings.key_file, settings.certs) == (
        "postgresql://u@db/credproxy",
        Path("/flag/key"),
        Path("/flag/certs"),
    )


def test_json_follows_its_flag_and_is_off_where_a_command_has_none() -> None:
    assert Settings.resolve(_args(json=True)).json is True
    assert Settings.resolve(_args()).json is False


@pytest.mark.parametrize(
    ("flag", "variable", "source"),
    [
        pytest.param("mysql://x/y", None, "--db", id="a foreign database given by --db"),
        pytest.param(None, "nonsense", "CREDPROXY_DB", id="no URL at all in CREDPROXY_DB"),
    ],
)
def test_a_bad_database_url_names_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch, flag: str | None, variable: str | None, source: str
) -> None:
    if variable is not None:
        monkeypatch.setenv("CREDPROXY_DB", variable)
    with pytest.raises(InvalidInput) as caught:
        Settings.resolve(_args(db=flag))
    assert str(caught.value).startswith(f"{source}: ")
