"""Bare mitmproxy, embedded the way `credproxy run` embeds it, with no addon of ours.

`python -m bench.bare_mitmproxy CONFDIR TRUST_BUNDLE OPTIONS_JSON` prints a `proxy.started`
JSON line with the listening address, like credproxy, then serves until SIGTERM. The caller
passes credproxy's REQUIRED_OPTIONS and trust bundle, so that this process imports only
mitmproxy and its start-up is mitmproxy's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any


async def main(confdir: str, trust_bundle: str, required: dict[str, Any]) -> None:
    from mitmproxy import options
    from mitmproxy.tools.dump import DumpMaster

    master = DumpMaster(options.Options(), with_termlog=False, with_dumper=False)
    # The options addon.runner.serve sets, so the only difference is credproxy's addon.
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
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
