"""The last request decisions, kept in memory for the approvers' console (`--console`).

Only the fields an approver decides by are copied: never a credential, a fingerprint, a
token, a query, a header or a body (the audit line holds none of the last four either).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from addon.observe import audit

KEPT = 500  # decisions kept in memory; the oldest goes first


@dataclass(frozen=True)
class Decision:
    at: datetime
    principal: str
    method: str
    host: str
    port: int | None
    path: str
    decision: str
    reason: str
    status: int | None
    grant_id: int | None
    approval: int | None


class Recent:
    def __init__(self, kept: int = KEPT) -> None:
        self._kept: deque[Decision] = deque(maxlen=kept)

    def add(self, line: dict[str, Any]) -> None:
        """Keep a request line's decision (the line itself is left as it is)."""
        path = str(line.get(audit.PATH) or "").partition("?")[0]
        self._kept.append(
            Decision(
                at=datetime.now(UTC),
                principal=str(line.get(audit.PRINCIPAL) or ""),
                method=str(line.get(audit.METHOD) or ""),
                host=str(line.get(audit.HOST) or ""),
                port=line.get(audit.PORT),
                path=path,
                decision=str(line.get(audit.DECISION) or ""),
                reason=str(line.get(audit.REASON) or ""),
                status=line.get(audit.STATUS),
                grant_id=line.get(audit.GRANT_ID),
                approval=line.get(audit.APPROVAL),
            )
        )

    def latest(
        self, limit: int, principal: str = "", decision: str = "", reason: str = ""
    ) -> list[Decision]:
        """The newest first, up to `limit`, matching every filter given (exact match)."""
        found: list[Decision] = []
        for d in reversed(self._kept):
            if principal and d.principal != principal:
                continue
            if decision and d.decision != decision:
                continue
            if reason and d.reason != reason:
                continue
            found.append(d)
            if len(found) >= limit:
                break
        return found
