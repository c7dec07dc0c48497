"""Replaces running `mitmproxy/addons/__init__.py` (mitmproxy 11 and 12) in `credproxy run`.

That file imports every one of mitmproxy's 34 addons to build `default_addons()`, and with them
Flask, Werkzeug, Jinja2, ldap3 and passlib (the onboarding page, proxyauth): about 16 MiB
resident and 320 modules, where credproxy's master (addon/runtime/master.py) loads seven addons
and never calls `default_addons()`. No hook runs before imports, so `defer()`, called before
the proxy's modules are imported, puts the package in `sys.modules` without running that file:
its submodules import as usual, and the first other name asked of it (`default_addons`, by a
DumpMaster in the same process) runs the file then, so nothing that needs it sees a difference.
Where the package is already imported, or is no longer a package with an `__init__.py`, it
does nothing: a memory saving, not a check.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

PACKAGE = "mitmproxy.addons"


def defer() -> bool:
    """Whether the package now stands in `sys.modules` with its `__init__.py` not run yet."""
    if PACKAGE in sys.modules:
        return False
    import mitmproxy

    spec = importlib.util.find_spec(PACKAGE)
    if (
        spec is None
        or spec.origin is None
        or not spec.origin.endswith("__init__.py")
        or spec.submodule_search_locations is None
    ):
        return False
    package = importlib.util.module_from_spec(spec)
    package.__getattr__ = _full(package)  # type: ignore[method-assign]
    sys.modules[PACKAGE] = package
    mitmproxy.addons = package  # type: ignore[attr-defined]
    return True


def _full(package: ModuleType) -> Any:
    def getattr_(name: str) -> Any:
        # A submodule not imported yet: the import system imports it once told it is missing.
        if name.startswith("__") or importlib.util.find_spec(f"{PACKAGE}.{name}") is not None:
            raise AttributeError(name)
        del package.__dict__["__getattr__"]
        spec = package.__spec__
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(package)
        return getattr(package, name)

    return getattr_
