"""Key custody: the store's check value, a wrong or stale key, rotation re-sealing everything."""

from collections.abc import Callable

import pytest

from store.crypto import MasterKey, Secret
from store.db.models import Credential
from store.errors import MasterKeyError, SealError
from store.repository import Store
from tests.stores import SECRET, read_row, seed

# -- the master key --------------------------------------------------------------------


def test_rotating_the_key_reseals_every_secret(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    seed(store)
    store.add_credential("pypi", "bearer", ["upload.pypi.org"], Secret(b"pypi-token"))
    old_fingerprint = store.snapshot().credentials["gh"].fingerprint
    new = MasterKey.generate("new key file")

    assert store.rotate_key(new) == 2

    row = read_row(store, Credential, "gh")
    assert row.key_id == new.key_id
    with pytest.raises(SealError):
        key.open(row.key_id, row.nonce, row.ciphertext, "credential/gh")
    with pytest.raises(SealError):
        key.open(key.key_id, row.nonce, row.ciphertext, "credential/gh")
    with pytest.raises(MasterKeyError):
        open_store(key).check_key()

    rotated = open_store(new)
    rotated.check_key()
    snap = rotated.snapshot()
    assert snap.key_id == new.key_id
    assert snap.credentials["gh"].secret == SECRET
    assert snap.credentials["pypi"].secret.reveal() == b"pypi-token"
    assert snap.credentials["gh"].fingerprint == new.fingerprint(SECRET) != old_fingerprint
    assert len(snap.grants) == 1


def test_rotating_with_a_stale_key_is_refused(
    store: Store, open_store: Callable[[MasterKey | None], Store]
) -> None:
    seed(store)
    stale = open_store(MasterKey.generate("stale key file"))
    with pytest.raises(MasterKeyError, match="stale key file"):
        stale.rotate_key(MasterKey.generate("new"))
    assert store.snapshot().credentials["gh"].secret == SECRET


def test_wrong_key_is_refused_up_front_naming_its_source(
    store: Store, open_store: Callable[[MasterKey | None], Store]
) -> None:
    seed(store)
    wrong = open_store(MasterKey.generate("key file /etc/credproxy/wrong.key"))
    with pytest.raises(MasterKeyError, match="key file /etc/credproxy/wrong.key") as caught:
        wrong.check_key()
    assert wrong.key is not None and wrong.key.key_id in str(caught.value)


def test_adopting_a_key_does_not_replace_the_stores_key(
    store: Store, open_store: Callable[[MasterKey | None], Store]
) -> None:
    other = open_store(MasterKey.generate("other"))
    with pytest.raises(MasterKeyError):
        other.check_key(adopt=True)
    store.check_key()
