"""Stamping: which Stamp each scheme gets, each scheme's fields, the slot a field name lands
in, the query parameter, the path placeholder."""

from __future__ import annotations

import base64
import pickle
from urllib.parse import parse_qsl

import pytest

from addon.schemes.path import PathStamp
from addon.schemes.stamp import slot
from addon.schemes.stamping import KINDS, stamp_for, stamp_of
from addon.schemes.static import header_for, stamp_query
from store.crypto import Secret
from store.records import CredentialRecord
from store.rules.validation import SCHEMES

SECRET = b"sk-stamp-0123456789"


def credential(
    scheme: str, header_name: str | None = None, param_name: str | None = None
) -> CredentialRecord:
    return CredentialRecord(
        name="c",
        scheme=scheme,
        header_name=header_name,
        param_name=param_name,
        hosts=(),
        secret=Secret(SECRET),
        fingerprint="fp",
    )


# -- header_for: one header per scheme ------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        pytest.param(
            credential("bearer"),
            ("Authorization", "Bearer " + SECRET.decode()),
            id="bearer goes in Authorization after 'Bearer '",
        ),
        pytest.param(
            credential("basic"),
            ("Authorization", "Basic " + base64.b64encode(SECRET).decode()),
            id="basic goes in Authorization, base64-encoded as given",
        ),
        pytest.param(
            credential("header", header_name="X-Api-Key"),
            ("X-Api-Key", SECRET.decode()),
            id="header goes verbatim in the named header",
        ),
    ],
)
def test_each_scheme_names_its_header(record: CredentialRecord, expected) -> None:
    assert header_for(record) == expected


def test_basic_encodes_a_user_password_secret_whole() -> None:
    record = CredentialRecord("c", "basic", None, None, (), Secret(b"user:pa:ss"), "fp")
    encoded = base64.b64encode(b"user:pa:ss").decode()
    assert header_for(record) == ("Authorization", "Basic " + encoded)


# -- slot: where a field name lands at the upstream -----------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param(b"Authorization", b"authorization", id="case is ignored"),
        pytest.param(b"X_Api_Key", b"x-api-key", id="underscores read as dashes, as CGI does"),
        pytest.param(b"x-api-key", b"x-api-key", id="an already normal name is unchanged"),
        pytest.param(b"X-API_KEY", b"x-api-key", id="mixed spellings meet in one slot"),
    ],
)
def test_slot_normalises_case_and_underscores(name: bytes, expected: bytes) -> None:
    assert slot(name) == expected


# -- Stamp: the fields a credential writes ---------------------------------------------------


def test_a_bearer_stamp_asks_for_identity_and_sets_authorization() -> None:
    stamp = stamp_of(credential("bearer"))
    assert stamp.fields == (
        (b"accept-encoding", b"identity"),
        (b"Authorization", b"Bearer " + SECRET),
    )
    assert stamp.names == frozenset({b"accept-encoding", b"authorization"})
    assert stamp.secret == SECRET


def test_a_header_stamp_replaces_every_spelling_of_its_slot() -> None:
    stamp = stamp_of(credential("header", header_name="X_Api_Key"))
    assert stamp.fields[1] == (b"X_Api_Key", SECRET)
    assert stamp.names == frozenset({b"accept-encoding", b"x-api-key"})


def test_a_query_stamp_has_a_parameter_and_no_credential_header() -> None:
    stamp = stamp_of(credential("query", param_name="key"))
    assert stamp.fields == ((b"accept-encoding", b"identity"),)
    assert stamp.names == frozenset({b"accept-encoding"})
    assert stamp.param == "key"


def test_a_stamp_never_shows_or_pickles_its_secret() -> None:
    stamp = stamp_of(credential("bearer"))
    assert SECRET.decode() not in repr(stamp)
    assert repr(stamp) == "HeaderStamp([secure])"
    with pytest.raises(TypeError):
        pickle.dumps(stamp)


# -- stamp_query: drop the client's parameter, add ours --------------------------------------


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        pytest.param(None, b"key=s%2Fx", id="no query: ours alone"),
        pytest.param(b"", b"key=s%2Fx", id="an empty query: ours alone"),
        pytest.param(b"a=1&b=2", b"a=1&b=2&key=s%2Fx", id="other parameters are kept in order"),
        pytest.param(b"key=theirs&a=1", b"a=1&key=s%2Fx", id="the client's parameter is dropped"),
        pytest.param(b"key=1&key=2", b"key=s%2Fx", id="every copy of it is dropped"),
        pytest.param(b"k%65y=theirs", b"key=s%2Fx", id="a percent-encoded name is theirs too"),
        pytest.param(b"a=1;key=theirs", b"a=1&key=s%2Fx", id="a ';'-separated copy is dropped"),
        pytest.param(
            b"key=theirs;a=1&b=2", b"a=1&b=2&key=s%2Fx", id="';' parts of a pair are kept"
        ),
        pytest.param(b"key", b"key=s%2Fx", id="a bare name without '=' is dropped"),
        pytest.param(b"keys=1", b"keys=1&key=s%2Fx", id="a longer name is not the parameter"),
    ],
)
def test_the_query_parameter_is_replaced(query: bytes | None, expected: bytes) -> None:
    assert stamp_query(query, "key", b"s/x") == expected


def test_a_plus_in_a_parameter_name_reads_as_a_space() -> None:
    assert stamp_query(b"my+key=theirs&a=1", "my key", b"v") == b"a=1&my key=v"


def test_the_secret_is_url_encoded_whole() -> None:
    stamped = stamp_query(b"a=1", "key", b"a&b=c d+e")
    assert dict(parse_qsl(stamped.decode())) == {"a": "1", "key": "a&b=c d+e"}
    assert stamped.count(b"&") == 1


# -- the path scheme: the placeholder's one place ------------------------------------------

PATH_SECRET = b"123456:ABC-def_ghi"
PATH_STAMP = stamp_of(
    CredentialRecord(
        name="tg",
        scheme="path",
        header_name=None,
        param_name=None,
        hosts=(),
        secret=Secret(PATH_SECRET),
        fingerprint="fp",
        options={"placeholder": "CREDPROXY_TG", "positions": ["/bot{}", "/file/bot{}"]},
    )
)


@pytest.mark.parametrize(
    ("path", "target", "headers", "expected"),
    [
        pytest.param(
            "/botCREDPROXY_TG/getMe",
            b"/botCREDPROXY_TG/getMe?x=1",
            {},
            "/bot123456:ABC-def_ghi/getMe",
            id="replaced at its position",
        ),
        pytest.param(
            "/botCREDPROXY_TG",
            b"/botCREDPROXY_TG",
            {},
            "/bot123456:ABC-def_ghi",
            id="the position is the whole path",
        ),
        pytest.param(
            "/file/botCREDPROXY_TG/a.jpg",
            b"/file/botCREDPROXY_TG/a.jpg",
            {},
            "/file/bot123456:ABC-def_ghi/a.jpg",
            id="a second position",
        ),
        pytest.param(
            "/botCREDPROXY_TGX/getMe", b"/botCREDPROXY_TGX/getMe", {}, None, id="a longer segment"
        ),
        pytest.param(
            "/x/botCREDPROXY_TG/getMe", b"/x/botCREDPROXY_TG/getMe", {}, None, id="not a prefix"
        ),
        pytest.param(
            "/botCREDPROXY_TG/getMe",
            b"/botCREDPROXY_TG/getMe?q=credproxy%5Ftg",
            {},
            None,
            id="again in the query, encoded, in another case",
        ),
        pytest.param(
            "/botCREDPROXY_TG/getMe",
            b"/botCREDPROXY_TG/getMe?q=123456%3AABC-def_ghi",
            {},
            None,
            id="the secret itself in the query",
        ),
        pytest.param(
            "/botCREDPROXY_TG/getMe",
            b"/botCREDPROXY_TG/getMe",
            {b"x-a": [b"123456:ABC-def_ghi"]},
            None,
            id="the secret itself in a header",
        ),
        pytest.param("/getMe", b"/getMe", {}, None, id="no placeholder at all"),
    ],
)
def test_path_scheme_placement(
    path: str, target: bytes, headers: dict[bytes, list[bytes]], expected: str | None
) -> None:
    assert isinstance(PATH_STAMP, PathStamp)
    assert PATH_STAMP.placed(path, target, headers) == expected
    assert PATH_STAMP.fields == ((b"accept-encoding", b"identity"),)


def test_an_audit_path_holding_the_path_secret_is_scrubbed() -> None:
    assert isinstance(PATH_STAMP, PathStamp)
    assert PATH_STAMP.scrubbed("/bot123456:ABC-def_ghi/getMe") == "/bot[REDACTED]/getMe"


# -- the registry: one Stamp class per scheme ---------------------------------------------


def test_every_scheme_the_store_accepts_has_a_stamp() -> None:
    assert set(KINDS) == set(SCHEMES)


def test_a_stamp_is_chosen_once_per_credential_version_and_policy() -> None:
    from tests.fakes import CRED, snapshot_policy

    policy = snapshot_policy(cred=CRED)
    first = stamp_for(policy, CRED)
    assert stamp_for(policy, CRED) is first
    # A scheme whose requests all look alike is its own stamping: nothing made per request.
    assert first.prepare(None, None, None, 0) is first  # type: ignore[arg-type]
