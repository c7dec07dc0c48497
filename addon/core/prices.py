"""The operator's price table (`run --prices FILE`): what a model's tokens cost, for spend limits.

TOML, in US dollars per million tokens, as the providers publish them:

    [models."gpt-4o"]
    input = 2.50
    output = 10.00

    [default]            # optional: any model the table does not name
    input = 15
    output = 75

credproxy ships no prices (they go stale). A model the table does not name, with no
`default`, is charged at the table's highest input and output prices.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

MAX_FILE = 1024 * 1024
MAX_MODELS = 10_000
MAX_PRICE = Decimal(1_000_000)  # US dollars per million tokens


class PriceError(ValueError):
    """A price table that cannot be used; the message is one line, naming no value."""


@dataclass(frozen=True)
class Price:
    input: Decimal  # US dollars per million tokens = micro-dollars per token
    output: Decimal

    def micros(self, input_tokens: int, output_tokens: int) -> int:
        """What these tokens cost, in micro-US dollars, rounded up."""
        return math.ceil(self.input * input_tokens + self.output * output_tokens)


@dataclass(frozen=True)
class Prices:
    models: dict[str, Price]
    fallback: Price  # `default`, or the highest prices of the table

    def of(self, model: str | None) -> Price:
        found = self.models.get(model) if model is not None else None
        return found if found is not None else self.fallback

    @classmethod
    def parse(cls, data: bytes, name: str) -> Prices:
        """Raises: PriceError."""
        if len(data) > MAX_FILE:
            raise PriceError(f"{name}: larger than {MAX_FILE // 1024} KiB")
        try:
            table = tomllib.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise PriceError(f"{name}: not a TOML file ({type(e).__name__})") from e
        unknown = set(table) - {"models", "default"}
        if unknown:
            raise PriceError(f"{name}: unknown key {sorted(unknown)[0]!r}: models or default")
        models = table.get("models", {})
        if not isinstance(models, dict) or len(models) > MAX_MODELS:
            raise PriceError(f"{name}: [models] must be a table of at most {MAX_MODELS} models")
        prices = {model: _price(name, f"models.{model!r}", p) for model, p in models.items()}
        default = table.get("default")
        if default is not None:
            fallback = _price(name, "default", default)
        elif prices:
            fallback = Price(
                max(p.input for p in prices.values()), max(p.output for p in prices.values())
            )
        else:
            raise PriceError(f"{name}: names no model and no default")
        return cls(prices, fallback)


def _price(name: str, where: str, value: object) -> Price:
    if not isinstance(value, dict) or set(value) != {"input", "output"}:
        raise PriceError(f"{name}: {where} needs input and output, US dollars per 1M tokens")
    amounts = []
    for side in ("input", "output"):
        raw = value[side]
        try:
            if isinstance(raw, bool) or not isinstance(raw, int | float):
                raise InvalidOperation
            amount = Decimal(str(raw))
        except InvalidOperation:
            amount = Decimal(-1)
        if not amount.is_finite() or not 0 <= amount <= MAX_PRICE:
            raise PriceError(f"{name}: {where}.{side} must be a number from 0 to {MAX_PRICE}")
        amounts.append(amount)
    return Price(*amounts)
