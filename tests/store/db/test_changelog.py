"""What a change logs: the rows it touched and a random mark, or ALL when it names nothing."""

from __future__ import annotations

from store.db.changelog import (
    ALL,
    GRANT,
    LOG_KEPT,
    MARK,
    PRINCIPAL,
    PRUNE_EVERY,
    pruned_through,
    rows,
)


def _without_mark(logged: list[tuple[str, int]]) -> list[tuple[str, int]]:
    marks = [row for row in logged if row[0] == MARK]
    assert len(marks) == 1
    return [row for row in logged if row[0] != MARK]


def test_the_rows_a_change_noted_are_logged_once_each_in_order() -> None:
    logged = rows([(GRANT, 7), (PRINCIPAL, 3), (GRANT, 7)])
    assert _without_mark(logged) == [(GRANT, 7), (PRINCIPAL, 3)]


def test_a_change_that_noted_nothing_is_logged_as_all() -> None:
    assert _without_mark(rows([])) == [(ALL, 0)]


def test_all_beside_other_rows_is_logged_alone() -> None:
    assert _without_mark(rows([(GRANT, 7), (ALL, 0)])) == [(ALL, 0)]


def test_each_change_gets_its_own_mark() -> None:
    marks = {next(n for kind, n in rows([(GRANT, 1)]) if kind == MARK) for _ in range(20)}
    assert len(marks) > 1


def test_the_log_is_pruned_every_so_many_changes_keeping_the_last() -> None:
    assert pruned_through(PRUNE_EVERY * 30) == PRUNE_EVERY * 30 - LOG_KEPT
    assert pruned_through(PRUNE_EVERY * 30 + 1) is None
