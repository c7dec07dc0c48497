"""The --resolve map: where the proxy dials a name, as its own /etc/hosts would say."""

from __future__ import annotations

from dataclasses import dataclass

from store.rules.grammar import BadAuthority, parse_authority


@dataclass(frozen=True)
class Target:
    address: str
    port: int | None


class ResolveMap:
    """`--resolve NAME[:PORT]=ADDRESS[:PORT]`: where to dial a name; SNI and Host keep the name."""

    def __init__(self, entries: dict[tuple[str, int | None], Target]) -> None:
        self._entries = entries

    @classmethod
    def parse(cls, specs: list[str]) -> ResolveMap:
        entries: dict[tuple[str, int | None], Target] = {}
        for spec in specs:
            name_part, sep, target_part = spec.partition("=")
            if not sep:
                raise ValueError(f"invalid --resolve {spec!r}: use NAME[:PORT]=ADDRESS[:PORT]")
            try:
                name, port = parse_authority(name_part)
                address, target_port = parse_authority(target_part)
            except BadAuthority as e:
                raise ValueError(f"invalid --resolve {spec!r}: {e}") from e
            entries[(name, port)] = Target(address, target_port)
        return cls(entries)

    def lookup(self, host: str, port: int) -> tuple[str, int] | None:
        target = self._entries.get((host, port)) or self._entries.get((host, None))
        if target is None:
            return None
        return target.address, target.port or port
