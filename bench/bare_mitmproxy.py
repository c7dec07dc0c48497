"""Bare mitmproxy, embedded with no addon of ours.

`python -m bench.bare_mitmproxy CONFDIR TRUST_BUNDLE OPTIONS_JSON [lean]` prints a
`proxy.started` JSON line with the listening address, like credproxy, then serves until
SIGTERM. The caller passes credproxy's REQUIRED_OPTIONS and trust bundle. By default it is
mitmdump's master with its 34 addons (`mitmproxy`: what a user of mitmproxy runs, the
reference of the targets), importing only mitmproxy, so its start-up is mitmproxy's own. With
`lean` it is the master `credproxy run` builds (`addon.master`: mitmproxy's serving addons
only) without credproxy's addons (`mitmproxy-lean`: what credproxy's own work costs).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any


async def main(confdir: str, trust_bundle: str, required: dict[str, Any], lean: bool) -> None:
    master: Any
    if lean:
        from addon.runtime.master import build

        master = build()
        required = {name: value for name, value in required.items() if name in master.options}
    else:
        from mitmproxy import options
        from mitmproxy.tools.dump import DumpMaster

        master = DumpMaster(options.Options(), with_termlog=False, with_dumper=False)
    # The options addon.runner.serve sets, so the only difference is credproxy's addons.
    master.options.update(
        listen_host="127.0.0.1",
        listen_port=0,
        confdir=confdir,
        block_global=False,
        http2=True,
        websocket=True,
        ssl_verify_upstream_trusted_ca=trust_bundle,
        **required,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, master.shutdown)

    async def announce() -> None:
        proxyserver: Any = master.addons.get("proxyserver")
        while not proxyserver.listen_addrs():
            await asyncio.sleep(0.02)
        addrs = [f"{a[0]}:{a[1]}" for a in proxyserver.listen_addrs()]
        print(json.dumps({"event": "proxy.started", "listen": addrs, "pid": os.getpid()}))
        sys.stdout.flush()

    announcer = loop.create_task(announce())
    try:
        await master.run()
    finally:
        announcer.cancel()


if __name__ == "__main__":
    lean = sys.argv[4:] == ["lean"]
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), lean))
