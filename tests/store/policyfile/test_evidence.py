"""The generalisation rule and the bound on what evidence is held."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from store.errors import InvalidInput
from store.policyfile.evidence import Evidence, covers, looks_like_id, patterns

T = datetime(2026, 12, 7, 10, tzinfo=UTC)


@pytest.mark.parametrize(
    ("paths", "expected"),
    [
        pytest.param(
            ["/repos/acme/app/issues/1", "/repos/acme/app/issues/2", "/repos/acme/app/issues/3"],
            ["/repos/acme/app/issues/*"],
            id="three numeric ids at one place become a star",
        ),
        pytest.param(
            ["/repos/acme/app/issues/1", "/repos/acme/app/issues/2"],
            ["/repos/acme/app/issues/1", "/repos/acme/app/issues/2"],
            id="two ids are not enough: the paths themselves",
        ),
        pytest.param(
            ["/1", "/2", "/3", "/4"],
            ["/1", "/2", "/3", "/4"],
            id="the first segment never becomes a star: no /* from ids",
        ),
        pytest.param(
            ["/repos/acme/app", "/repos/acme/web", "/repos/acme/cli"],
            ["/repos/acme/app", "/repos/acme/cli", "/repos/acme/web"],
            id="words are never generalised, however many",
        ),
        pytest.param(
            ["/orgs/7/items/1", "/orgs/7/items/2", "/orgs/7/items/3"],
            ["/orgs/7/items/*"],
            id="only the place with enough distinct values is starred",
        ),
        pytest.param(
            [
                "/b/0e5a61e2-6b4b-4c9a-9a43-1c1b1d1e1f10",
                "/b/1e5a61e2-6b4b-4c9a-9a43-1c1b1d1e1f10",
                "/b/2e5a61e2-6b4b-4c9a-9a43-1c1b1d1e1f10",
            ],
            ["/b/*"],
            id="UUIDs are ids",
        ),
        pytest.param(
            ["/c/deadbee1", "/c/cafebab2", "/c/facade", "/c/badcafe"],
            ["/c/badcafe", "/c/cafebab2", "/c/deadbee1", "/c/facade"],
            id="hex without a digit is a word, and two hex ids are too few",
        ),
        pytest.param(
            ["/v1/a", "/v1/a/b", "/v1/a/c"],
            ["/v1/a"],
            id="a path under another folds into it (patterns are prefixes)",
        ),
        pytest.param(
            ["/v1/a%20b", "/v1//x", "/v1/ok"],
            ["/v1/ok"],
            id="a path no pattern can write is left out",
        ),
        pytest.param(
            ["/repos/acme/*", "/repos/acme/*/x", "/repos/acme/app"],
            ["/repos/acme/app"],
            id="a literal * segment in a path never becomes a wildcard",
        ),
    ],
)
def test_patterns(paths: list[str], expected: list[str]) -> None:
    assert sorted(patterns(paths)) == expected


def test_patterns_keep_the_paths_each_stands_for() -> None:
    drawn = patterns(["/x/1", "/x/2", "/x/3", "/y"])
    assert drawn == {"/x/*": ["/x/1", "/x/2", "/x/3"], "/y": ["/y"]}


@pytest.mark.parametrize(
    ("segment", "expected"),
    [("123", True), ("a1b2c3d", True), ("abcdefa", False), ("1e5a61e2", True), ("main", False)],
)
def test_looks_like_id(segment: str, expected: bool) -> None:
    assert looks_like_id(segment) is expected


@pytest.mark.parametrize(
    ("outer", "inner", "expected"),
    [
        ("/", "/a", True),
        ("/a", "/a/b", True),
        ("/a/*", "/a/1/c", True),
        ("/a/*", "/a", False),
        ("/a/1", "/a/*", False),
        ("/a/", "/a", False),
        ("/a/", "/a/b", True),
        ("/a/*", "/a/x%2Fy", False),
        ("/ab", "/a", False),
    ],
)
def test_covers(outer: str, inner: str, expected: bool) -> None:
    assert covers(outer, inner) is expected


def test_keys_past_the_bound_are_dropped_counted_and_their_grant_marked() -> None:
    evidence = Evidence([7], max_keys=2)
    evidence.deny(("agent", "h.example", 443, "GET", "/a"), T, "no-grant")
    evidence.deny(("agent", "h.example", 443, "GET", "/a"), T, "no-grant")  # the same key
    evidence.use(7, "GET", "/x", T)
    evidence.use(7, "GET", "/y", T)  # a third key
    evidence.deny(("agent", "h.example", 443, "GET", "/b"), T, "no-grant")
    evidence.use(99, "GET", "/x", T)  # not an active grant: never held
    assert evidence.keys == 2 and evidence.dropped == 2
    assert evidence.incomplete == {7}
    assert evidence.denied[("agent", "h.example", 443, "GET", "/a")].count == 2
    assert evidence.other_grants == 1 and 99 not in evidence.used


def test_an_access_request_counts_as_the_larger_of_the_two_never_the_sum() -> None:
    evidence = Evidence([])
    key = ("agent", "h.example", 443, "GET", "/a")
    for _ in range(3):
        evidence.deny(key, T, "no-grant")
    evidence.requested(key, T, T, 5)
    assert evidence.denied[key].count == 5
    evidence.requested(key, T, T, 2)
    assert evidence.denied[key].count == 5


def test_max_keys_below_one_is_refused() -> None:
    with pytest.raises(InvalidInput):
        Evidence([], max_keys=0)
