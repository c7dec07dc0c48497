"""What a command prints on success (addon/cli/output.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from addon.cli.output import emit, table, yes
from store.settings import Settings


def test_a_table_aligns_its_columns_and_shows_nothing_as_a_dash() -> None:
    rows = [{"name": "agent", "hosts": ["a.test", "b.test"]}, {"name": "b", "hosts": None}]
    assert table(rows, ["name", "hosts"]) == [
        "name   hosts",
        "agent  a.test,b.test",
        "b      -",
    ]


def test_a_table_without_rows_is_its_header() -> None:
    assert table([], ["id", "state"]) == ["id  state"]


@pytest.mark.parametrize(("as_json", "printed"), [(False, "one\ntwo\n"), (True, '{"n": 1}\n')])
def test_emit_prints_the_lines_or_the_json(
    capsys: pytest.CaptureFixture[str], as_json: bool, printed: str
) -> None:
    settings = Settings("sqlite:///x.db", Path("k"), Path("c"), "127.0.0.1:8080", as_json)
    emit(settings, {"n": 1}, ["one", "two"])
    assert capsys.readouterr().out == printed
    if as_json:
        assert json.loads(printed) == {"n": 1}


def test_yes_and_no() -> None:
    assert (yes(True), yes(False)) == ("yes", "no")
