"""The chain: every hook of every addon is called, in the runner's order, waiting when asked."""

from __future__ import annotations

import asyncio
from typing import Any

from mitmproxy import hooks

from addon.proxy.chain import Chain
from tests.fakes import Chain as FakeChain
from tests.fakes import StaticLive, make_policy


class Recorder:
    def __init__(self, name: str, calls: list[str], wait: bool = False) -> None:
        self.name, self.calls, self.wait = name, calls, wait

    def requestheaders(self, flow: Any) -> Any:
        if not self.wait:
            self.calls.append(self.name)
            return None

        async def later() -> None:
            await asyncio.sleep(0)
            self.calls.append(self.name)

        return later()


def test_a_hook_runs_on_each_addon_in_order_without_waiting() -> None:
    calls: list[str] = []
    chain = Chain([Recorder("a", calls), Recorder("b", calls)])
    assert chain.requestheaders(object()) is None  # type: ignore[attr-defined]
    assert calls == ["a", "b"]


async def test_an_addon_that_waits_holds_back_the_ones_after_it() -> None:
    calls: list[str] = []
    chain = Chain([Recorder("a", calls), Recorder("b", calls, wait=True), Recorder("c", calls)])
    pending = chain.requestheaders(object())  # type: ignore[attr-defined]
    assert calls == ["a"]
    await pending
    assert calls == ["a", "b", "c"]


def test_a_hook_no_addon_has_is_not_there() -> None:
    chain = Chain([Recorder("a", [])])
    assert not hasattr(chain, "response") and not hasattr(chain, "addons")


def test_every_hook_of_every_addon_of_the_runner_is_dispatched() -> None:
    entry = FakeChain(StaticLive(make_policy())).entry
    for part in entry.parts:
        for name in dir(type(part)):
            if name in hooks.all_hooks:
                dispatched = getattr(entry, name)
                own = getattr(part, name)
                funcs = getattr(dispatched, "__closure__", None) or ()
                found = own == dispatched or any(
                    own in cell.cell_contents
                    for cell in funcs
                    if isinstance(cell.cell_contents, tuple)
                )
                assert found, f"{type(part).__name__}.{name} is not called"
