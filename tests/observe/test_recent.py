"""The console's last decisions, in memory."""

from __future__ import annotations

from addon.observe.recent import Recent


def _line(principal: str, decision: str, reason: str = "", path: str = "/p") -> dict[str, object]:
    return {
        "principal": principal,
        "method": "GET",
        "host": "api.test",
        "port": 443,
        "path": path,
        "decision": decision,
        "reason": reason,
        "credential": "cred",
        "credential_fp": "fp",
        "token_fp": "tfp",
    }


def test_the_newest_come_first_and_the_oldest_go() -> None:
    recent = Recent(kept=2)
    for n in range(3):
        recent.add(_line(f"p{n}", "allow"))
    assert [d.principal for d in recent.latest(10)] == ["p2", "p1"]


def test_filters_match_exactly() -> None:
    recent = Recent()
    recent.add(_line("a", "allow"))
    recent.add(_line("a", "deny", "no-grant"))
    recent.add(_line("b", "deny", "no-grant"))
    assert [d.principal for d in recent.latest(10, decision="deny")] == ["b", "a"]
    assert [d.decision for d in recent.latest(10, principal="a")] == ["deny", "allow"]
    assert len(recent.latest(10, reason="no-grant", principal="b")) == 1
    assert recent.latest(10, principal="") == recent.latest(10)
    assert len(recent.latest(1)) == 1


def test_no_query_or_fingerprint_is_kept() -> None:
    recent = Recent()
    recent.add(_line("a", "allow", path="/p?key=secret"))
    [kept] = recent.latest(1)
    assert kept.path == "/p"
    assert "fp" not in repr(kept) and "cred" not in repr(kept) and "secret" not in repr(kept)
