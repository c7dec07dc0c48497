"""The operator's price table: each model's price, and a fallback that never undercharges."""

from __future__ import annotations

from decimal import Decimal

import pytest

from addon.core.prices import MAX_FILE, Price, PriceError, Prices

TABLE = b"""
[models."gpt-4o"]
input = 2.50
output = 10.00

[models."claude-haiku-4-5"]
input = 1
output = 5
"""


def test_a_models_tokens_cost_its_prices_rounded_up_to_a_micro_dollar() -> None:
    prices = Prices.parse(TABLE, "t")
    assert prices.of("gpt-4o") == Price(Decimal("2.50"), Decimal("10.00"))
    assert prices.of("gpt-4o").micros(100, 20) == 450  # 100 * 2.5 + 20 * 10
    assert Price(Decimal("0.15"), Decimal("0.6")).micros(1, 1) == 1  # 0.75, rounded up


def test_a_model_the_table_does_not_name_costs_its_highest_prices() -> None:
    prices = Prices.parse(TABLE, "t")
    assert prices.of("gpt-9") == prices.of(None) == Price(Decimal("2.50"), Decimal("10.00"))


def test_a_default_prices_the_models_the_table_does_not_name() -> None:
    prices = Prices.parse(TABLE + b"[default]\ninput = 15\noutput = 75\n", "t")
    assert prices.of("gpt-9") == Price(Decimal(15), Decimal(75))


@pytest.mark.parametrize(
    ("data", "says"),
    [
        pytest.param(b"[models", "not a TOML file", id="not TOML"),
        pytest.param(b"", "names no model and no default", id="empty"),
        pytest.param(b"[prices]\n", "unknown key 'prices'", id="an unknown table"),
        pytest.param(b'[models."m"]\ninput = 1\n', "needs input and output", id="no output"),
        pytest.param(b'[models."m"]\ninput = -1\noutput = 1\n', "from 0 to", id="negative"),
        pytest.param(b'[models."m"]\ninput = true\noutput = 1\n', "from 0 to", id="a boolean"),
        pytest.param(b'[models."m"]\ninput = "1"\noutput = 1\n', "from 0 to", id="a string"),
        pytest.param(b'[models."m"]\ninput = nan\noutput = 1\n', "from 0 to", id="not a number"),
        pytest.param(b"#" * (MAX_FILE + 1), "larger than", id="too large"),
    ],
)
def test_a_table_that_cannot_be_used_is_refused_in_one_line(data: bytes, says: str) -> None:
    with pytest.raises(PriceError, match=says) as e:
        Prices.parse(data, "prices.toml")
    assert "\n" not in str(e.value) and str(e.value).startswith("prices.toml")
