"""The redaction set: what each holder (the store, the process's mints, its STS calls) has of a
credential, the values replaced kept for the grace period, and requests always redacting at
least their own values. Two real replicas: tests/e2e/test_redaction_replicas.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from botocore.credentials import Credentials

from addon.redaction import redactset
from addon.redaction.redactset import GRACE, MAX_RETIRED, MINTED, ROLE, STORE, RedactionSets
from addon.schemes import assume
from addon.schemes.assume import RoleSession, Temporary
from addon.schemes.mint import Tokens, TokenSession
from addon.schemes.stamping import redacted
from store.crypto import Secret
from store.records import CredentialRecord
from store.rules.grammar import parse_host
from tests.schemes.test_mint import FakeMinter, reachable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _text(sets: RedactionSets, name: str, values: list[bytes]) -> bytes:
    """What a request stamped with `name` lets through of a body holding `values`."""
    redactor = sets.redactor(name, ())
    return redactor.feed(b" ".join(values)) + redactor.feed(b"")


def record(name: str, scheme: str, secret: Any, **options: Any) -> CredentialRecord:
    raw = secret if isinstance(secret, bytes) else json.dumps(secret).encode()
    return CredentialRecord(
        name=name,
        scheme=scheme,
        hosts=(parse_host("api.example"),),
        secret=Secret(raw),
        header_name=None,
        param_name=None,
        fingerprint="fp-" + name,
        options=options,
    )


def test_a_replaced_value_stays_for_the_grace_period_then_goes() -> None:
    clock = Clock()
    sets = RedactionSets(clock)
    sets.hold("c", STORE, [b"old-secret"])
    sets.hold("c", STORE, [b"new-secret"])
    assert sets.secrets("c") == (b"new-secret", b"old-secret")
    assert _text(sets, "c", [b"old-secret", b"new-secret"]) == b"[REDACTED] [REDACTED]"
    clock.now += GRACE - 1
    sets.hold("c", MINTED, [b"a-token-1"])
    assert b"old-secret" in sets.secrets("c")
    clock.now += 1
    sets.hold("c", MINTED, [b"a-token-2"])
    assert sets.secrets("c") == (b"a-token-1", b"a-token-2", b"new-secret")


def test_a_value_another_holder_still_has_is_not_retired() -> None:
    clock = Clock()
    sets = RedactionSets(clock)
    sets.hold("c", STORE, [b"refresh-1"])
    sets.hold("c", MINTED, [b"refresh-1", b"token-1"])
    sets.hold("c", STORE, [b"refresh-2"])
    clock.now += GRACE
    sets.hold("c", STORE, [b"refresh-3"])  # refresh-2 retired just now; refresh-1 held
    assert sets.secrets("c") == (b"refresh-1", b"refresh-2", b"refresh-3", b"token-1")


def test_at_most_max_retired_values_are_kept_the_oldest_going_first() -> None:
    clock = Clock()
    sets = RedactionSets(clock)
    for i in range(MAX_RETIRED + 3):
        clock.now += 1
        sets.hold("c", MINTED, [b"token-%03d" % i])
    kept = sets.secrets("c")
    assert len(kept) == MAX_RETIRED + 1
    assert kept[0] == b"token-%03d" % 2 and kept[-1] == b"token-%03d" % (MAX_RETIRED + 2)


def test_a_request_redacts_its_own_values_even_those_no_holder_told_of() -> None:
    sets = RedactionSets()
    sets.hold("c", STORE, [b"stored-secret"])
    redactor = sets.redactor("c", [b"unheard-of-token"])
    out = redactor.feed(b"stored-secret unheard-of-token") + redactor.feed(b"")
    assert out == b"[REDACTED] [REDACTED]"
    lone = sets.redactor("never-held", [b"only-this-one"])
    assert lone.feed(b"only-this-one") + lone.feed(b"") == b"[REDACTED]"


def test_follow_reads_new_records_only_and_retires_a_removed_credential(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sets = RedactionSets()
    reads: list[str] = []

    def parts(found: CredentialRecord) -> tuple[bytes, ...]:
        reads.append(found.name)
        return redacted(found)

    a, b = record("a", "bearer", b"secret-a"), record("b", "bearer", b"secret-b")
    assert sets.follow({"a": a, "b": b}, parts) == []  # nothing used yet: nothing to build
    sets.redactor("a", ())
    assert sets.follow({"a": a, "b": b}, parts) == [] and reads == ["a", "b"]
    rotated = record("a", "bearer", b"secret-a2")
    assert sets.follow({"a": rotated}, parts) == ["a"]
    assert sets.secrets("a") == (b"secret-a", b"secret-a2")
    assert sets.secrets("b") == (b"secret-b",)  # removed, kept for the grace period
    built: list[tuple[bytes, ...]] = []
    monkeypatch.setattr(redactset, "prepare", lambda v: built.append(v) or None)
    sets.prepare(["a"])
    sets.redactor("a", ())
    assert built == [(b"secret-a", b"secret-a2")]  # the request found it built


@pytest.mark.parametrize(
    ("credential", "parts"),
    [
        pytest.param(record("s", "bearer", b"ghp_static"), [b"ghp_static"], id="a static secret"),
        pytest.param(
            record(
                "k",
                "sigv4",
                {"access_key_id": "AKIDEXAMPLE", "secret_access_key": "wJalr/KEY"},
            ),
            [b"wJalr/KEY", b"AKIDEXAMPLE"],
            id="sigv4: the secret key and the key id AWS errors echo",
        ),
        pytest.param(
            record(
                "r",
                "oauth2-refresh",
                {
                    "client_id": "cid",
                    "client_secret": "csecret",
                    "refresh_token": "rt-2",
                    "access_token": "at-2",
                    "access_issued": 1.0,
                    "access_expires": 2.0,
                    "access_for": "x",
                },
                token_url="https://auth.example/token",
            ),
            [b"csecret", b"rt-2", b"at-2"],
            id="oauth2-refresh: the refresh and access tokens another replica sealed",
        ),
        pytest.param(
            record(
                "c",
                "oauth2-client",
                {"client_id": "cid", "client_secret": "csecret"},
                token_url="https://auth.example/token",
            ),
            [b"csecret"],
            id="oauth2-client: the client secret",
        ),
    ],
)
def test_what_the_store_holds_of_each_scheme(
    credential: CredentialRecord, parts: list[bytes]
) -> None:
    assert list(redacted(credential)) == parts


async def test_a_minted_token_is_in_the_set_before_it_is_stamped_and_stays_when_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sets = RedactionSets()
    monkeypatch.setattr("addon.schemes.tokens.SETS", sets)
    tokens = Tokens()
    tokens.dial = reachable
    s = TokenSession("minted-cred", FakeMinter(), tokens)
    first = await s.ensure()
    assert first.value in sets.secrets("minted-cred")
    assert sets.redactor("minted-cred", (first.value,)) is not None
    s.current = None
    second = await s.ensure()
    assert {first.value, second.value, b"long-lived"} == set(sets.secrets("minted-cred"))


async def test_renewed_sts_keys_are_in_the_set_and_the_old_ones_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sets = RedactionSets()
    monkeypatch.setattr(assume, "SETS", sets)
    calls = iter(range(10))

    def fake(self: RoleSession, address: tuple[str, int]) -> Temporary:
        n = next(calls)
        keys = (b"secret-%d" % n, b"session-token-%d" % n, b"ASIA%d" % n)
        return Temporary(Credentials("ASIA", "s", "t"), 4e9, keys)

    monkeypatch.setattr(RoleSession, "_assume", fake)
    base = Credentials("AKID", "SECRET")
    session = RoleSession("role-cred", base, {"assume_role": "x"}, reachable, None)
    await session.ensure()
    session.current = None
    await session.ensure()
    held = set(sets.secrets("role-cred"))
    assert {b"secret-0", b"session-token-0", b"secret-1", b"session-token-1"} <= held
    sets.hold("role-cred", ROLE, ())  # a rotated credential's session: retired, kept
    assert b"secret-1" in sets.secrets("role-cred")
