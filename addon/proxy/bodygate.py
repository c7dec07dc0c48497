"""Grants that decide on the body (GraphQL, MCP, JSON-RPC) or rewrite it: hold it, then forward.

When the verdict leaves the choice of grant to the body (`Verdict.pending`), or its grant caps
a model call's max_tokens (`--cap-max-tokens`, addon/core/capping.py), nothing is stamped,
spent or sent at `requestheaders`: the body is held whole, bounded as a body held for signing
is (addon/proxy/signing.py: the same patch, the same process budget), and the step waits
here. In `request`, with the body whole, the first pending grant whose rule allows the body is
chosen (a grant without one allows any body) and Forward runs as it would have at
`requestheaders` (capping the body, for a grant that caps); if none allows it, the request is
refused with the first grant's reason.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

from mitmproxy import http

from addon.core import bodies
from addon.core.bodies import MAX_DECIDED_BODY, BodyDecision
from addon.core.capping import MAX_CAPPED_BODY
from addon.core.policy import Rule
from addon.core.reasons import Reason
from addon.proxy import mcpanswers, signing
from addon.proxy.failclosed import Denied, deny_on_error
from addon.proxy.state import KEY, STEPS, Record, Step
from addon.proxy.trail import Trail

TOO_LARGE = f"a body its grant decides is limited to {MAX_DECIDED_BODY} bytes"
CAP_TOO_LARGE = f"a body its grant caps max_tokens of is limited to {MAX_CAPPED_BODY} bytes"
# Bodies larger than this are decided in a thread (a 2 KiB query takes well under 0.1 ms).
OFF_LOOP = 16 * 1024


class _Forwards(Protocol):
    def requestheaders(self, flow: http.HTTPFlow) -> Awaitable[None] | None: ...


# Steps waiting for their body, beside the flow (a step may hold secrets: never in metadata).
WAITING: weakref.WeakKeyDictionary[http.HTTPFlow, Step] = weakref.WeakKeyDictionary()


class BodyGate:
    def __init__(
        self,
        forward: _Forwards,
        trail: Trail,
        limit: int = MAX_DECIDED_BODY,
        capped: int = MAX_CAPPED_BODY,
    ) -> None:
        self.forward = forward
        self.trail = trail
        self.limit = limit
        self.capped = capped  # the bound of a body held only to be capped

    @deny_on_error
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        step = STEPS.get(flow)
        if step is None or step.verdict is None:
            return
        v = step.verdict
        if v.pending:
            limit, detail = self.limit, TOO_LARGE
        elif v.rule is not None and v.rule.budget is not None and v.rule.budget.cap:
            limit, detail = self.capped, CAP_TOO_LARGE
        else:
            return
        del STEPS[flow]  # Forward sees nothing now; it runs in `request`
        if flow.error is not None:
            return  # mitmproxy refused it already and answers itself
        length = flow.request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise Denied(Reason.BODY_TOO_LARGE, detail)
        WAITING[flow] = step

        def refuse(held: http.HTTPFlow) -> None:
            WAITING.pop(held, None)
            self.trail.deny(held, Reason.BODY_TOO_LARGE, detail)

        signing.hold(flow, limit, refuse)

    @deny_on_error
    def request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        step = WAITING.pop(flow, None)
        if step is None:
            return None
        signing.release(flow)
        if flow.response is not None:
            return None
        v = step.verdict
        assert v is not None and v.method is not None
        if not v.pending:
            return self._decided(flow, step, (v.rule, None))  # held to be capped
        asked = Asked.of(flow.request)
        if len(asked.body) > OFF_LOOP:
            # A large document costs milliseconds to parse: decided in a thread, so one
            # agent's body does not stall every other connection of the event loop.
            return self._off_loop(flow, step, asked)
        return self._decided(flow, step, choose(v.pending, v.method, asked))

    async def _off_loop(self, flow: http.HTTPFlow, step: Step, asked: Asked) -> None:
        v = step.verdict
        assert v is not None and v.method is not None
        decided = await asyncio.to_thread(choose, v.pending, v.method, asked)
        forwarding = self._decided(flow, step, decided)
        if forwarding is not None:
            await forwarding

    def _decided(
        self,
        flow: http.HTTPFlow,
        step: Step,
        decided: tuple[Rule | None, BodyDecision | None],
    ) -> Awaitable[None] | None:
        v = step.verdict
        assert v is not None
        chosen, decision = decided
        rec: Record | None = flow.metadata.get(KEY)
        if rec is not None:
            rec.bytes_out = len(flow.request.raw_content or b"")  # held whole, sent whole
            if decision is not None:
                rec.body = decision.summary
        if chosen is None:
            assert decision is not None and decision.reason is not None
            raise Denied(decision.reason, decision.detail)
        if chosen.body is not None and chosen.body.mcp is not None:
            mcpanswers.FILTERS[flow] = chosen.body.mcp  # tools/list shows the granted tools
        step.verdict = v._replace(rule=chosen, pending=())
        STEPS[flow] = step
        return self.forward.requestheaders(flow)


@dataclass(frozen=True, slots=True)
class Asked:
    """What a body rule reads of a request, as plain values (a thread may read them)."""

    target: bytes
    types: tuple[str, ...]
    codings: tuple[str, ...]
    body: bytes

    @classmethod
    def of(cls, request: http.Request) -> Asked:
        return cls(
            request.data.path,
            tuple(request.headers.get_all("content-type")),
            tuple(request.headers.get_all("content-encoding")),
            request.raw_content or b"",
        )


def choose(
    pending: tuple[Rule, ...], method: str, asked: Asked
) -> tuple[Rule | None, BodyDecision | None]:
    """The first rule that allows the body, and its decision (None for a rule without a body
    rule); or None and the first refusal."""
    refused: BodyDecision | None = None
    types, codings, body = asked.types, asked.codings, asked.body
    for rule in pending:
        if rule.body is None:
            return rule, None
        if len(types) > 1 or len(codings) > 1:
            detail = "more than one Content-Type or Content-Encoding field"
            decision = BodyDecision(False, Reason.BODY_UNDECIDABLE, detail, {})
        else:
            decision = bodies.decide(
                rule.body,
                method,
                asked.target,
                types[0] if types else None,
                codings[0] if codings else None,
                body,
            )
        if decision.allowed:
            return rule, decision
        refused = refused or decision
    return None, refused
