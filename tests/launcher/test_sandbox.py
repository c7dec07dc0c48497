"""The sandbox's file-system view: what is hidden, and what no option may expose."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from addon.launcher import sandbox
from store.errors import InvalidInput
from store.settings import Settings


def _settings(home: Path, db: str | None = None) -> Settings:
    return Settings(
        db=db or f"sqlite:///{home}/credproxy.db",
        key_file=home / "credproxy.key",
        certs=home / "certs",
        advertise="127.0.0.1:8080",
        json=False,
    )


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / "certs").mkdir(parents=True)
    for name in ("credproxy.db", "credproxy.db-wal", "credproxy.key", "notes.txt"):
        (home / name).write_text("x")
    (home / "certs" / "credproxy-ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (home / "certs" / "mitmproxy-ca.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    (home / "tools").mkdir()
    (home / "link").symlink_to("tools")
    (tmp_path / "work").mkdir()
    return home


def test_the_state_and_the_database_sockets_are_hidden(home: Path) -> None:
    hidden = sandbox.state_paths(_settings(home))
    assert {home / "credproxy.key", home / "certs", home / "credproxy.db"} <= hidden
    assert {home / "credproxy.db-wal", home / "credproxy.db-journal"} <= hidden
    assert Path("/run/postgresql") in hidden


def test_a_server_stores_socket_folder_is_hidden(home: Path) -> None:
    url = "postgresql+psycopg://u@/credproxy?host=/srv/pg/sockets"
    assert Path("/srv/pg/sockets") in sandbox.state_paths(_settings(home, url))


def test_a_folder_holding_state_is_shown_entry_by_entry_without_it(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "MASKED", (Path("/run"),))  # the test's home is under /tmp
    view = sandbox.view(_settings(home), home.parent / "work")
    args = sandbox.arguments(view)
    text = " ".join(args)
    for name in ("credproxy.key", "credproxy.db", "credproxy.db-wal", "certs"):
        assert str(home / name) not in args, name
    assert ["--ro-bind-try", str(home / "notes.txt"), str(home / "notes.txt")] == args[
        args.index(str(home / "notes.txt")) - 1 : args.index(str(home / "notes.txt")) + 2
    ]
    assert f"--symlink tools {home / 'link'}" in text
    # Shown as a listing made read-only, so nothing written there later appears.
    assert f"--remount-ro {home}" in text
    assert args[-2:] == ["--chdir", str(home.parent / "work")]
    assert "--tmpfs /run" in text


def test_the_public_ca_is_shown_by_itself_and_a_private_key_never(home: Path) -> None:
    view = sandbox.view(_settings(home), home.parent / "work")
    shown = sandbox.shown(view, [home / "certs" / "credproxy-ca.pem"])
    assert str(home / "certs" / "credproxy-ca.pem") in sandbox.arguments(shown)
    with pytest.raises(InvalidInput, match="private key"):
        sandbox.shown(view, [home / "certs" / "mitmproxy-ca.pem"])


@pytest.mark.parametrize(
    "where",
    [
        pytest.param("home", id="the working directory holds the state"),
        pytest.param("parent", id="the working directory holds the state further down"),
        pytest.param("certs", id="the working directory is inside the CA folder"),
    ],
)
def test_a_writable_working_directory_may_not_hold_state(home: Path, where: str) -> None:
    workdir = {"home": home, "parent": home.parent, "certs": home / "certs"}[where]
    with pytest.raises(InvalidInput, match="holds credproxy's state"):
        sandbox.view(_settings(home), workdir)


@pytest.mark.parametrize("option", ["read_write", "read_only", "via a symlink"])
def test_no_option_exposes_the_hidden_set(home: Path, option: str) -> None:
    work = home.parent / "work"
    if option == "via a symlink":
        (home.parent / "alias").symlink_to(home / "certs")
        with pytest.raises(InvalidInput):
            sandbox.view(_settings(home), work, read_only=[home.parent / "alias"])
        return
    for path in (home, home / "certs", home / "credproxy.key"):
        with pytest.raises(InvalidInput):
            sandbox.view(_settings(home), work, **{option: [path]})


def test_hide_adds_to_the_hidden_set(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "MASKED", ())
    view = sandbox.view(_settings(home), home.parent / "work", hide=[home / "notes.txt"])
    args = sandbox.arguments(view)
    assert str(home / "notes.txt") not in args and str(home / "tools") in args


def test_a_missing_bwrap_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", os.devnull)
    with pytest.raises(sandbox.IsolationUnavailable, match="bubblewrap"):
        sandbox.bwrap()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_checked_folder_is_the_one_mounted_even_if_its_name_is_swapped(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second sandbox that can write the working directory's parent swaps it for a
    symlink to the state between the check and the mount: the mount is still the folder
    that was checked, held open since (/proc/self/fd/N)."""
    monkeypatch.setattr(sandbox, "MASKED", ())
    work = home.parent / "other" / "work"
    work.mkdir(parents=True)
    (work / "mine").write_text("checked")
    view = sandbox.view(_settings(home), work)
    try:
        work.rename(work.parent / "moved")
        work.symlink_to("../home")
        args = [*sandbox.arguments(view), "--unshare-all", "sh", "-c", "cat mine; ls"]
        done = subprocess.run(
            ["bwrap", *args], pass_fds=view.fds(), capture_output=True, text=True, timeout=30
        )
    finally:
        sandbox.release_fds(view.fds())
    # The swapped name is a symlink where the folder was: bubblewrap either mounts the
    # checked folder or refuses to start. Never the state.
    assert "credproxy.key" not in done.stdout
    assert done.stdout.startswith("checked") or done.returncode != 0, done.stderr


def test_a_key_with_a_second_name_is_refused(home: Path) -> None:
    (home.parent / "elsewhere.key").hardlink_to(home / "credproxy.key")
    with pytest.raises(InvalidInput, match="hard link"):
        sandbox.view(_settings(home), home.parent / "work")


def test_files_named_after_a_hidden_one_are_hidden_too(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the proxy writes beside its state while the sandbox starts: the next key of a
    rotation and its temporary file, the refresh lock, a journal."""
    monkeypatch.setattr(sandbox, "MASKED", ())
    kin = ["credproxy.key.new", ".credproxy.key.1a2b.tmp", "credproxy.db.exchange-lock"]
    for name in kin:
        (home / name).write_text("x")
    args = sandbox.arguments(sandbox.view(_settings(home), home.parent / "work"))
    assert [n for n in kin if str(home / n) in args] == []
    assert str(home / "notes.txt") in args


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_root_of_the_sandbox_takes_no_new_files(home: Path) -> None:
    view = sandbox.view(_settings(home), home.parent / "work")
    try:
        args = [*sandbox.arguments(view), "--unshare-all", "sh", "-c", "touch /x"]
        done = subprocess.run(
            ["bwrap", *args], pass_fds=view.fds(), capture_output=True, text=True, timeout=30
        )
    finally:
        sandbox.release_fds(view.fds())
    assert done.returncode != 0 and "Read-only" in done.stderr, done.stderr


def test_the_backends_login_files_that_exist_are_hidden_as_named_and_resolved(tmp_path):
    from addon.launcher.sandbox import backend_files

    real = tmp_path / "token"
    real.write_text("hvs.x")
    link = tmp_path / "link"
    link.symlink_to(real)
    found = backend_files({"VAULT_TOKEN_FILE": str(link), "VAULT_K8S_TOKEN_FILE": "/nonexistent"})
    assert {link, real} <= found and Path("/nonexistent") not in found
