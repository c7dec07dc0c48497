"""A hostile review of secret references (docs/secret-sources.md): each break is a test of the
promise; the breaks it found are fixed, and every test stays as a regression test. Unit-level: no
network, no proxy process."""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from addon.proxy import remote
from addon.proxy.live import LivePolicy
from addon.proxy.sourcekinds import Files, SourceError
from addon.proxy.sources import FAILING, OK, STALE, Sources, SourceSettings
from store.crypto import MasterKey, Secret
from store.errors import InvalidInput
from store.records import CredentialRecord
from store.repository import Store
from store.rules import secretref
from tests.proxy.test_sources import FAST, Kubelet, _seed, _stamped, _until

SHORT = SourceSettings(poll=0.02, ttl=0.02, max_stale=0.3, first_fetch=2.0, retry=0.02)


@pytest.fixture
def kubelet(tmp_path: Path) -> Kubelet:
    (tmp_path / "secret").mkdir()
    return Kubelet(tmp_path / "secret")


@pytest.fixture
def sqlite_store(tmp_path: Path, key: MasterKey) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path}/t.db", key, create=True)
    s.migrate()
    s.check_key(adopt=True)
    yield s
    s.close()


def _db(tmp_path: Path) -> sqlite3.Connection:
    return sqlite3.connect(tmp_path / "t.db")


def _forge(tmp_path: Path, name: str, ref: str, fingerprint: str) -> None:
    """What a database writer without the master key can do: point a row at a reference."""
    with _db(tmp_path) as db:
        db.execute(
            "UPDATE credentials SET secret_ref = ?, fingerprint = ?, key_id = NULL, "
            "nonce = NULL, ciphertext = NULL WHERE name = ?",
            (ref, fingerprint, name),
        )


def _unblock(fifo: Path, thread: threading.Thread | None = None) -> None:
    """Give a reader stuck opening `fifo` its EOF, so no thread outlives the test."""
    for _ in range(200):
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            if thread is not None and not thread.is_alive():
                return
            time.sleep(0.01)
            continue
        os.close(fd)
        if thread is None or not thread.is_alive():
            return
        time.sleep(0.01)


def _record(name: str, ref: str, scheme: str = "bearer") -> CredentialRecord:
    return CredentialRecord(
        name, scheme, None, None, (), Secret(b"-"), "", {}, secret_ref=ref, available=False
    )


# -- promise 1: a reference row written without the master key is never read -------------------


def test_an_unmarked_reference_row_is_not_read_by_the_proxy(
    sqlite_store: Store, tmp_path: Path
) -> None:
    """Held: the proxy's snapshot drops a reference row whose mark is not the key's."""
    target = tmp_path / "proxy-ca.key"
    target.write_bytes(b"ca-private-key-material")
    sqlite_store.add_principal("agent")
    sqlite_store.add_credential("gh", "bearer", ["api.github.com"], Secret(b"sealed-one"))
    sqlite_store.add_grant("agent", ["GET"], credential="gh")
    _forge(tmp_path, "gh", f"file:{target}", "fp-000000000000")
    live = LivePolicy(sqlite_store, source_settings=FAST)
    try:
        live.load()
        assert live.sources.report() == []
        assert "gh" not in live.policy.credentials  # type: ignore[union-attr]
    finally:
        live.close()


# Found by the hostile review, fixed: `credential list` (addon/cli/credentials.py _source_state)
# reads every row's reference, the mark never checked: a database writer makes the operator's
# CLI open any path (an ok/failing(malformed) oracle on files such as the master key; a FIFO
# hangs it)
def test_credential_list_does_not_read_an_unmarked_reference(
    sqlite_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from addon.cli import credentials as cli

    target = tmp_path / "master.key"
    target.write_bytes(b"no-colon-here")
    sqlite_store.add_credential("gh", "basic", ["api.github.com"], Secret(b"user:pass"))
    _forge(tmp_path, "gh", f"file:{target}", "fp-000000000000")
    opened: list[str] = []
    real_fetch = Files.fetch

    def spy(self: Files, ref: secretref.SecretRef) -> bytes:
        opened.append(ref.target)
        return real_fetch(self, ref)

    monkeypatch.setattr(Files, "fetch", spy)
    rows = [cli._credential_row(c) for c in sqlite_store.list_credentials()]
    # The content oracle: a basic secret needs a ':' -- `failing (malformed)` says there is none.
    assert rows[0]["source_state"] != "failing (malformed)"
    assert str(target) not in opened


# Found by the hostile review, fixed: the reference mark is key.fingerprint() of
# 'credproxy/secret-ref/NAME/REF', the very keyed fingerprint published for values (credential
# list, add's output, credential.rotated old_fp/new_fp): whoever gets a chosen value
# fingerprinted forges a mark, and a database writer points a credential at the proxy's key file
def test_a_published_fingerprint_is_never_a_valid_reference_mark(
    sqlite_store: Store, tmp_path: Path
) -> None:
    master_file = tmp_path / "master.key"
    master_file.write_bytes(b"THE-PROXY-MASTER-KEY")
    ref = f"file:{master_file}"
    # A value the attacker chose gets fingerprinted (here a sealed credential; equally a
    # Vault/AWS/file value whose rotation logs new_fp): the fingerprint is public.
    published = sqlite_store.add_credential(
        "oracle", "bearer", ["x.example"], Secret(f"credproxy/secret-ref/evil/{ref}".encode())
    )
    sqlite_store.add_principal("agent")
    sqlite_store.add_credential("evil", "bearer", ["attacker.example"], Secret(b"harmless"))
    gid = sqlite_store.add_grant("agent", ["GET"], credential="evil")
    _forge(tmp_path, "evil", ref, published)  # no master key used
    live = LivePolicy(sqlite_store, source_settings=FAST)
    try:
        live.load()
        leaked = None
        if live.policy is not None and live.policy.rule(gid) is not None:
            leaked = _stamped(live, gid)
        assert leaked != b"Bearer THE-PROXY-MASTER-KEY"
        assert "evil" not in [name for name, *_ in live.sources.report()]
    finally:
        live.close()


def test_master_key_rotation_carries_marks_and_drops_forged_ones(
    sqlite_store: Store, tmp_path: Path, key: MasterKey
) -> None:
    """Held: store/tables/keys.rotate re-marks a reference, and a forged one stays unread."""
    from store.tables import keys

    value = tmp_path / "v"
    value.write_bytes(b"good-value")
    sqlite_store.add_credential("ok", "bearer", ["a.example"], None, secret_ref=f"file:{value}")
    sqlite_store.add_credential("bad", "bearer", ["a.example"], Secret(b"x"))
    _forge(tmp_path, "bad", f"file:{value}", "fp-000000000000")
    new = MasterKey.generate("new")
    keys.rotate(sqlite_store.db, key, new)
    with _db(tmp_path) as db:
        marks = dict(db.execute("SELECT name, fingerprint FROM credentials").fetchall())
    assert marks["ok"] == secretref.mark(new, "ok", f"file:{value}")
    assert marks["bad"] != secretref.mark(new, "bad", f"file:{value}")


# -- promise 3: the failing path -------------------------------------------------------------------


# Found by the hostile review, fixed: Files.fetch open()s a FIFO (or a tty, a socket-backed
# /proc file) and blocks forever, unbounded: at start load() is synchronous, so the proxy never
# listens
def test_a_fifo_reference_is_never_read_forever(tmp_path: Path) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    ref = secretref.parse(f"file:{fifo}")
    result: list[object] = []

    def read() -> None:
        try:
            result.append(Files().fetch(ref))
        except SourceError as e:
            result.append(e.kind)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(1.0)
    hung = thread.is_alive()
    _unblock(fifo, thread)
    thread.join(2.0)
    assert not hung, "the reader thread was still blocked in open() after 1 s"


# Found by the hostile review, fixed: a file swapped for a FIFO hangs its read; the source keeps
# state ok, so its last value is stamped forever, past --secret-max-stale (a hung read is never
# failing)
def test_a_file_swapped_for_a_fifo_is_not_stamped_past_max_stale(
    sqlite_store: Store, kubelet: Kubelet
) -> None:
    gid = _seed(sqlite_store, f"file:{kubelet.path}")
    live = LivePolicy(sqlite_store, source_settings=SHORT)
    folder = kubelet.root / "..fifo"
    folder.mkdir()
    os.mkfifo(folder / "token")
    try:
        live.load()
        assert _stamped(live, gid) == b"Bearer gh-secret-one"

        async def swap() -> bool:
            task = asyncio.get_running_loop().create_task(live.sources.run())
            try:
                link = kubelet.root / "..data_tmp"
                link.symlink_to(folder.name)
                os.replace(link, kubelet.root / "..data")
                await asyncio.sleep(SHORT.max_stale * 4)
                return live.sources.count(OK) == 1
            finally:
                task.cancel()

        still_ok = asyncio.run(swap())
        assert not still_ok, "max-stale passed with no good read, and the value is still ok"
    finally:
        _unblock(folder / "token")
        live.close()


class _Hung:
    """A read that does not come back: a FIFO, or a remote backend slow to answer."""

    watched = False

    def __init__(self) -> None:
        self.release = threading.Event()

    def identity(self, ref: secretref.SecretRef) -> object:
        return None

    def fetch(self, ref: secretref.SecretRef) -> bytes:
        self.release.wait(30)
        raise SourceError("unavailable")


# Found by the hostile review, fixed: all sources share one pool of 4 threads: four hung reads
# (FIFOs, a slow Vault) stall every other source -- a deleted file is never seen failing, keeps
# being stamped past max-stale, and a rotation is never picked up
def test_hung_sources_do_not_stall_a_file_source(tmp_path: Path) -> None:
    value = tmp_path / "value"
    value.write_bytes(b"file-value")
    hung = _Hung()

    def backends() -> dict[str, Any]:
        return {"file": Files, "vault": lambda: hung}

    srcs = Sources(lambda s: "fp", SHORT, backends())
    records = [_record("file", f"file:{value}")]  # first: its first read gets a thread
    records += [_record(f"v{i}", f"vault:kv/app{i}#f") for i in range(4)]
    srcs.track(records)
    seen: list[str] = []

    async def run() -> None:
        task = asyncio.get_running_loop().create_task(srcs.run())
        try:
            await _until(lambda: srcs.count(OK) == 1, 2.0)  # the file, read once
            value.unlink()
            try:
                await _until(lambda: srcs.count(STALE) + srcs.count(OK) == 0, 2.0)
                seen.append("failing")
            except AssertionError:
                seen.append("stuck")
        finally:
            task.cancel()

    try:
        asyncio.run(run())
    finally:
        hung.release.set()
        srcs.close()
    assert seen == ["failing"]


# Found by the hostile review, fixed: remote._json_key catches ValueError only: a deeply nested
# SecretString (aws-sm:ID#KEY) raises RecursionError out of Source.check ('never raises')
def test_a_deeply_nested_json_value_is_a_source_error() -> None:
    with pytest.raises(SourceError):
        remote._json_key("[" * 200_000, "k")


class _Flaky:
    """A remote value that reads once, then makes its backend raise something unexpected."""

    watched = False

    def __init__(self) -> None:
        self.calls = 0

    def identity(self, ref: secretref.SecretRef) -> object:
        return None

    def fetch(self, ref: secretref.SecretRef) -> bytes:
        self.calls += 1
        if self.calls == 1:
            return b"first-value"
        return remote._json_key("[" * 200_000, "k")  # RecursionError


# Found by the hostile review, fixed: a read raising anything but SourceError/InvalidInput
# escapes Source.check; _finished_future dies in the loop callback, the source never settles,
# and its old value is stamped forever, past --secret-max-stale
def test_an_unexpected_exception_in_a_read_still_expires_the_value() -> None:
    flaky = _Flaky()
    srcs = Sources(lambda s: "fp", SHORT, {"aws-sm": lambda: flaky})
    srcs.track([_record("aws", "aws-sm:prod/app#k")])

    async def run() -> bool:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: None)
        task = loop.create_task(srcs.run())
        try:
            await _until(lambda: flaky.calls >= 1 and srcs.count(OK) == 1, 2.0)
            await asyncio.sleep(SHORT.max_stale * 4)
            return srcs.count(OK) + srcs.count(STALE) == 0
        finally:
            task.cancel()

    try:
        expired = asyncio.run(run())
    finally:
        srcs.close()
    assert flaky.calls > 2
    assert expired


def test_errors_and_reprs_never_carry_the_value(tmp_path: Path) -> None:
    """Held: a malformed value's class, the Source's repr and the report carry no value."""
    path = tmp_path / "v"
    path.write_bytes(b"user-without-colon-ZQ9SECVALUE")
    srcs = Sources(lambda s: "fp", SHORT)
    (source,) = srcs.track([_record("b", f"file:{path}", scheme="basic")])
    srcs.load([source])
    text = repr(source) + repr(srcs) + repr(srcs.report()) + repr(source.check())
    assert "ZQ9SECVALUE" not in text
    assert srcs.report()[0][2:] == (FAILING, "malformed")


# -- promise 4 and parse confusions ---------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "file:relative/ZQ9SEC",
        "file:/tmp/x/",
        "aws-sm:",
        "aws-sm:id#k#ZQ9SEC",
        "vault:kv#f",
        "vault:kv/../ZQ9SEC#f",
        "vault:kv/p",
        "nope:ZQ9SEC",
        "ZQ9SEC-ghp_abcdef",
        "file:/tmp/ZQ9SEC\nx",
        "x" * 3000,
    ],
)
def test_a_bad_reference_is_one_line_that_does_not_quote_it(text: str) -> None:
    with pytest.raises(InvalidInput) as e:
        secretref.parse(text)
    message = str(e.value)
    assert "\n" not in message and "ZQ9SEC" not in message and "x" * 20 not in message


# Found by the hostile review, fixed: `without controls` only means ASCII C0/DEL: C1 controls
# (\\x85 NEL, \\x9b CSI) and U+2028 pass, and `credential list`, `run`'s describe() line and the
# audit stream print the reference as it is (a line break, or a terminal escape, in one line)
@pytest.mark.parametrize("char", ["\x85", "\x9b", "\u2028"])
def test_a_reference_has_no_control_or_line_break(char: str) -> None:
    with pytest.raises(InvalidInput):
        secretref.parse(f"file:/var/run/secrets/tok{char}en")
