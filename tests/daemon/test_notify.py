"""sd_notify client against real AF_UNIX datagram sockets; watchdog gate as pure logic."""

import logging
import os
import secrets
import socket
import time

import pytest

from ringstream.daemon.front.notify import Notifier, WatchdogGate

RECV_TIMEOUT_S = 2.0
MAX_DATAGRAM = 4096


@pytest.fixture
def manager(tmp_path):
    """A bound datagram socket standing in for systemd's notification socket; yields (sock, env)."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(RECV_TIMEOUT_S)
    yield sock, {"NOTIFY_SOCKET": str(path)}
    sock.close()


def received(sock: socket.socket) -> str:
    return sock.recv(MAX_DATAGRAM).decode()


def nothing_pending(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(MAX_DATAGRAM)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(RECV_TIMEOUT_S)
    return False


def test_ready_status_stopping_datagrams(manager):
    sock, env = manager
    with Notifier(env) as notifier:
        assert notifier.enabled
        assert notifier.ready()
        assert received(sock) == "READY=1"
        assert notifier.ready(status="serving: 2 workers")
        assert received(sock) == "READY=1\nSTATUS=serving: 2 workers"
        assert notifier.status("loading model\non cuda:0")
        assert received(sock) == "STATUS=loading model on cuda:0"
        assert notifier.stopping()
        assert received(sock) == "STOPPING=1"
        assert notifier.stopping(status="draining 3 streams")
        assert received(sock) == "STOPPING=1\nSTATUS=draining 3 streams"
        assert notifier.send(STATUS="x", ERRNO="0")
        assert received(sock) == "STATUS=x\nERRNO=0"
        assert notifier.extend_timeout(1.5)
        assert received(sock) == "EXTEND_TIMEOUT_USEC=1500000"
        assert notifier.send_failures == 0


def test_reloading_carries_monotonic_usec(manager):
    sock, env = manager
    notifier = Notifier(env)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = received(sock).split("\n")
    assert lines[0] == "RELOADING=1"
    assert len(lines) == 2 and lines[1].startswith("MONOTONIC_USEC=")
    assert before <= int(lines[1].removeprefix("MONOTONIC_USEC=")) <= after
    notifier.close()


def test_abstract_socket():
    name = f"ringstream-test-{os.getpid()}-{secrets.token_hex(4)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(RECV_TIMEOUT_S)
    try:
        with Notifier({"NOTIFY_SOCKET": "@" + name}) as notifier:
            assert notifier.address == "\0" + name
            assert notifier.ready()
            assert received(sock) == "READY=1"
    finally:
        sock.close()


def test_watchdog_interval_is_half_the_timeout(manager):
    sock, env = manager
    notifier = Notifier({**env, "WATCHDOG_USEC": "30000000"})
    assert notifier.watchdog_timeout_s == 30.0
    assert notifier.watchdog_interval_s == 15.0
    assert notifier.watchdog()
    assert received(sock) == "WATCHDOG=1"
    notifier.close()


def test_watchdog_pid_selects_the_process(manager):
    sock, env = manager
    mine = Notifier({**env, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())})
    assert mine.watchdog_interval_s == 1.0
    other = Notifier({**env, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_timeout_s is None and other.watchdog_interval_s is None
    assert not other.watchdog()
    assert nothing_pending(sock)
    assert other.ready()  # only the watchdog is another process's; notifications still go out
    assert received(sock) == "READY=1"
    explicit = Notifier({**env, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "41"}, pid=41)
    assert explicit.watchdog_interval_s == 1.0
    for notifier in (mine, other, explicit):
        notifier.close()


@pytest.mark.parametrize("usec", ["0", "-5", "soon", ""])
def test_bad_or_absent_watchdog_usec_disables_the_watchdog(manager, usec):
    sock, env = manager
    notifier = Notifier({**env, "WATCHDOG_USEC": usec})
    assert notifier.watchdog_interval_s is None
    assert not notifier.watchdog()
    assert nothing_pending(sock)
    notifier.close()


def test_unset_notify_socket_is_a_no_op():
    notifier = Notifier({"WATCHDOG_USEC": "30000000"})
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    assert not any([notifier.ready("x"), notifier.reloading(), notifier.stopping(), notifier.status("x"),
                    notifier.watchdog(), notifier.send(READY="1")])
    assert notifier.send_failures == 0


def test_relative_notify_socket_is_ignored():
    assert not Notifier({"NOTIFY_SOCKET": "relative/notify.sock"}).enabled


def test_missing_socket_does_not_raise(tmp_path, caplog):
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock"), "WATCHDOG_USEC": "1000000"})
    assert notifier.enabled
    with caplog.at_level(logging.DEBUG, logger="ringstream.notify"):
        assert not notifier.ready()
        assert not notifier.watchdog()
        assert not notifier.stopping()
    assert notifier.send_failures == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "gone.sock" in warnings[0].getMessage()
    notifier.close()
    notifier.close()
    assert not notifier.enabled and not notifier.ready()


def test_malformed_fields_raise_before_sending(manager):
    sock, env = manager
    notifier = Notifier(env)
    with pytest.raises(ValueError, match="newline"):
        notifier.send(STATUS="two\nlines")
    with pytest.raises(ValueError, match="upper-case"):
        notifier.send(status="lower")
    with pytest.raises(ValueError, match="at least one"):
        notifier.send()
    with pytest.raises(ValueError, match="> 0"):
        notifier.extend_timeout(0)
    assert nothing_pending(sock)
    notifier.close()


def test_environment_is_kept_unless_asked():
    env = {"NOTIFY_SOCKET": "/nonexistent/notify.sock", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1", "X": "y"}
    Notifier.from_environ(env).close()
    assert set(env) == {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "X"}
    notifier = Notifier.from_environ(env, unset=True)
    assert env == {"X": "y"}
    assert notifier.enabled  # built before the variables went
    notifier.close()


def test_gate_pings_when_front_and_workers_are_alive(manager):
    sock, env = manager
    gate = WatchdogGate(Notifier({**env, "WATCHDOG_USEC": "30000000"}))
    assert gate.ping_if_healthy(True, {0: 99.0, 1: 95.5}, now=100.0, max_age_s=5.0)
    assert received(sock) == "WATCHDOG=1"
    assert gate.withheld_reason is None
    assert gate.ping_if_healthy(True, {}, now=100.0, max_age_s=5.0)  # no ready worker yet: the front alone
    assert received(sock) == "WATCHDOG=1"
    assert gate.ping_if_healthy(True, {0: 101.0}, now=100.0, max_age_s=5.0)  # a clock step backwards is fresh
    assert received(sock) == "WATCHDOG=1"
    gate.notifier.close()


def test_gate_withholds_pings_for_a_stale_worker_or_a_stuck_front(manager, caplog):
    sock, env = manager
    gate = WatchdogGate(Notifier({**env, "WATCHDOG_USEC": "30000000"}))
    with caplog.at_level(logging.INFO, logger="ringstream.notify"):
        assert not gate.ping_if_healthy(True, {0: 99.0, 1: 90.0}, now=100.0, max_age_s=10.0)
        assert gate.withheld_reason == "worker 1 silent for 10.0 s"
        assert not gate.ping_if_healthy(True, {0: 80.0, 1: 90.0}, now=101.0, max_age_s=10.0)
        assert "worker 0" in gate.withheld_reason and "worker 1" in gate.withheld_reason
        assert not gate.ping_if_healthy(False, {0: 100.0}, now=101.0, max_age_s=10.0)
        assert gate.withheld_reason == "front loop not healthy"
        assert nothing_pending(sock)
        assert gate.ping_if_healthy(True, {0: 100.5, 1: 100.9}, now=101.0, max_age_s=10.0)
        assert received(sock) == "WATCHDOG=1"
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in messages] == [logging.WARNING, logging.INFO]  # once when withheld, once on recovery
    gate.notifier.close()


def test_gate_decision_is_pure():
    assert WatchdogGate.withhold_reason(True, {0: 0.0}, now=4.999, max_age_s=5.0) is None
    assert WatchdogGate.withhold_reason(True, {0: 0.0}, now=5.0, max_age_s=5.0) == "worker 0 silent for 5.0 s"
    with pytest.raises(ValueError, match="max_age_s"):
        WatchdogGate.withhold_reason(True, {}, now=0.0, max_age_s=0.0)


def test_gate_without_watchdog_still_decides():
    gate = WatchdogGate(Notifier({}))
    assert gate.ping_if_healthy(True, {0: 1.0}, now=2.0, max_age_s=5.0)
    assert not gate.ping_if_healthy(True, {0: 1.0}, now=9.0, max_age_s=5.0)
