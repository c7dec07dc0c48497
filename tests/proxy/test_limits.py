"""The limits addon's bookkeeping and its settings, without sockets (tests/e2e/test_limits.py)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
from types import SimpleNamespace
from typing import Any

import pytest
from mitmproxy.test import taddons, tflow

from addon.core.reasons import STATUS, Reason
from addon.core.verdict import Tunnel
from addon.mitm import bounds
from addon.proxy import admission, limits
from addon.proxy.limits import LIMIT_FLAGS, Limits, LimitSettings
from addon.proxy.state import Clients
from store.errors import InvalidInput


def _args(**values: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    limits.add_limit_flags(parser)
    return argparse.Namespace(**{**vars(parser.parse_args([])), **values})


def test_the_defaults_are_the_stated_numbers():
    settings = LimitSettings.from_args(_args())
    assert settings == LimitSettings(10.0, 60.0, 10.0, 30.0, 4096, 256)
    assert (settings.unauthenticated_cap, settings.max_unauthenticated_per_address) == (1024, 256)
    assert LimitSettings.from_args(_args(max_connections=100)).unauthenticated_cap == 25


def test_the_unauthenticated_cap_must_leave_room_for_principals():
    with pytest.raises(InvalidInput, match="--max-unauthenticated must be below"):
        LimitSettings.from_args(_args(max_connections=100, max_unauthenticated=100))
    assert LimitSettings.from_args(_args(max_unauthenticated=99)).unauthenticated_cap == 99


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, 0.0])
@pytest.mark.parametrize("dest", sorted(LIMIT_FLAGS))
def test_nan_infinities_zero_and_negatives_are_refused(dest: str, value: float):
    with pytest.raises(InvalidInput, match=LIMIT_FLAGS[dest][0]):
        LimitSettings.from_args(_args(**{dest: value}))


def test_the_new_reasons_have_their_statuses():
    assert STATUS[Reason.REQUEST_TOO_LARGE] == 431
    assert STATUS[Reason.REQUEST_TIMEOUT] == 408
    assert STATUS[Reason.TOO_MANY_CONNECTIONS] == 429
    assert STATUS[Reason.UPSTREAM_TIMEOUT] == 504


def test_install_is_idempotent_and_checks_h2s_own_limits():
    bounds.install()
    bounds.install()
    from mitmproxy.proxy.layers.http import _http1

    assert _http1.Http1Server.read_headers.__qualname__.startswith("_bounded_head")


def _limits(**settings: Any) -> Limits:
    return Limits(LimitSettings(**settings), Clients(), None)  # type: ignore[arg-type]


def _from(address: str) -> Any:
    client = tflow.tclient_conn()
    client.peername = (address, 40000)
    return client


def _authenticate(addon: Limits, client: Any) -> Any:
    """As a plain proxy request with a valid token does: auth names the principal."""
    addon.clients.state(client).principal = "p"
    flow = tflow.tflow(client_conn=client)
    flow.response = None
    addon.requestheaders(flow)
    return flow


@pytest.fixture
def closed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The connections the addon closed (there is no proxy server to close them)."""
    found: list[Any] = []
    monkeypatch.setattr(limits, "_close", lambda cid, conn, why: found.append(conn) or True)
    transport = lambda client: SimpleNamespace(close=lambda: found.append(client))  # noqa: E731
    monkeypatch.setattr(limits.reading, "transport", transport)
    return found


def test_connections_over_the_total_cap_are_refused_at_accept(closed):
    with taddons.context():
        addon = _limits(max_connections=2, max_unauthenticated=1)
        first, second, third = (_from(f"10.0.0.{n}") for n in (1, 2, 3))
        for client in (first, second):
            addon.client_connected(client)
            _authenticate(addon, client)
        addon.client_connected(third)
        assert [c.error for c in (first, second, third)] == [None, None, "too many connections"]
        assert addon.admission.refused == {"max-connections": 1} and not closed
        addon.client_disconnected(first)
        again = _from("10.0.0.3")
        addon.client_connected(again)
        assert again.error is None


def test_an_address_at_its_cap_makes_room_from_its_own_oldest_connection(closed):
    with taddons.context():
        addon = _limits(max_unauthenticated_per_address=2)
        mine = [_from("10.0.0.1") for _ in range(3)]
        for client in mine:
            addon.client_connected(client)
        assert closed == [mine[0]] and all(c.error is None for c in mine)
        assert addon.admission.displaced == {"max-unauthenticated-per-address": 1}
        other = _from("10.0.0.2")
        addon.client_connected(other)
        assert closed == [mine[0]] and mine[0] not in addon.admission.pending
        assert len(addon.admission.pending) == 3


def test_a_displaced_connection_not_set_up_yet_is_closed_before_it_is_read():
    with taddons.context():  # no proxy server: no transport to close
        addon = _limits(max_unauthenticated_per_address=1)
        first, second = _from("10.0.0.1"), _from("10.0.0.1")
        for client in (first, second):
            addon.client_connected(client)
        assert first.error is not None and "newer" in first.error and second.error is None


def test_a_connection_whose_bytes_wait_unread_is_never_displaced(closed):
    """A burst accepted together: none of it has been read yet, so none of it may go."""
    with taddons.context():
        addon = _limits(max_unauthenticated_per_address=2)
        unread: set[Any] = set()
        addon.admission._unread = lambda client: client in unread
        burst = [_from("10.0.0.1") for _ in range(4)]
        for client in burst:
            addon.client_connected(client)
            unread.add(client)
        assert not closed and len(addon.admission.pending) == 4  # over the bound, for now
        unread.discard(burst[1])  # read, and still not authenticated
        addon.client_connected(_from("10.0.0.1"))
        assert closed == [burst[1]]


def test_a_full_pool_makes_room_from_the_address_that_holds_the_most(closed):
    with taddons.context():
        addon = _limits(max_connections=16, max_unauthenticated=3)
        hogs = [_from("10.0.0.9") for _ in range(3)]
        for hog in hogs:
            addon.client_connected(hog)
        principal = _from("10.0.0.1")
        addon.client_connected(principal)
        assert closed == [hogs[0]] and principal.error is None
        # The hog's address keeps making room from its own connections, never the newcomer's.
        more = [_from("10.0.0.9") for _ in range(5)]
        for hog in more:
            addon.client_connected(hog)
        assert principal not in closed and principal in addon.admission.pending
        assert closed == [*hogs, *more[:3]]
        assert addon.admission.displaced == {"max-unauthenticated": 6}


def test_a_full_pool_of_one_connection_per_address_refuses_a_newcomer(closed):
    with taddons.context():
        addon = _limits(max_connections=16, max_unauthenticated=2)
        held = [_from("10.0.0.1"), _from("10.0.0.2")]
        for client in held:
            addon.client_connected(client)
        newcomer = _from("10.0.0.3")
        addon.client_connected(newcomer)
        assert newcomer.error == "too many connections" and not closed
        assert addon.admission.refused == {"max-unauthenticated": 1}


def test_authenticated_connections_leave_the_pool(closed):
    """By a tunnel (CONNECT), by a proxy request, and by auth in a hook still waiting."""
    with taddons.context():
        addon = _limits(max_connections=16, max_unauthenticated=1)
        tunnel, plain, waiting = _from("10.0.0.1"), _from("10.0.0.2"), _from("10.0.0.3")
        addon.client_connected(tunnel)
        flow = tflow.tflow(client_conn=tunnel)
        flow.response = None
        addon.clients.state(tunnel).tunnel = Tunnel("p", "h", 443)
        addon.http_connect(flow)
        addon.client_connected(plain)
        _authenticate(addon, plain)
        addon.client_connected(waiting)
        addon.clients.state(waiting).principal = "p"  # the limits addon has not run yet
        newcomer = _from("10.0.0.4")
        addon.client_connected(newcomer)
        assert not closed and newcomer.error is None
        assert list(addon.admission.pending) == [newcomer]


def test_an_answered_unauthenticated_connection_idles_only_for_the_head_deadline():
    with taddons.context():
        addon = _limits(head_timeout=10.0, idle_timeout=60.0)
        anonymous, principal = _from("10.0.0.1"), _from("10.0.0.2")
        for client in (anonymous, principal):
            addon.client_connected(client)
        allowed = _authenticate(addon, principal)
        refused = tflow.tflow(client_conn=anonymous)
        refused.response = None
        addon.requestheaders(refused)  # e.g. answered 407
        for flow in (refused, allowed):
            addon.response(flow)
        anonymous_left = addon.conns[anonymous].deadline - limits.time.monotonic()
        principal_left = addon.conns[principal].deadline - limits.time.monotonic()
        assert 9 < anonymous_left <= 10 and 59 < principal_left <= 60


def test_a_failing_accept_refuses_the_connection(monkeypatch: pytest.MonkeyPatch):
    with taddons.context():
        addon = _limits()
        monkeypatch.setattr(addon.admission, "make_room", lambda source: 1 / 0)
        client = tflow.tclient_conn()
        addon.client_connected(client)
        assert client.error == "internal error" and client not in addon.conns


@pytest.mark.parametrize(
    ("peer", "key"),
    [
        pytest.param("192.0.2.7", "192.0.2.7", id="an IPv4 address is its own key"),
        pytest.param("2001:db8::1", "2001:db8::/64", id="an IPv6 address counts by its /64"),
        pytest.param("2001:db8::ffff:1", "2001:db8::/64", id="another address of that /64"),
        pytest.param("::ffff:192.0.2.7", "192.0.2.7", id="an IPv4-mapped address is IPv4"),
        pytest.param("fe80::1%eth0", "fe80::/64", id="a zone index is dropped"),
    ],
)
def test_connections_count_against_their_source(peer: str, key: str):
    assert admission.peer_key(_from(peer)) == key


def test_per_connection_state_goes_with_the_connection():
    """Weakly keyed: a connection mitmproxy forgot without client_disconnected leaks nothing."""
    with taddons.context():
        addon = _limits()
        client = tflow.tclient_conn()
        addon.client_connected(client)
        flow = tflow.tflow(client_conn=client)
        addon.clients.state(client).tunnel = Tunnel("p", "h", 443)
        flow.response = None
        addon.http_connect(flow)
        assert len(addon.tunnels["p"]) == 1 and len(addon.conns) == 1
        del client, flow
        gc.collect()
        assert len(addon.conns) == 0 and len(addon.tunnels["p"]) == 0


def test_a_connection_with_a_request_in_flight_has_no_deadline():
    with taddons.context():
        addon = _limits(idle_timeout=60.0)
        flow = tflow.tflow()
        addon.client_connected(flow.client_conn)
        conn = addon.conns[flow.client_conn]
        assert conn.head and conn.deadline < math.inf
        addon.requestheaders(flow)
        assert conn.deadline == math.inf
        addon.response(flow)
        assert not conn.head and conn.deadline < math.inf
        addon.response(flow)  # twice (or an error after the response) changes nothing


def test_the_sweeper_spares_a_connection_whose_request_waits_on_credproxy(closed, monkeypatch):
    """A token mint, a lookup, a rate bucket: the connection is not read meanwhile, so its
    head deadline cannot blame the client (issue 34, item 6)."""
    with taddons.context():
        addon = _limits(head_timeout=10.0)
        client = tflow.tclient_conn()
        addon.client_connected(client)
        now = addon.conns[client].deadline + 1
        monkeypatch.setattr(limits.reading, "paused", lambda c: c is client)
        addon.sweep(now)
        assert not closed
        monkeypatch.setattr(limits.reading, "paused", lambda c: False)
        addon.sweep(now)
        assert closed == [client]


def test_the_sweeper_closes_only_what_is_overdue(monkeypatch: pytest.MonkeyPatch):
    closed: list[tuple[str, str]] = []
    monkeypatch.setattr(limits, "_close", lambda cid, conn, why: closed.append((cid, why)) or True)
    with taddons.context():
        addon = _limits(head_timeout=10.0)
        early, late = tflow.tclient_conn(), tflow.tclient_conn()
        addon.client_connected(early)
        addon.client_connected(late)
        addon.conns[late].deadline += 100
        now = addon.conns[early].deadline + 1
        addon.sweep(now)
        assert [cid for cid, _ in closed] == [early.id]
        addon.sweep(now)
        assert len(closed) == 1  # once


def test_an_overdue_flow_is_marked_for_a_504_and_its_upstream_cut(monkeypatch):
    cut: list[str] = []
    monkeypatch.setattr(Limits, "_cut_upstream", lambda self, flow, why: cut.append(why))
    with taddons.context():
        addon = _limits(upstream_timeout=30.0)
        flow = tflow.tflow()
        flow.response = None
        addon.request(flow)
        addon.sweep(addon.flows[flow].deadline + 1)
        assert cut == ["upstream timeout: no response in 30 s"]
        assert bounds.timed_out_flows[flow] == cut[0]


def test_each_piece_of_a_response_body_pushes_the_stall_deadline_back(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: clock[0])
    with taddons.context():
        addon = _limits(upstream_timeout=30.0)
        flow = tflow.tflow(resp=True)
        addon.flows[flow] = limits._Timer(0.0, "")
        addon.responseheaders(flow)
        assert addon.flows[flow].deadline == 1030.0
        assert "stalled" in addon.flows[flow].message
        clock[0] = 1020.0
        addon.response_data(flow)
        assert addon.flows[flow].deadline == 1050.0
        addon.response_data(tflow.tflow(resp=True))  # a flow without a timer: nothing


@pytest.mark.parametrize("state", ["state_consume_response_body", "state_stream_response_body"])
def test_both_response_body_states_report_each_piece(monkeypatch, state: str):
    """Held whole (mitmproxy calls no hook per piece) or streamed, HTTP/1 or HTTP/2: the
    layer's state sees every ResponseData."""
    from mitmproxy.proxy.layers.http import HttpStream
    from mitmproxy.proxy.layers.http._events import ResponseData

    bounds.install()
    seen: list[Any] = []
    monkeypatch.setattr(bounds, "on_response_data", [seen.append])
    stream = SimpleNamespace(
        flow=tflow.tflow(resp=True), stream_id=1, response_body_buf=bytearray()
    )
    stream.flow.response.stream = True
    stream.check_body_size = lambda request: iter(())
    stream.context = SimpleNamespace(client=None)
    commands = list(getattr(HttpStream, state)(stream, ResponseData(1, b"d")))
    assert seen == [stream.flow]
    assert getattr(HttpStream, state).__name__ == state
    assert commands or stream.response_body_buf == b"d"


def test_the_h2_queue_bound_counts_bytes_not_frames():
    frame = SimpleNamespace
    small = [frame(data=b"x" * 10) for _ in range(1000)]
    assert not bounds._buffered((small,), 16384, 1024 * 1024)  # 1000 frames, 10 kB
    full = [frame(data=b"x" * 16384) for _ in range(65)]
    assert bounds._buffered((full,), 16384, 1024 * 1024)
    assert bounds._buffered((full[:40], full[:40]), 16384, 1024 * 1024)  # over all streams


def test_a_closed_tunnel_frees_its_place_under_the_principals_cap():
    with taddons.context():
        addon = _limits(max_tunnels=1)
        first, second = tflow.tflow(), tflow.tflow()
        for flow in (first, second):
            flow.response = None
            addon.client_connected(flow.client_conn)
            addon.clients.state(flow.client_conn).tunnel = Tunnel("p", "h", 443)
        addon.http_connect(first)
        addon.client_disconnected(first.client_conn)
        assert "p" not in addon.tunnels
        addon.http_connect(second)
        assert second.response is None and len(addon.tunnels["p"]) == 1


def test_a_head_read_just_now_is_not_displaced_while_it_goes_through_the_hooks(
    closed, monkeypatch: pytest.MonkeyPatch
):
    """Read already (nothing waits in the socket), not yet authenticated: a CONNECT of a
    burst, under load. It keeps its place for READ_GRACE, then may go like any silent one."""
    with taddons.context():
        addon = _limits(max_unauthenticated_per_address=1)
        now = [100.0]
        monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
        first = _from("10.0.0.1")
        addon.client_connected(first)
        addon.head_read(first)
        addon.client_connected(_from("10.0.0.1"))
        assert closed == []
        now[0] += limits.READ_GRACE
        addon.client_connected(_from("10.0.0.1"))
        assert closed == [first]


def test_memory_goes_back_once_many_connections_closed_and_none_for_a_while(monkeypatch):
    """A burst's memory is given back (a full collection, then malloc_trim) once TRIM_AFTER
    connections closed and none closed for TRIM_QUIET seconds, or TRIM_EVERY passed; never
    for a few closes, and never while they keep closing."""
    calls: list[int] = []
    monkeypatch.setattr(limits, "_malloc_trim", lambda: calls.append)
    collected: list[int] = []
    monkeypatch.setattr(limits.gc, "collect", lambda: collected.append(1) or 0)
    lim = _limits()
    run = asyncio.run
    lim.closed_since_trim = limits.TRIM_AFTER - 1
    lim._closed_at = lim._first_closed_at = 100.0
    assert not run(lim.trim(100.0 + limits.TRIM_QUIET))  # too few
    lim.closed_since_trim += 1
    assert not run(lim.trim(100.0 + limits.TRIM_QUIET / 2))  # still closing
    assert run(lim.trim(100.0 + limits.TRIM_QUIET))
    assert calls == [0] and collected == [1] and lim.closed_since_trim == 0
    lim.closed_since_trim, lim._first_closed_at = limits.TRIM_AFTER, 200.0
    lim._closed_at = 200.0 + limits.TRIM_EVERY
    assert not run(lim.trim(200.0 + limits.TRIM_EVERY - 1))
    assert run(lim.trim(200.0 + limits.TRIM_EVERY))  # closing all along: once a minute
    monkeypatch.setattr(limits, "_malloc_trim", lambda: None)  # no glibc: nothing to call
    lim.closed_since_trim = limits.TRIM_AFTER
    assert not run(lim.trim(1e9))


def test_a_closed_client_connection_counts_towards_the_trim():
    lim = _limits()
    lim.client_disconnected(tflow.tclient_conn())
    first = lim._first_closed_at
    lim.client_disconnected(tflow.tclient_conn())
    assert lim.closed_since_trim == 2 and lim._first_closed_at == first <= lim._closed_at
