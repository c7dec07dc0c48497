"""Secrets held in files, resolved by the live policy: real files on disk, a kubelet-style
`..data` symlink swap, a deleted file going stale then failing. SQLite only: what is tested
here is the proxy's side; tests/store covers both databases."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from addon.core.policy import Rule, _rule
from addon.core.reasons import Reason
from addon.proxy import sources
from addon.proxy.live import LivePolicy
from addon.proxy.sourcekinds import Files
from addon.proxy.sources import FAILING, OK, STALE, SourceSettings
from addon.redaction.redactset import SETS
from addon.schemes.stamp import Refused
from addon.schemes.stamping import stamp_for
from store.crypto import MasterKey, Secret
from store.records import GrantRecord
from store.repository import Store
from store.rules import secretref
from store.rules.grammar import parse_host, parse_rate

FAST = SourceSettings(poll=0.02, ttl=0.05, max_stale=0.3, first_fetch=2.0, retry=0.02)


class Kubelet:
    """A Secret volume as kubelet writes it: `..<n>/` folders, `..data` -> the current one,
    and `token -> ..data/token`."""

    def __init__(self, root: Path) -> None:
        self.root, self.generation = root, 0
        self.write(b"gh-secret-one\n")
        (root / "token").symlink_to("..data/token")

    @property
    def path(self) -> Path:
        return self.root / "token"

    def write(self, value: bytes) -> None:
        self.generation += 1
        folder = self.root / f"..2024_01_01_00_00_0{self.generation}"
        folder.mkdir()
        (folder / "token").write_bytes(value)
        link = self.root / "..data_tmp"
        link.symlink_to(folder.name)
        os.replace(link, self.root / "..data")  # atomic, as kubelet swaps it


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


def _seed(store: Store, ref: str) -> int:
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], None, secret_ref=ref)
    return store.add_grant("agent", ["GET"], credential="gh", paths=["/repos/"])


def _stamped(live: LivePolicy, grant_id: int) -> bytes:
    """What the grant's credential would put on a request now."""
    policy = live.policy
    assert policy is not None
    rule = policy.rule(grant_id)
    assert rule is not None and rule.credential is not None
    stamp = stamp_for(policy, rule.credential)
    stamp.prepare(None, None, None, 0)  # type: ignore[arg-type]
    return dict(stamp.fields)[b"Authorization"]


async def _until(check: Any, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not within the time allowed"
        await asyncio.sleep(0.01)


def test_a_kubelet_swap_is_stamped_within_a_poll_and_the_old_value_stays_redacted(
    sqlite_store: Store, key: MasterKey, kubelet: Kubelet
) -> None:
    gid = _seed(sqlite_store, f"file:{kubelet.path}")
    live = LivePolicy(sqlite_store, source_settings=FAST)
    try:
        live.load()
        assert _stamped(live, gid) == b"Bearer gh-secret-one"
        first_fp = key.fingerprint(live.policy.credentials["gh"].secret)  # type: ignore[union-attr]
        assert live.policy.credentials["gh"].fingerprint == first_fp  # type: ignore[union-attr]

        async def rotate() -> list[dict[str, Any]]:
            task = asyncio.get_running_loop().create_task(live.sources.run())
            try:
                with capture_logs() as logs:
                    kubelet.write(b"gh-secret-two\n")
                    await _until(lambda: _stamped(live, gid) == b"Bearer gh-secret-two")
                return logs
            finally:
                task.cancel()

        logs = asyncio.run(rotate())
        (rotated,) = [line for line in logs if line["event"] == "credential.rotated"]
        new_fp = live.policy.credentials["gh"].fingerprint  # type: ignore[union-attr]
        assert (rotated["credential"], rotated["old_fp"], rotated["new_fp"]) == (
            "gh",
            first_fp,
            new_fp,
        )
        assert b"gh-secret" not in repr(logs).encode()
        # Both values are redacted: the new one, and the old one for the grace period.
        assert {b"gh-secret-one", b"gh-secret-two"} <= set(SETS.secrets("gh"))
    finally:
        live.close()


def test_a_deleted_file_serves_its_last_value_for_max_stale_then_refuses(
    sqlite_store: Store, kubelet: Kubelet
) -> None:
    gid = _seed(sqlite_store, f"file:{kubelet.path}")
    live = LivePolicy(sqlite_store, source_settings=FAST)
    try:
        live.load()

        async def outage() -> tuple[str, bytes, str]:
            task = asyncio.get_running_loop().create_task(live.sources.run())
            try:
                os.unlink(kubelet.root / "..data")
                await _until(lambda: live.sources.count(STALE) == 1)
                stale = (STALE, _stamped(live, gid))
                await _until(lambda: live.sources.count(FAILING) == 1)
                return (*stale, live.sources.report()[0][3] or "")
            finally:
                task.cancel()

        state, stamped, error = asyncio.run(outage())
        assert (state, stamped, error) == (STALE, b"Bearer gh-secret-one", "not-found")
        rule = live.policy.rule(gid)  # type: ignore[union-attr]
        assert rule is not None and rule.credential is not None
        with pytest.raises(Refused) as refused:
            stamp_for(live.policy, rule.credential).prepare(None, None, None, 0)  # type: ignore[arg-type]
        assert refused.value.reason == Reason.CREDENTIALS_UNAVAILABLE
        assert (live.sources.count(OK), live.sources.count(STALE)) == (0, 0)
    finally:
        live.close()


def test_a_file_missing_at_start_is_reported_and_refused_until_it_appears(
    sqlite_store: Store, tmp_path: Path
) -> None:
    path = tmp_path / "later"
    gid = _seed(sqlite_store, f"file:{path}")
    live = LivePolicy(sqlite_store, source_settings=FAST)
    try:
        live.load()
        (report,) = live.sources.report()
        assert report == ("gh", f"file:{path}", FAILING, "not-found")
        assert list(sources.describe([report])) == [
            f"credential gh: its secret at file:{path} is failing (not-found)"
        ]
        rule = live.policy.rule(gid)  # type: ignore[union-attr]
        assert rule is not None and rule.credential is not None
        assert not rule.credential.available

        async def appear() -> None:
            task = asyncio.get_running_loop().create_task(live.sources.run())
            try:
                path.write_bytes(b"late-value")
                await _until(lambda: live.sources.count(OK) == 1)
            finally:
                task.cancel()

        asyncio.run(appear())
        assert _stamped(live, gid) == b"Bearer late-value"
    finally:
        live.close()


@pytest.mark.parametrize(
    ("content", "error"),
    [
        pytest.param(b"", "empty", id="an empty file is failing, never an empty secret"),
        pytest.param(b"a\nb", "malformed", id="a value with a newline inside is malformed"),
        pytest.param(b"x" * (64 * 1024 + 1), "too-large", id="a value over 64 KiB is too large"),
    ],
)
def test_a_value_the_scheme_cannot_stamp_is_failing_and_classified(
    sqlite_store: Store, tmp_path: Path, content: bytes, error: str
) -> None:
    path = tmp_path / "value"
    path.write_bytes(content)
    _seed(sqlite_store, f"file:{path}")
    live = LivePolicy(sqlite_store, source_settings=FAST)
    try:
        with capture_logs() as logs:
            live.load()
        assert live.sources.report()[0][2:] == (FAILING, error)
        assert content[:8] not in repr(logs).encode() or not content
    finally:
        live.close()


def test_a_reference_added_while_running_is_read_before_its_grant_is_served(
    sqlite_store: Store, tmp_path: Path
) -> None:
    path = tmp_path / "value"
    path.write_bytes(b"added-later\n")
    sqlite_store.add_principal("agent")
    live = LivePolicy(sqlite_store, source_settings=FAST)
    try:
        live.load()
        sqlite_store.add_credential(
            "gh", "bearer", ["api.github.com"], None, secret_ref=f"file:{path}"
        )
        gid = sqlite_store.add_grant("agent", ["GET"], credential="gh")
        asyncio.run(live.poll())
        assert _stamped(live, gid) == b"Bearer added-later"
    finally:
        live.close()


def test_the_file_identity_follows_the_symlinks(kubelet: Kubelet) -> None:
    files = Files()
    from store.rules.secretref import parse

    ref = parse(f"file:{kubelet.path}")
    before = files.identity(ref)
    kubelet.write(b"gh-secret-two")
    assert files.identity(ref) != before
    assert files.fetch(ref) == b"gh-secret-two"


def test_a_rule_compiled_again_from_its_regrant_is_the_same_rule() -> None:
    """bind() rebuilds a referenced credential's rules from the rules themselves: every field
    of a Rule must come back (a field added to Rule and not to regrant fails here)."""
    grant = GrantRecord(
        id=7,
        principal="agent",
        credential="gh",
        hosts=(parse_host("api.github.com"),),
        methods=frozenset({"GET"}),
        paths=("/repos/",),
        once=True,
        websocket=True,
        expires_at=datetime(2030, 1, 1, tzinfo=UTC),
        consumed=True,
        encoded_slash=True,
        rate=parse_rate("10/m"),
        burst=3,
        max_uses=5,
        approval="each",
        hold=30,
        body=None,
    )
    credential: Any = dataclasses.make_dataclass("C", [("name", str)])("gh")
    rule = _rule(grant, credential)
    assert _rule(sources.regrant(rule, "agent"), credential) == rule
    assert {f.name for f in dataclasses.fields(Rule)} == {
        f.name for f in dataclasses.fields(GrantRecord) if f.name not in ("id", "principal")
    } | {"grant_id"}


def test_a_rotation_never_brings_back_a_grant_revoked_meanwhile(
    sqlite_store: Store, kubelet: Kubelet
) -> None:
    gid = _seed(sqlite_store, f"file:{kubelet.path}")
    kept = sqlite_store.add_grant("agent", ["POST"], credential="gh")
    live = LivePolicy(sqlite_store, source_settings=FAST)
    try:
        live.load()
        sqlite_store.revoke_grant(gid)

        async def revoke_then_rotate() -> None:
            await live.poll()
            task = asyncio.get_running_loop().create_task(live.sources.run())
            try:
                kubelet.write(b"gh-secret-two")
                await _until(lambda: _stamped(live, kept) == b"Bearer gh-secret-two")
            finally:
                task.cancel()

        asyncio.run(revoke_then_rotate())
        assert live.policy is not None and live.policy.rule(gid) is None
    finally:
        live.close()


class Polled:
    """A remote backend's shape over a file: never watched, fetched again every TTL."""

    watched = False

    def identity(self, ref: secretref.SecretRef) -> object:
        return None

    def fetch(self, ref: secretref.SecretRef) -> bytes:
        return Path(ref.target).read_bytes()


@pytest.mark.parametrize("backend", [Polled, Files], ids=["a remote source", "a file"])
def test_a_master_key_rotation_fingerprints_a_held_value_under_the_new_key_and_is_no_rotation(
    tmp_path: Path, sqlite_store: Store, key: MasterKey, backend: Any
) -> None:
    held = tmp_path / "held"
    held.write_bytes(b"gh-secret-one")
    gid = _seed(sqlite_store, f"file:{held}")
    new, on_disk = MasterKey.generate("new"), [key]
    replica = Store(f"sqlite:///{tmp_path}/t.db", key)
    live = LivePolicy(replica, source_settings=FAST, reload_key=lambda: on_disk[0])
    live.sources._makers[secretref.FILE] = backend
    try:
        live.load()
        sqlite_store.rotate_key(new)
        on_disk[0] = new

        async def after_the_key_rotation() -> list[dict[str, Any]]:
            with capture_logs() as logs:
                await live.poll()
                task = asyncio.get_running_loop().create_task(live.sources.run())
                try:
                    await asyncio.sleep(5 * FAST.ttl)  # several fetches of the remote value
                finally:
                    task.cancel()
            return logs

        logs = asyncio.run(after_the_key_rotation())
        assert [line for line in logs if line["event"] == "credential.rotated"] == []
        assert _stamped(live, gid) == b"Bearer gh-secret-one"
        credential = live.policy.credentials["gh"]  # type: ignore[union-attr]
        assert credential.fingerprint == new.fingerprint(Secret(b"gh-secret-one"))
    finally:
        live.close()
        replica.close()
