"""The audit trail: each flow's record, its one audit line, metrics, alerts, deny answers."""

from __future__ import annotations

import time
from typing import Any

from mitmproxy import flow as mflow
from mitmproxy import http

from addon.core.reasons import Reason
from addon.mitm import wire
from addon.observe import audit
from addon.observe.metrics import Metrics, StreakAlerts
from addon.observe.problem import CHALLENGED, problem
from addon.observe.recent import Recent
from addon.proxy.failclosed import kill_on_error
from addon.proxy.state import KEY, Record


class Trail:
    """Opens a flow's record, closes it with its audit line; the `response` and `error`
    hooks close the records of forwarded flows."""

    def __init__(self, metrics: Metrics, alerts: StreakAlerts) -> None:
        self.metrics = metrics
        self.alerts = alerts
        # Records opened and not yet closed (the drain on shutdown waits for them).
        self.open = 0
        self.recent: Recent | None = None  # the console's last decisions (--console)

    def begin(self, flow: http.HTTPFlow) -> Record:
        peer = flow.client_conn.peername
        rec = flow.metadata[KEY] = Record(
            start=time.monotonic(),
            request_id=flow.id,
            client=f"{peer[0]}:{peer[1]}" if peer else "",
        )
        self.open += 1
        return rec

    def forget(self, flow: http.HTTPFlow) -> Record | None:
        """Close the flow's record without a line (an opened tunnel: its requests have theirs)."""
        found: Record | None = flow.metadata.pop(KEY, None)
        if found is not None:
            self.open -= 1
        return found

    def deny(
        self,
        flow: http.HTTPFlow,
        reason: Reason,
        detail: str,
        extra: dict[str, Any] | None = None,
        *,
        decision: str = audit.DENY,
        error: str | None = None,
    ) -> None:
        """Answer the flow from the proxy and write its line: a deny, a challenge or an error."""
        request = flow.request
        # The body is dropped unread (addon/mitm/refusals.py): this connection cannot go on.
        close = "content-length" in request.headers or "transfer-encoding" in request.headers
        answer = problem(
            reason,
            detail,
            error=CHALLENGED if decision == audit.CHALLENGE else None,
            request_id=flow.id,
            extra=extra,
            close=close,
        )
        # No "100 Continue": the client need not send a body that is refused.
        request.headers.pop("expect", None)
        request.stream = False
        flow.response = answer.response()
        rec = self.forget(flow)
        if rec is None:
            rec = self.begin(flow)
            self.forget(flow)
        rec.allowed = False
        if decision != audit.ERROR:  # an upstream failure keeps the grant that allowed it
            rec.grant_id = None
        rec.credential = rec.credential_fp = rec.token_fp = None
        fields: dict[str, Any] = {"status": answer.status, "reason": reason.value, "detail": detail}
        if error is not None:
            fields["error"] = error
        self.write(rec, decision, **fields)

    def finish(self, flow: http.HTTPFlow, decision: str, **fields: Any) -> None:
        """Close the flow's record with its audit line."""
        rec = self.forget(flow)
        if rec is not None:
            self.write(rec, decision, **fields)

    def write(self, rec: Record, decision: str, **fields: Any) -> None:
        line: dict[str, Any] = {
            audit.REQUEST_ID: rec.request_id,
            audit.PRINCIPAL: rec.principal,
            audit.CLIENT: rec.client,
            audit.METHOD: rec.method,
            audit.HOST: rec.host,
            audit.PORT: rec.port,
            audit.PATH: rec.path,
            audit.DECISION: decision,
            audit.GRANT_ID: rec.grant_id,
            audit.CREDENTIAL: rec.credential,
            audit.CREDENTIAL_FP: rec.credential_fp,
            audit.BYTES_IN: rec.bytes_in,
            audit.BYTES_OUT: rec.bytes_out,
            audit.DURATION_MS: round((time.monotonic() - rec.start) * 1000, 2),
            **fields,
        }
        if rec.dns_ms is not None:
            line[audit.DNS_MS] = rec.dns_ms
        if rec.approval is not None:
            line[audit.APPROVAL] = rec.approval
        if rec.token_ms is not None:
            line[audit.TOKEN_MS] = rec.token_ms
        if rec.token_fp is not None:
            line[audit.TOKEN_FP] = rec.token_fp
        if rec.body is not None:
            line[audit.BODY] = rec.body
        if rec.input_tokens is not None:
            line[audit.MODEL] = rec.model
            line[audit.INPUT_TOKENS] = rec.input_tokens
            line[audit.OUTPUT_TOKENS] = rec.output_tokens
            line[audit.TOKENS_ESTIMATED] = rec.tokens_estimated
            if rec.cost_micros is not None:
                line[audit.COST_USD] = rec.cost_micros / 1_000_000
            if rec.max_tokens is not None:
                line[audit.MAX_TOKENS] = rec.max_tokens
        if self.recent is not None:
            self.recent.add(line)  # before emit, which takes the line over
        audit.emit(audit.REQUEST_EVENT, line)
        self.metrics.observe(line)
        self.alerts.observe(rec.principal, decision, line.get(audit.REASON))

    # -- hooks -------------------------------------------------------------------------

    @kill_on_error
    def response(self, flow: http.HTTPFlow) -> None:
        rec: Record | None = flow.metadata.get(KEY)
        response = flow.response
        if rec is None or response is None:
            return
        if rec.failure is not None and (rec.replaced or not rec.buffered):
            # A streamed body that could not be decoded or redacted: cut, never completed.
            failure = rec.failure
            reason = failure.reason.value if failure.reason is not None else None
            # Refused whole (credproxy answered instead): a denial of the upstream's answer.
            decision = audit.DENY if rec.replaced else audit.ERROR
            self.finish(
                flow, decision, status=response.status_code, reason=reason, error=failure.error
            )
        elif _killed(flow):
            # Killed by a failing hook: mitmproxy ends the flow without an error hook, so its
            # line is written here. Nothing of the response reached the agent.
            decision = audit.ERROR if rec.allowed else audit.DENY
            fields = {"status": None, "reason": Reason.INTERNAL_ERROR.value, "error": "killed"}
            self.finish(flow, decision, **fields)
        else:
            self.finish(flow, audit.ALLOW, status=response.status_code, redactions=rec.redactions)

    def error(self, flow: http.HTTPFlow) -> None:
        """Audit a failed flow with a fixed error class: mitmproxy's text quotes the peer."""
        rec = self.forget(flow)
        if rec is None:
            return
        try:
            failure = rec.failure or wire.classify(flow.error.msg if flow.error else "")
        except Exception as e:  # noqa: BLE001 - the line is still written, with a fixed class
            audit.logger().error("hook.failed", hook="error", error_type=type(e).__name__)
            failure = wire.Failure(Reason.INTERNAL_ERROR, "unclassified")
        status: int | None = None
        if rec.streamed and flow.response is not None:
            status = flow.response.status_code  # its head went out, then the body broke
        elif wire.answers_agent(failure):
            status = failure.status
        fields: dict[str, Any] = {"status": status, "error": failure.error}
        if failure.reason is not None:
            fields["reason"] = failure.reason.value
        try:
            self.write(rec, audit.ERROR if rec.allowed else audit.DENY, **fields)
        except Exception as e:  # noqa: BLE001 - the parts after this one (Limits) still run
            audit.logger().error("hook.failed", hook="error", error_type=type(e).__name__)


def _killed(flow: http.HTTPFlow) -> bool:
    return flow.error is not None and flow.error.msg == mflow.Error.KILLED_MESSAGE
