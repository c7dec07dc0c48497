"""`run`'s corporate proxy flags and its price table, parsed once at start."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from addon.runtime.config import parse_upstream_proxy, read_prices
from store.errors import InvalidInput


def _args(**given: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "upstream_proxy": None,
        "upstream_proxy_bypass": [],
        "upstream_proxy_credential": None,
        "resolve": [],
    }
    values.update(given)
    return argparse.Namespace(**values)


def test_no_corporate_proxy_by_default() -> None:
    assert parse_upstream_proxy(_args()) is None


@pytest.mark.parametrize(
    "given",
    [
        pytest.param({"upstream_proxy_bypass": ["localhost"]}, id="a bypass list alone"),
        pytest.param({"upstream_proxy_credential": "corp"}, id="a credential alone"),
    ],
)
def test_its_companions_need_the_proxy(given: dict[str, object]) -> None:
    with pytest.raises(InvalidInput, match="need --upstream-proxy"):
        parse_upstream_proxy(_args(**given))


def test_names_resolve_maps_are_dialled_directly() -> None:
    proxy = parse_upstream_proxy(
        _args(upstream_proxy="http://10.0.0.1:3128", resolve=["API.test:443=127.0.0.1:8443"])
    )
    assert proxy is not None
    assert proxy.resolved == frozenset({"api.test"})


def test_a_bad_url_is_one_line_without_the_url() -> None:
    with pytest.raises(InvalidInput) as raised:
        parse_upstream_proxy(_args(upstream_proxy="http://u:s3cret@proxy:3128"))
    assert "s3cret" not in str(raised.value)


def test_a_price_table_is_read_once_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    good = tmp_path / "prices.toml"
    good.write_text('[models."m"]\ninput = 1\noutput = 2\n')
    assert read_prices(str(good)).of("m").micros(1, 1) == 3
    bad = tmp_path / "bad.toml"
    bad.write_text('[models."m"]\ninput = 1\n')
    for path, says in ((bad, "needs input and output"), (tmp_path / "none", "cannot read")):
        with pytest.raises(InvalidInput, match=says) as raised:
            read_prices(str(path))
        assert "\n" not in str(raised.value)
