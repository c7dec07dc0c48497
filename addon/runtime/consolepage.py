"""The approvers' console's pages: rendered on the server, every value escaped; one small
script of its own (no inline script, nothing from elsewhere)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import datetime
from urllib.parse import urlencode

from addon.observe.recent import Decision
from store.records import ACCESS, BUDGET, HOLD, AccessRequestEntry, GrantEntry, PrincipalEntry


def e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _page(title: str, body: str) -> str:
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>{e(title)}</title>"
        '<link rel=stylesheet href="/console.css">'
        '<script src="/console.js" defer></script>'
        f"</head><body>{body}</body></html>\n"
    )


def login(message: str = "") -> str:
    said = f"<p class=error role=alert>{e(message)}</p>" if message else ""
    return _page(
        "credproxy console: sign in",
        "<main class=narrow><h1>credproxy console</h1>"
        f"{said}"
        '<form method=post action="/login">'
        "<label>Operator token <input type=password name=token autocomplete=off required>"
        "</label> <button>Sign in</button></form></main>",
    )


def message(title: str, text: str) -> str:
    return _page(
        title,
        f"<main class=narrow><h1>{e(title)}</h1><p>{e(text)}</p>"
        '<p><a href="/">Back to the console</a></p></main>',
    )


def _header(operator: str, csrf: str) -> str:
    return (
        "<header><h1>credproxy console</h1>"
        '<nav><a href="/">Requests</a> <a href="/grants">Grants</a></nav>'
        f"<span>signed in as <b>{e(operator)}</b></span>"
        '<form method=post action="/logout">'
        f'<input type=hidden name=csrf value="{e(csrf)}"><button>Sign out</button></form>'
        "</header>"
    )


def console(operator: str, csrf: str, filters: dict[str, str], panel: str) -> str:
    query = urlencode({k: v for k, v in filters.items() if v})
    fields = "".join(
        f'<label>{e(label)} <input name={e(name)} value="{e(filters.get(name, ""))}"></label> '
        for name, label in (
            ("principal", "principal"),
            ("decision", "decision"),
            ("reason", "reason"),
        )
    )
    return _page(
        "credproxy console",
        _header(operator, csrf) + f'<main id=panel data-src="/panel?{e(query)}">{panel}</main>'
        '<form class=filters method=get action="/"><h2>Filter recent decisions</h2>'
        f"{fields}<button>Filter</button></form>",
    )


def panel(
    csrf: str,
    pending: Sequence[AccessRequestEntry],
    decisions: Sequence[Decision],
    now: datetime,
) -> str:
    held = [r for r in pending if r.kind == HOLD and r.hold_until and r.hold_until > now]
    asked = [r for r in pending if r.kind == ACCESS]
    spent = [r for r in pending if r.kind == BUDGET]
    return (
        f"<section id=held><h2>Held requests ({len(held)})</h2>"
        + _table(
            ("id", "principal", "request", "operation", "grant", "waiting", "time left", ""),
            [_held_row(r, csrf, now) for r in held],
            "No request is held.",
        )
        + f"</section><section id=access><h2>Access requests ({len(asked)})</h2>"
        + _table(
            ("id", "principal", "request", "purpose", "seen", ""),
            [_access_row(r, csrf) for r in asked],
            "No access request is pending.",
        )
        + f"</section><section id=budgets><h2>Spent budgets ({len(spent)})</h2>"
        + _table(
            ("id", "principal", "grant", "spent", "first refused", "refusals", ""),
            [_budget_row(r, csrf) for r in spent],
            "No budget request is pending.",
        )
        + f"</section><section id=recent><h2>Recent decisions ({len(decisions)})</h2>"
        + _table(
            ("time (UTC)", "principal", "request", "decision", "reason", "status", "grant"),
            [_decision_row(d) for d in decisions],
            "No decision yet.",
        )
        + "</section>"
    )


def grants(
    operator: str,
    csrf: str,
    active: Sequence[GrantEntry],
    principals: Sequence[PrincipalEntry],
    shown: int,
) -> str:
    """Active grants with a revoke button each, and the principals: read-only otherwise."""
    rows = [_grant_row(g, csrf) for g in active[:shown]]
    more = f"<p>{len(active) - shown} more: see <code>credproxy grant list</code>.</p>"
    heads = ("id", "principal", "methods", "hosts", "paths", "credential", "approval")
    return _page(
        "credproxy console: grants",
        _header(operator, csrf)
        + f"<main><section id=grants><h2>Active grants ({len(active)})</h2>"
        + _table((*heads, "expires", "purpose", ""), rows, "No grant is active.")
        + (more if len(active) > shown else "")
        + f"</section><section id=principals><h2>Principals ({len(principals)})</h2>"
        + _table(
            ("name", "created", "rate"),
            [
                f"<tr><td>{e(p.name)}</td><td>{e(p.created_at.strftime('%Y-%m-%d %H:%M'))}"
                f"</td><td>{e(p.rate or '')}</td></tr>"
                for p in principals[:shown]
            ],
            "No principal.",
        )
        + "</section></main>",
    )


def _grant_row(g: GrantEntry, csrf: str) -> str:
    hosts = ", ".join(g.hosts) if g.hosts is not None else "the credential's"
    expires = g.expires_at.strftime("%Y-%m-%d %H:%M") if g.expires_at else ""
    return (
        f"<tr data-id={g.id}><td>{g.id}</td><td>{e(g.principal)}</td>"
        f"<td>{e(' '.join(g.methods))}</td><td><code>{e(hosts)}</code></td>"
        f"<td><code>{e(' '.join(g.paths))}</code></td><td>{e(g.credential or '')}</td>"
        f"<td>{e(g.approval or '')}</td><td>{e(expires)}</td><td>{e(g.purpose or '')}</td>"
        f'<td><form method=post action="/grants/{g.id}/revoke">'
        f'<input type=hidden name=csrf value="{e(csrf)}">'
        "<button class=deny>Revoke</button></form></td></tr>"
    )


def _table(heads: Sequence[str], rows: list[str], empty: str) -> str:
    if not rows:
        return f"<p class=empty>{e(empty)}</p>"
    head = "".join(f"<th>{e(h)}</th>" for h in heads)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _request(method: str, host: str, port: int | None, path: str) -> str:
    where = host if port in (None, 443) else f"{host}:{port}"
    return f"<code>{e(method)} {e(where)}{e(path)}</code>"


def _decide(request_id: int, csrf: str, budget: bool = False) -> str:
    # A budget request is approved with the grant's budgets from then on (as `grant budget`).
    field = (
        "<input name=budget maxlength=200 placeholder="
        '"total=300000/day output=20000/hour" aria-label="new budget">'
    )
    return (
        f'<form method=post action="/requests/{request_id}" class=decide>'
        f'<input type=hidden name=csrf value="{e(csrf)}">'
        + (field if budget else "")
        + '<input name=note maxlength=200 placeholder="note (optional)" aria-label=note>'
        "<button name=decision value=approve class=approve>Approve</button>"
        "<button name=decision value=deny class=deny>Deny</button></form>"
    )


def _budget_row(r: AccessRequestEntry, csrf: str) -> str:
    return (
        f"<tr data-id={r.id}><td>{r.id}</td><td>{e(r.principal)}</td><td>{e(r.grant_id)}</td>"
        f"<td><code>{e(r.budget_spent or '')}</code></td>"
        f"<td>{_request(r.method, r.host, r.port, r.path)}</td><td>{r.count}</td>"
        f"<td>{_decide(r.id, csrf, budget=True)}</td></tr>"
    )


def _held_row(r: AccessRequestEntry, csrf: str, now: datetime) -> str:
    assert r.hold_until is not None
    left = max(0, int((r.hold_until - now).total_seconds()))
    until = int(r.hold_until.timestamp())
    return (
        f"<tr data-id={r.id}><td>{r.id}</td><td>{e(r.principal)}</td>"
        f"<td>{_request(r.method, r.host, r.port, r.path)}</td><td>{e(r.operation or '')}"
        + (f" <em>over its spent budget ({e(r.budget_spent)})</em>" if r.budget_spent else "")
        + f"</td><td>{e(r.grant_id)}</td><td>{r.count}</td>"
        f"<td><span data-until={until}>{left} s</span></td><td>{_decide(r.id, csrf)}</td></tr>"
    )


def _access_row(r: AccessRequestEntry, csrf: str) -> str:
    return (
        f"<tr data-id={r.id}><td>{r.id}</td><td>{e(r.principal)}</td>"
        f"<td>{_request(r.method, r.host, r.port, r.path)}</td><td>{e(r.purpose or '')}</td>"
        f"<td>{r.count}</td><td>{_decide(r.id, csrf)}</td></tr>"
    )


def _decision_row(d: Decision) -> str:
    return (
        f"<tr class=decision-{e(d.decision)}><td>{e(d.at.strftime('%H:%M:%S'))}</td>"
        f"<td>{e(d.principal)}</td><td>{_request(d.method, d.host, d.port, d.path)}</td>"
        f"<td>{e(d.decision)}</td><td>{e(d.reason)}</td><td>{e(d.status)}</td>"
        f"<td>{e(d.grant_id)}</td></tr>"
    )


# The console's script: the panel fetched again every two seconds (left alone while a note is
# being typed), and the time left on each held request counted down.
SCRIPT = """\
"use strict";
(function () {
  var panel = document.getElementById("panel");
  if (!panel) { return; }
  var last = panel.innerHTML;
  function typing() {
    var a = document.activeElement;
    return a && panel.contains(a) && a.tagName === "INPUT" && a.value !== "";
  }
  function refresh() {
    fetch(panel.dataset.src, {credentials: "same-origin", cache: "no-store"})
      .then(function (r) {
        if (r.status === 401) { window.location.reload(); return null; }
        return r.ok ? r.text() : null;
      })
      .then(function (text) {
        if (text !== null && text !== last && !typing()) {
          panel.innerHTML = text;
          last = text;
          tick();
        }
      })
      .catch(function () {});
  }
  function tick() {
    var now = Date.now() / 1000;
    panel.querySelectorAll("[data-until]").forEach(function (el) {
      el.textContent = Math.max(0, Math.floor(Number(el.dataset.until) - now)) + " s";
    });
  }
  setInterval(refresh, 2000);
  setInterval(tick, 1000);
})();
"""

STYLE = """\
body { font: 15px/1.4 system-ui, sans-serif; margin: 0; color: #1b1b1b; background: #fafafa; }
header { display: flex; gap: 1em; align-items: center; padding: .5em 1em;
         background: #233; color: #fff; }
header h1 { font-size: 1.1em; margin: 0; }
header nav { flex: 1; }
header nav a { color: #fff; margin-right: 1em; }
main, .filters { padding: 0 1em; }
.narrow { max-width: 30em; margin: 3em auto; }
table { border-collapse: collapse; width: 100%; margin-bottom: 1em; }
th, td { text-align: left; padding: .3em .5em; border-bottom: 1px solid #ddd; vertical-align: top; }
code { word-break: break-all; }
.decide { display: flex; gap: .3em; flex-wrap: wrap; }
button.approve { background: #1d6b2f; color: #fff; }
button.deny { background: #9b1c1c; color: #fff; }
tr.decision-deny td { color: #9b1c1c; }
.error { color: #9b1c1c; }
.empty { color: #666; }
"""
