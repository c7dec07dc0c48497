import base64
import hashlib
import os
import pickle
from pathlib import Path

import pytest

from store.crypto import (
    KEY_ENV,
    MasterKey,
    Secret,
    decode_key,
    hash_token,
    load_master_key,
    new_token,
    token_matches,
    write_key_file,
)
from store.errors import MasterKeyError, SealError

PLAINTEXT = b"sk-live-0123456789abcdef"
CONTEXT = "credential/github"


def _flip(data: bytes, index: int = 0) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


def test_sealed_secret_opens_to_the_plaintext(key: MasterKey) -> None:
    key_id, nonce, ciphertext = key.seal(PLAINTEXT, CONTEXT)
    assert key_id == key.key_id
    assert len(nonce) == 12
    assert PLAINTEXT not in ciphertext
    assert key.open(key_id, nonce, ciphertext, CONTEXT).reveal() == PLAINTEXT


@pytest.mark.parametrize("index", [0, -1], ids=["first byte", "last byte of the tag"])
def test_tampered_ciphertext_is_refused(key: MasterKey, index: int) -> None:
    key_id, nonce, ciphertext = key.seal(PLAINTEXT, CONTEXT)
    with pytest.raises(SealError, match="failed authentication"):
        key.open(key_id, nonce, _flip(ciphertext, index % len(ciphertext)), CONTEXT)


def test_tampered_nonce_is_refused(key: MasterKey) -> None:
    key_id, nonce, ciphertext = key.seal(PLAINTEXT, CONTEXT)
    with pytest.raises(SealError):
        key.open(key_id, _flip(nonce), ciphertext, CONTEXT)


def test_ciphertext_moved_to_another_credential_is_refused(key: MasterKey) -> None:
    key_id, nonce, ciphertext = key.seal(PLAINTEXT, "credential/github")
    with pytest.raises(SealError, match="credential/stripe"):
        key.open(key_id, nonce, ciphertext, "credential/stripe")


def test_another_key_cannot_open_even_when_told_its_own_key_id(key: MasterKey) -> None:
    other = MasterKey.generate("other")
    _, nonce, ciphertext = key.seal(PLAINTEXT, CONTEXT)
    with pytest.raises(SealError, match="failed authentication"):
        other.open(other.key_id, nonce, ciphertext, CONTEXT)


def test_secret_sealed_under_another_key_id_is_refused(key: MasterKey) -> None:
    other = MasterKey.generate("other")
    key_id, nonce, ciphertext = other.seal(PLAINTEXT, CONTEXT)
    with pytest.raises(SealError, match=f"sealed under key {key_id}, not {key.key_id}"):
        key.open(key_id, nonce, ciphertext, CONTEXT)


def test_every_seal_draws_a_fresh_nonce(key: MasterKey) -> None:
    sealed = [key.seal(PLAINTEXT, CONTEXT) for _ in range(1000)]
    assert len({nonce for _, nonce, _ in sealed}) == 1000
    assert len({ciphertext for _, _, ciphertext in sealed}) == 1000


def test_key_id_and_check_value_are_stable_for_one_key_and_differ_across_keys() -> None:
    raw = os.urandom(32)
    a, b = MasterKey(raw, "a"), MasterKey(raw, "b")
    other = MasterKey.generate("c")
    assert (a.key_id, a.check_value) == (b.key_id, b.check_value)
    assert a.key_id != other.key_id
    assert a.check_value != other.check_value


def test_master_key_repr_does_not_show_the_key(key: MasterKey) -> None:
    assert base64.b64encode(key.key).decode() not in repr(key)
    assert key.key.hex() not in repr(key)


def test_secret_repr_and_str_hide_the_plaintext() -> None:
    secret = Secret(PLAINTEXT)
    for shown in (repr(secret), str(secret), f"{secret}", repr([secret])):
        assert PLAINTEXT.decode() not in shown
        assert "[secure]" in shown


def test_secret_refuses_to_be_pickled() -> None:
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(Secret(PLAINTEXT))


def test_fingerprint_is_keyed_and_not_a_plain_hash(key: MasterKey) -> None:
    secret = Secret(PLAINTEXT)
    fingerprint = key.fingerprint(secret)
    assert fingerprint == key.fingerprint(Secret(PLAINTEXT))
    assert fingerprint != key.fingerprint(Secret(PLAINTEXT + b"x"))
    assert fingerprint != MasterKey.generate("other").fingerprint(secret)
    digest = fingerprint.removeprefix("fp-")
    assert digest not in hashlib.sha256(PLAINTEXT).hexdigest()
    assert digest not in PLAINTEXT.hex()


def test_token_is_at_least_128_bits_and_only_its_hash_matches() -> None:
    token = new_token()
    assert len(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))) >= 16
    assert token != new_token()
    assert token not in hash_token(token)
    assert token_matches(token, hash_token(token))
    assert not token_matches(token + "x", hash_token(token))


# -- the master key ------------------------------------------------------------------


def _key_file(path: Path, content: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_environment_key_wins_over_the_key_file(tmp_path: Path) -> None:
    from_env, from_file = MasterKey.generate("env"), MasterKey.generate("file")
    path = _key_file(tmp_path / "k.key", from_file.encoded(), 0o644)
    key = load_master_key(path, {KEY_ENV: from_env.encoded().decode()})
    assert key.key == from_env.key
    assert key.source == KEY_ENV


def test_private_key_file_is_accepted(tmp_path: Path) -> None:
    written = MasterKey.generate("file")
    path = _key_file(tmp_path / "k.key", written.encoded())
    key = load_master_key(path, {})
    assert key.key == written.key
    assert str(path) in key.source


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(0o644, id="readable by everyone"),
        pytest.param(0o640, id="readable by the group"),
        pytest.param(0o602, id="writable by others"),
    ],
)
def test_key_file_open_to_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = _key_file(tmp_path / "k.key", MasterKey.generate("f").encoded(), mode)
    with pytest.raises(MasterKeyError) as caught:
        load_master_key(path, {})
    assert str(path) in str(caught.value)
    assert f"mode {mode:o}" in str(caught.value)


def test_missing_key_file_says_to_run_init(tmp_path: Path) -> None:
    with pytest.raises(MasterKeyError, match="run credproxy init"):
        load_master_key(tmp_path / "absent.key", {})


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(b"not base64!!\n", id="refuse text that is not base64"),
        pytest.param(base64.b64encode(os.urandom(16)), id="refuse a 128-bit key"),
        pytest.param(base64.b64encode(os.urandom(33)), id="refuse a 33-byte key"),
        pytest.param(b"", id="refuse an empty key"),
    ],
)
def test_malformed_key_is_refused_from_file_and_environment(tmp_path: Path, text: bytes) -> None:
    path = _key_file(tmp_path / "k.key", text)
    with pytest.raises(MasterKeyError, match=str(path)):
        load_master_key(path, {})
    with pytest.raises(MasterKeyError, match=KEY_ENV):
        decode_key(text, KEY_ENV)


def test_write_key_file_creates_a_private_file(tmp_path: Path) -> None:
    key = MasterKey.generate("file")
    path = tmp_path / "k.key"
    write_key_file(path, key)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_master_key(path, {}).key == key.key
    assert [p.name for p in tmp_path.iterdir()] == ["k.key"]


def test_write_key_file_replaces_only_when_asked(tmp_path: Path) -> None:
    first, second = MasterKey.generate("1"), MasterKey.generate("2")
    path = tmp_path / "k.key"
    write_key_file(path, first)
    with pytest.raises(FileExistsError):
        write_key_file(path, second)
    assert load_master_key(path, {}).key == first.key
    write_key_file(path, second, replace=True)
    assert load_master_key(path, {}).key == second.key
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["k.key"]
