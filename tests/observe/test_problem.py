"""problem+json answers: every reason has its title, and its status (403 unless listed)."""

from __future__ import annotations

import json

import pytest

from addon.core.reasons import STATUS, Reason
from addon.observe.problem import TITLES, problem


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_has_a_title_and_a_status_and_makes_an_answer(reason: Reason) -> None:
    """A reason without a title would fail the deny itself: the agent would get a 500."""
    assert reason in TITLES
    answer = problem(reason, "detail", request_id="r-1")
    assert answer.status == STATUS.get(reason, 403)  # a denial unless said otherwise
    assert json.loads(answer.body)["title"] == TITLES[reason]
