"""A suggestion (store/policyfile/suggest.py) as the policy file `plan` and `apply` take, or as
JSON. Every value from the audit has passed the grammar before it gets here, and is written as a
TOML or JSON string all the same, in comments too."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from typing import Any

from store.policyfile.evidence import Tally
from store.policyfile.reconcile import GrantView, grant_table
from store.policyfile.suggest import Addition, Suggestion


def _when(t: datetime | None) -> str:
    return "-" if t is None else t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _quoted(values: tuple[str, ...]) -> str:
    # JSON's escapes: nothing from a path reaches the file raw, not even inside a comment.
    return ", ".join(json.dumps(v, ensure_ascii=True) for v in values)


def _proof(tally: Tally, examples: tuple[str, ...], what: str) -> list[str]:
    lines = [f"#   {what}: {tally.count}, first {_when(tally.first)}, last {_when(tally.last)}"]
    if tally.reasons:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(tally.reasons.items()))
        lines.append(f"#   reasons: {reasons}")
    if examples:
        lines.append(f"#   for example: {_quoted(examples)}")
    return lines


def _addition_table(a: Addition) -> list[str]:
    view = GrantView(
        key=a.key,
        id=0,
        principal=a.principal,
        credential=a.credential,
        hosts=(a.host,),
        methods=a.methods,
        paths=a.paths,
        once=False,
        websocket=False,
        encoded_slash=False,
        expires_at=None,
        purpose=f"suggested from {a.tally.count} denials",
        rate=None,
        burst=None,
        max_uses=None,
        approval=None,
        hold=None,
        body=None,
        created_at=datetime.now(UTC),
    )
    return grant_table(view)


def render(s: Suggestion) -> str:
    """The suggestion as a policy file `plan` and `apply` take as it is."""
    lines = [
        "# credproxy policy suggest: "
        f"{len(s.additions)} to add, {len(s.narrowings)} to narrow, {len(s.unused)} unused "
        f"(listed, not revoked), {len(s.hosts)} hosts refused at CONNECT (listed)",
        f"# window: {_when(s.since) if s.since else 'from the first line'} to "
        f"{_when(s.until) if s.until else 'the last'}",
        f"# rule: a path segment after the first becomes * when it looks like an id (digits, a "
        f"UUID, 7-64 hex digits) and {s.min_ids} or more distinct values were seen there; "
        f"a grant is added for {s.min_denials} or more denials of its paths",
        "# review, then: credproxy plan FILE; credproxy apply FILE",
    ]
    for why, n in sorted(s.skipped.items()):
        lines.append(f"# skipped: {why}: {n}")
    if not s.uses_read:
        lines.append("# no audit lines were read: nothing to narrow, nothing listed as unused")
    for a in s.additions:
        lines += ["", f"# add: {', '.join(a.methods)} on {a.host} for {a.principal}"]
        lines += _proof(a.tally, a.examples, "denials")
        if a.credential is None:
            lines.append(
                "#   no credential covers this host: the grant passes requests through "
                "with nothing stamped; add a [[credential]] and name it here if one is needed"
            )
        if a.also:
            lines.append(f"#   other credentials for this host: {_quoted(a.also)}")
        lines += _addition_table(a)
    if s.hosts:
        lines += [
            "",
            "# hosts asked for and refused at CONNECT: listed, not granted (a refused tunnel shows",
            "# no method or path); grant the paths you expect, then suggest again from new audit",
        ]
        for h in s.hosts:
            covered = f" (credential {_quoted(h.credentials)})" if h.credentials else ""
            lines.append(
                f"#   {h.principal}: {json.dumps(h.host)}{covered}, {h.tally.count} CONNECTs, "
                f"first {_when(h.tally.first)}, last {_when(h.tally.last)}"
            )
    for cut in s.narrowings:
        g = cut.grant
        lines += ["", f"# narrow: grant {json.dumps(g.key)} (grant {g.id}) to what it was used for"]
        lines += _proof(cut.tally, cut.examples, "uses")
        if cut.hosts != g.hosts:
            before = g.hosts or (f"the hosts of credential {json.dumps(g.credential)}",)
            lines.append(f"#   hosts: {_quoted(before)} -> {_quoted(cut.hosts)}")
        if tuple(cut.methods) != g.methods:
            lines.append(f"#   methods: {_quoted(g.methods)} -> {_quoted(cut.methods)}")
        if set(cut.paths) != set(g.paths):
            lines.append(f"#   paths: {_quoted(g.paths)} -> {_quoted(cut.paths)}")
        narrowed = dataclasses.replace(
            g,
            hosts=cut.hosts,
            methods=cut.methods,
            paths=cut.paths,
            encoded_slash=g.encoded_slash and any("*" in p.split("/") for p in cut.paths),
        )
        lines += grant_table(narrowed)
    if s.unused:
        lines += ["", "# unused in the window (left as they are; revoke with grant revoke ID):"]
        for g in s.unused:
            lines.append(
                f"#   grant {json.dumps(g.key)} (grant {g.id}): {g.principal}, "
                f"{_quoted(g.methods)} on {_quoted(g.paths)}, created {_when(g.created_at)}"
            )
    return "\n".join(lines) + "\n"


def as_json(s: Suggestion) -> dict[str, Any]:
    def proof(t: Tally, examples: tuple[str, ...]) -> dict[str, Any]:
        return {
            "count": t.count,
            "first": _when(t.first),
            "last": _when(t.last),
            "reasons": dict(sorted(t.reasons.items())),
            "examples": list(examples),
        }

    return {
        "window": {"since": _when(s.since), "until": _when(s.until)},
        "add": [
            {
                "id": a.key,
                "principal": a.principal,
                "credential": a.credential,
                "hosts": [a.host],
                "methods": list(a.methods),
                "paths": list(a.paths),
                "evidence": proof(a.tally, a.examples),
            }
            for a in s.additions
        ],
        "hosts": [
            {
                "principal": h.principal,
                "host": h.host,
                "credentials": list(h.credentials),
                "evidence": proof(h.tally, ()),
            }
            for h in s.hosts
        ],
        "narrow": [
            {
                "id": n.grant.key,
                "grant": n.grant.id,
                "hosts": {"before": list(n.grant.hosts), "after": list(n.hosts)},
                "methods": {"before": list(n.grant.methods), "after": list(n.methods)},
                "paths": {"before": list(n.grant.paths), "after": list(n.paths)},
                "evidence": proof(n.tally, n.examples),
            }
            for n in s.narrowings
        ],
        "unused": [{"id": g.key, "grant": g.id, "principal": g.principal} for g in s.unused],
        "skipped": dict(sorted(s.skipped.items())),
        "policy": render(s),
    }
