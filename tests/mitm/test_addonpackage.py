"""mitmproxy's addons package without its __init__: the seven addons load, and anything else
asked of the package runs the file then, so a DumpMaster in the same process still works."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from addon.mitm import addonpackage
installed = addonpackage.defer()
from addon.runtime import master
before = "mitmproxy.addons.onboarding" in sys.modules
from mitmproxy.addons import default_addons
print(json.dumps({
    "installed": installed,
    "again": addonpackage.defer(),
    "onboarding_before": before,
    "defaults": len(default_addons()),
}))
"""


def test_the_package_loads_its_init_only_when_a_name_of_it_is_asked() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    found = json.loads(done.stdout)
    assert found == {
        "installed": True,
        "again": False,
        "onboarding_before": False,
        "defaults": found["defaults"],
    }
    assert found["defaults"] > 30  # mitmdump's addons, as without the install
