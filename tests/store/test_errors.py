"""The exception tree: one base for everything an operator is told, drawn in the docstring."""

from __future__ import annotations

import inspect

import pytest

from store import errors
from store.errors import CredproxyError

KINDS = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, Exception) and cls.__module__ == errors.__name__
]


@pytest.mark.parametrize("kind", KINDS, ids=[k.__name__ for k in KINDS])
def test_every_error_is_a_credproxy_error(kind: type[Exception]) -> None:
    assert issubclass(kind, CredproxyError)
    with pytest.raises(CredproxyError, match="one line"):
        raise kind("one line")


def test_the_docstring_draws_the_whole_tree() -> None:
    assert errors.__doc__ is not None
    drawn = {line.split()[1] for line in errors.__doc__.splitlines() if "──" in line}
    assert drawn == {k.__name__ for k in KINDS if k is not CredproxyError}


def test_the_kinds_are_distinct() -> None:
    leaves = [k for k in KINDS if k is not CredproxyError]
    for kind in leaves:
        others = [o for o in leaves if o is not kind]
        assert not any(issubclass(kind, o) for o in others), kind.__name__
