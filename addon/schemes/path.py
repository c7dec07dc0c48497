"""The path scheme: the secret goes into the path, in place of a placeholder the agent sends
at one of the credential's positions (Telegram's /bot<token>/...)."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import unquote_to_bytes

from addon.core.reasons import Reason
from addon.schemes.stamp import Refused, Stamp, Stamping, write

if TYPE_CHECKING:
    from mitmproxy import http

    from addon.core.verdict import HeaderScan, Verdict
    from store.records import CredentialRecord


class PathStamp(Stamp):
    __slots__ = ("placeholder", "positions")

    def __init__(self, credential: CredentialRecord) -> None:
        super().__init__(credential)
        self.placeholder: str = credential.options["placeholder"]
        self.positions: tuple[str, ...] = tuple(credential.options["positions"])

    def prepare(
        self, verdict: Verdict, request: http.Request, headers: HeaderScan, limit: int
    ) -> Stamping:
        assert verdict.path is not None
        placed = self.placed(verdict.path, request.data.path, headers.index)
        if placed is None:
            raise Refused(
                Reason.BAD_REQUEST,
                "the credential's placeholder goes once, at its position, and its secret nowhere",
            )
        return Placed(self, placed)

    def scrubbed(self, path: str) -> str:
        # An agent that sent the secret itself must not get it into the audit line.
        return path.replace(self.secret.decode("ascii"), "[REDACTED]")

    def placed(self, path: str, target: bytes, headers: dict[bytes, list[bytes]]) -> str | None:
        """The path as it leaves, the secret in the placeholder's place; None if the request
        carries the placeholder anywhere but once at one of its positions, or the secret."""
        decoded = unquote_to_bytes(target)
        if decoded.lower().count(self.placeholder.lower().encode()) != 1:
            return None
        if self.secret in decoded or any(self.secret in v for vs in headers.values() for v in vs):
            return None
        for position in self.positions:
            at = position.replace("{}", self.placeholder)
            if path == at or path.startswith(at + "/"):
                return position.replace("{}", self.secret.decode("ascii")) + path[len(at) :]
        return None


class Placed(Stamping):
    """One request's path, the secret in the placeholder's place (only now that it leaves)."""

    __slots__ = ("stamp", "path")

    def __init__(self, stamp: PathStamp, path: str) -> None:
        self.stamp, self.path = stamp, path

    def redacted(self) -> tuple[bytes, ...]:
        return self.stamp.redacts

    def apply(self, flow: http.HTTPFlow, path: str, query: bytes | None) -> None:
        write(flow.request, self.stamp.names, self.stamp.fields, self.path, query)
