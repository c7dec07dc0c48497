"""Whether CMD's user could open credproxy's secrets, by mode bits; and the switch to it."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from addon.launcher import runas
from store.settings import Settings

NOBODY = runas.User("nobody", 65534, 65534, frozenset({65534}), "/nonexistent")


def _settings(home: Path) -> Settings:
    return Settings(
        db=f"sqlite:///{home}/credproxy.db",
        key_file=home / "credproxy.key",
        certs=home / "certs",
        advertise="127.0.0.1:8080",
        json=False,
    )


@pytest.fixture
def home() -> Iterator[Path]:
    """A folder others can search (pytest's own temporary folders are closed to them)."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:  # noqa: S108
        yield _home(Path(tmp))


def _home(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    (tmp_path / "certs").mkdir(mode=0o755)
    (tmp_path / "certs" / "mitmproxy-ca.pem").write_text("k")
    (tmp_path / "certs" / "mitmproxy-ca.pem").chmod(0o600)
    (tmp_path / "credproxy.key").write_text("k")
    (tmp_path / "credproxy.key").chmod(0o600)
    (tmp_path / "credproxy.db").write_text("")
    (tmp_path / "credproxy.db").chmod(0o644)
    return tmp_path


def _reachable(path: Path) -> None:
    for folder in path.parents:
        if folder.stat().st_mode & 0o001 == 0:
            pytest.skip(f"{folder} is not searchable by others here")


def test_a_private_state_is_not_exposed_to_another_user(home: Path) -> None:
    _reachable(home)
    assert runas.exposed_state(_settings(home), NOBODY) is None


@pytest.mark.parametrize(
    ("path", "mode", "says"),
    [
        pytest.param("credproxy.key", 0o644, "read the master key", id="a world-readable key"),
        pytest.param("certs/mitmproxy-ca.pem", 0o644, "CA's private key", id="a readable CA"),
        pytest.param("credproxy.db", 0o666, "change the store", id="a world-writable store"),
        pytest.param(".", 0o777, "change the store (its folder)", id="a writable folder"),
    ],
)
def test_what_another_user_could_open_is_named(home: Path, path: str, mode: int, says: str):
    _reachable(home)
    (home / path).chmod(mode)
    exposed = runas.exposed_state(_settings(home), NOBODY)
    assert exposed is not None and says in exposed


def test_a_folder_closed_to_the_user_protects_what_is_in_it(home: Path) -> None:
    _reachable(home)
    (home / "credproxy.key").chmod(0o644)
    home.chmod(0o700)
    assert runas.exposed_state(_settings(home), NOBODY) is None


def test_root_can_open_everything(home: Path) -> None:
    root = runas.User("root", 0, 0, frozenset({0}), "/root")
    assert "master key" in (runas.exposed_state(_settings(home), root) or "")


def test_the_switch_drops_every_capability_and_privilege() -> None:
    prefix = runas.switch(NOBODY)
    assert "--reuid=65534" in prefix and "--regid=65534" in prefix
    assert {"--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"} <= set(prefix)
    assert prefix[-1] == "--"


def test_a_secret_file_a_credential_references_is_state_too(home: Path) -> None:
    """A credential's `file:` reference names a secret: CMD's user may not read it, and
    --isolate hides it (with a mounted Secret's whole folder)."""
    from addon.launcher import sandbox
    from store.crypto import MasterKey
    from store.repository import Store

    _reachable(home)
    mounted = home / "gh"
    (mounted / "..data").mkdir(parents=True)
    (mounted / "..data" / "token").write_text("gh-secret")
    (mounted / "token").symlink_to("..data/token")
    for folder in (mounted, mounted / "..data"):
        folder.chmod(0o755)
    (home / "credproxy.db").unlink()
    settings = _settings(home)
    store = Store(settings.db, MasterKey.generate("test"), create=True)
    store.migrate()
    store.add_credential("gh", "bearer", ["api.test"], None, secret_ref=f"file:{mounted}/token")
    store.close()
    (home / "credproxy.db").chmod(0o644)
    found = sandbox.referenced_files(settings)
    assert {mounted / "token", mounted, (mounted / "..data" / "token").resolve()} <= found
    assert mounted in sandbox.state_paths(settings)
    (mounted / "..data" / "token").chmod(0o644)  # readable by anyone: refused
    assert "secret file" in (runas.exposed_state(settings, NOBODY) or "")
    (mounted / "..data" / "token").chmod(0o600)
    assert runas.exposed_state(settings, NOBODY) is None
