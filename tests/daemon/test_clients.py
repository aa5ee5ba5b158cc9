"""The client table without sockets: connections, reconnections, open requests, timeouts."""

from __future__ import annotations

from ringstream.daemon.front.client_table import STUCK_GIVE_UP_FACTOR, ClientTable
from ringstream.daemon.front.request import Request
from ringstream.ipc import protocol as P


def _request(identity: bytes, rid: str, handle: int = 1) -> Request:
    return Request(identity, rid, handle, P.Generate(id=rid, prompt="x"), [1], arrival=0.0)


def test_requests_are_open_per_client_until_removed():
    table = ClientTable()
    a, b = _request(b"A", "1", 1), _request(b"A", "2", 2)
    table.add(a, connection=None, now=0.0)
    table.add(b, connection=None, now=0.0)
    assert set(table.get(b"A").requests) == {"1", "2"}
    table.remove(a)
    assert set(table.get(b"A").requests) == {"2"}
    table.remove(b)
    assert table.get(b"A") is None and len(table) == 0


def test_removing_a_stale_request_keeps_the_live_one_of_the_same_id():
    table = ClientTable()
    old, new = _request(b"A", "1", 1), _request(b"A", "1", 2)
    table.add(new, None, 0.0)
    table.remove(old)
    assert table.get(b"A").requests["1"] is new


def test_a_closed_connection_names_the_identity_whose_requests_came_over_it():
    table = ClientTable()
    table.connection_accepted(fd=7)
    serial = table.connection_of(7)
    table.heard(b"A", serial, now=1.0)
    table.add(_request(b"A", "1"), serial, 1.0)
    assert table.connection_closed(7) == b"A"
    assert table.connection_of(7) is None


def test_a_closed_connection_of_a_client_with_nothing_open_names_nobody():
    table = ClientTable()
    table.connection_accepted(fd=7)
    table.heard(b"A", table.connection_of(7), now=1.0)
    assert table.connection_closed(7) is None


def test_the_same_identity_over_a_new_connection_is_a_reconnection():
    table = ClientTable()
    table.connection_accepted(fd=7)
    first = table.connection_of(7)
    table.add(_request(b"A", "1"), first, 0.0)
    table.heard(b"A", first, 1.0)
    table.connection_accepted(fd=8)
    second = table.connection_of(8)
    assert second != first
    client, reconnected = table.heard(b"A", second, 2.0)
    assert reconnected and client is table.get(b"A")
    assert table.pop(b"A") is client and table.get(b"A") is None
    # a serial is never reused: the old connection's close now names nobody
    assert table.connection_closed(7) is None


def test_heard_updates_last_seen():
    table = ClientTable()
    table.add(_request(b"A", "1"), None, 0.0)
    table.heard(b"A", None, 5.0)
    assert table.get(b"A").last_seen == 5.0


def test_expired_sorts_silent_stuck_and_gone():
    table = ClientTable()
    for identity in (b"silent", b"stuck", b"gone", b"fine"):
        table.add(_request(identity, "1"), None, 100.0)
    table.get(b"silent").last_seen = 0.0
    table.get(b"stuck").blocked_since = 100.0 - 1.5
    table.get(b"gone").blocked_since = 100.0 - STUCK_GIVE_UP_FACTOR - 0.5
    table.get(b"fine").blocked_since = 100.0 - 0.5
    found = {identity: verdict for identity, _, verdict, _ in table.expired(now=100.0, timeout_s=1.0)}
    assert found == {b"silent": "silent", b"stuck": "stuck", b"gone": "gone"}
