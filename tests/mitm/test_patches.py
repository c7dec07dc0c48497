"""addon/mitm/: one way to install a patch of mitmproxy, and every patch installed by it."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import addon.mitm
from addon.mitm import once, patches
from addon.proxy import signing


def _install(module: str, calls: list[str], fail: bool = False):  # type: ignore[no-untyped-def]
    def install() -> None:
        calls.append(module)
        if fail:
            raise RuntimeError("mitmproxy changed: Something.method")

    install.__module__ = module
    return install


def test_an_install_runs_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(addon.mitm, "_installed", {})
    calls: list[str] = []
    install = once(_install("fake.patch", calls))
    install()
    install()
    assert calls == ["fake.patch"]
    assert addon.mitm.installed() == ("fake.patch",)


def test_an_install_that_raised_is_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(addon.mitm, "_installed", {})
    calls: list[str] = []
    install = once(_install("fake.changed", calls, fail=True))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="mitmproxy changed"):
            install()
    assert calls == ["fake.changed", "fake.changed"]
    assert addon.mitm.installed() == ()


def test_install_all_installs_each_patch_in_order_then_those_above(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    for module in patches.ORDER:
        monkeypatch.setattr(module, "install", lambda name=module.__name__: calls.append(name))
    patches.install_all(lambda: calls.append("above"))
    assert calls == [m.__name__ for m in patches.ORDER] + ["above"]
    # Where two wrap one function, the later wraps the earlier: reuse dials what it may,
    # connects' wrapper answers the rest; bounds wraps three functions wire replaced.
    assert calls.index("addon.mitm.connects") < calls.index("addon.mitm.reuse")
    assert calls.index("addon.mitm.wire") < calls.index("addon.mitm.bounds")


def test_install_all_installs_them_for_real_and_once() -> None:
    patches.install_all(signing.install)
    done = addon.mitm.installed()
    patches.install_all(signing.install)
    assert addon.mitm.installed() == done
    assert {m.__name__ for m in patches.ORDER} | {signing.__name__} <= set(done)


def test_every_module_with_an_install_is_a_patch_installed_once() -> None:
    found = []
    for info in pkgutil.iter_modules(addon.mitm.__path__, "addon.mitm."):
        module = importlib.import_module(info.name)
        if hasattr(module, "install"):
            found.append(module)
            assert hasattr(module.install, "__wrapped__"), f"{info.name}.install lacks @once"
            assert module.__doc__ and "mitmproxy" in module.__doc__, info.name
    assert sorted(m.__name__ for m in found) == sorted(m.__name__ for m in patches.ORDER)
    assert hasattr(signing.install, "__wrapped__")
