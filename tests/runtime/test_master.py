"""addon.runtime.master: the Master credproxy embeds holds mitmproxy's serving addons and no others,
and the options credproxy requires cannot be changed on it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from mitmproxy import exceptions

from addon.proxy.chain import REQUIRED_OPTIONS, Lifecycle
from addon.runtime.master import build


@pytest.fixture(autouse=True)
def _ctx_restored() -> Any:
    """A Master binds itself into mitmproxy's ctx and stays there: later modules' tests (an
    HTTP/2 hold asks ctx.master for its connection, tests/proxy/test_approval.py) would see
    this module's idle master, whose connections are gone."""
    from mitmproxy import ctx

    saved = {name: getattr(ctx, name, None) for name in ("master", "options", "log")}
    yield
    for name, value in saved.items():
        if value is None:
            if hasattr(ctx, name):
                delattr(ctx, name)
        else:
            setattr(ctx, name, value)


SERVING = ["Core", "Block", "DisableH2C", "Proxyserver", "NextLayer", "TlsConfig", "ErrorCheck"]


def _on_a_loop(check: Any) -> None:
    async def run() -> None:
        check(build())

    asyncio.run(run())


def test_only_the_serving_addons_are_loaded() -> None:
    def check(master: Any) -> None:
        assert [type(a).__name__ for a in master.addons.chain] == SERVING

    _on_a_loop(check)


@pytest.mark.parametrize(
    "option",
    # onboarding pages, proxy authentication, scripts, rewriting, replay, saving, cookies
    [
        "onboarding",
        "proxyauth",
        "scripts",
        "map_remote",
        "modify_headers",
        "server_replay",
        "save_stream_file",
        "stickycookie",
        "upstream_auth",
    ],
)
def test_options_of_addons_not_loaded_do_not_exist(option: str) -> None:
    def check(master: Any) -> None:
        assert option not in master.options
        with pytest.raises(KeyError):
            master.options.update(**{option: None})

    _on_a_loop(check)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("connection_strategy", "eager"),
        ("rawtcp", True),
        ("http3", True),
        ("ssl_insecure", True),
        ("ignore_hosts", [".*"]),
        ("validate_inbound_headers", False),
    ],
)
def test_a_required_option_cannot_be_changed(option: str, value: object) -> None:
    def check(master: Any) -> None:
        master.options.update(**{k: v for k, v in REQUIRED_OPTIONS.items() if k in master.options})
        master.addons.add(Lifecycle(live=None))  # type: ignore[arg-type] - configure only
        with pytest.raises(exceptions.OptionsError, match=f"credproxy requires {option}="):
            master.options.update(**{option: value})
        assert getattr(master.options, option) == REQUIRED_OPTIONS[option]

    _on_a_loop(check)
