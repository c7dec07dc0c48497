"""The limits addon's bookkeeping and its settings, without sockets (tests/e2e/test_limits.py)."""

from __future__ import annotations

import argparse
import gc
import math
from types import SimpleNamespace
from typing import Any

import pytest
from mitmproxy.test import taddons, tflow

from addon import bounds, limits
from addon.limits import LIMIT_FLAGS, Limits, LimitSettings
from addon.policy import STATUS, Reason
from addon.state import Clients
from addon.verdict import Tunnel
from store.errors import InvalidInput


def _args(**values: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    limits.add_limit_flags(parser)
    return argparse.Namespace(**{**vars(parser.parse_args([])), **values})


def test_the_defaults_are_the_stated_numbers():
    assert LimitSettings.from_args(_args()) == LimitSettings(10.0, 60.0, 10.0, 30.0, 4096, 256)


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


def test_connections_over_the_total_cap_are_refused_at_accept():
    with taddons.context():
        addon = _limits(max_connections=2)
        clients = [tflow.tclient_conn() for _ in range(3)]
        for client in clients:
            addon.client_connected(client)
        assert [c.error for c in clients] == [None, None, "too many connections"]
        addon.client_disconnected(clients[0])
        again = tflow.tclient_conn()
        addon.client_connected(again)
        assert again.error is None


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


def test_a_streamed_response_chunk_pushes_the_stall_deadline_back(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: clock[0])
    with taddons.context():
        addon = _limits(upstream_timeout=30.0)
        flow = tflow.tflow(resp=True)
        flow.response.stream = lambda chunk: chunk
        addon.request(flow.copy())  # another flow: no timer for this one yet
        addon.flows[flow] = limits._Timer(0.0, "")
        addon.responseheaders(flow)
        clock[0] = 1020.0
        assert flow.response.stream(b"x") == b"x"
        assert addon.flows[flow].deadline == 1050.0
        assert "stalled" in addon.flows[flow].message


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
