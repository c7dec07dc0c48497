"""The CLI's number types: plain ASCII digits only, range-checked, never NaN or infinite."""

from __future__ import annotations

import argparse
from datetime import timedelta

import pytest

from addon.core.argtypes import MAX_ID, count, seconds, ttl


@pytest.mark.parametrize(
    ("text", "value"),
    [
        pytest.param("0", 0.0, id="zero seconds"),
        pytest.param("2.5", 2.5, id="a fraction of a second"),
        pytest.param("30", 30.0, id="a whole number of seconds"),
    ],
)
def test_seconds_takes_a_plain_non_negative_number(text: str, value: float) -> None:
    assert seconds()(text) == value


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("\u0663", id="an Arabic-Indic digit float() would take"),
        pytest.param("\uff15", id="a fullwidth digit"),
        pytest.param("1_0", id="an underscore float() reads as ten"),
        pytest.param("nan", id="nan"),
        pytest.param("inf", id="infinity"),
        pytest.param("-1", id="a negative number"),
        pytest.param("", id="nothing"),
        pytest.param("ten", id="a word"),
    ],
)
def test_seconds_refuses_anything_else(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        seconds()(text)


@pytest.mark.parametrize(
    ("text", "minimum", "maximum", "value"),
    [
        pytest.param("1", 1, MAX_ID, 1, id="the minimum itself"),
        pytest.param(str(MAX_ID), 0, MAX_ID, MAX_ID, id="the largest BIGINT"),
        pytest.param("007", 0, 10, 7, id="leading zeros"),
    ],
)
def test_count_takes_a_whole_number_in_its_range(
    text: str, minimum: int, maximum: int, value: int
) -> None:
    assert count(minimum, maximum)(text) == value


@pytest.mark.parametrize(
    ("text", "minimum"),
    [
        pytest.param("0", 1, id="below the minimum"),
        pytest.param(str(MAX_ID + 1), 0, id="past BIGINT, where SQLite would raise"),
        pytest.param("\u0663", 0, id="an Arabic-Indic digit int() would take"),
        pytest.param("+3", 0, id="a sign"),
        pytest.param(" 3", 0, id="a space int() would strip"),
        pytest.param("3.0", 0, id="a fraction"),
    ],
)
def test_count_refuses_anything_else(text: str, minimum: int) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="must be a whole number"):
        count(minimum)(text)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        pytest.param("30s", timedelta(seconds=30), id="seconds"),
        pytest.param("10m", timedelta(minutes=10), id="minutes"),
        pytest.param("8h", timedelta(hours=8), id="hours"),
        pytest.param("30d", timedelta(days=30), id="thirty days, the longest"),
    ],
)
def test_ttl_takes_a_number_and_one_unit(text: str, value: timedelta) -> None:
    assert ttl(text) == value


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("31d", id="past thirty days"),
        pytest.param("721h", id="past thirty days in hours"),
        pytest.param("0s", id="zero"),
        pytest.param("08h", id="a leading zero"),
        pytest.param("8", id="no unit"),
        pytest.param("8H", id="an upper-case unit"),
        pytest.param("1h30m", id="two units"),
        pytest.param("\u0668h", id="an Arabic-Indic digit"),
    ],
)
def test_ttl_refuses_anything_else(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="use 30s, 10m, 8h or 7d"):
        ttl(text)
