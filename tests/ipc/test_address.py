"""Where clients look for the daemon ($RINGSTREAM_SOCKET, the systemd socket, per-user), and why nothing answers."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from ringstream.ipc import address
from ringstream.ipc.address import client_socket, default_socket, unix_socket_listening, unreachable
from tests.other_uid import as_other_user


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A user session in ``tmp_path`` with no $RINGSTREAM_SOCKET and no systemd service socket."""
    monkeypatch.delenv(address.SOCKET_ENV, raising=False)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(address, "SYSTEMD_SOCKET", str(tmp_path / "no-service" / "ringstream.sock"))
    return monkeypatch


@pytest.fixture
def listener(tmp_path):
    """A unix socket that listens, in ``tmp_path``."""
    path = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        sock.listen()
        yield path


@pytest.fixture
def open_dir():
    """A directory every user may traverse (pytest's own tmp directories are owner-only)."""
    path = Path(tempfile.mkdtemp(prefix="ringstream-addr-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_the_per_user_socket_is_the_fallback(env, tmp_path):
    assert client_socket() == f"ipc://{tmp_path}/ringstream/default.sock" == default_socket()


def test_ringstream_socket_names_the_socket_unless_an_instance_is_given(env, tmp_path, listener):
    env.setenv(address.SOCKET_ENV, "tcp://127.0.0.1:5999")
    assert client_socket() == "tcp://127.0.0.1:5999"
    env.setattr(address, "SYSTEMD_SOCKET", str(listener))  # the variable also wins over the service's socket
    assert client_socket() == "tcp://127.0.0.1:5999"
    assert client_socket("other") == f"ipc://{tmp_path}/ringstream/other.sock"


def test_a_ringstream_socket_that_is_no_address_is_refused(env):
    env.setenv(address.SOCKET_ENV, "/run/x.sock")
    with pytest.raises(ValueError, match="RINGSTREAM_SOCKET '/run/x.sock': use ipc://PATH or tcp://HOST:PORT"):
        client_socket()


def test_the_systemd_socket_is_used_when_it_exists(env, tmp_path, listener):
    env.setattr(address, "SYSTEMD_SOCKET", str(listener))
    assert client_socket() == f"ipc://{listener}"
    listener.unlink()
    assert client_socket() == f"ipc://{tmp_path}/ringstream/default.sock"


@pytest.mark.e2e
def test_a_systemd_socket_in_a_closed_folder_counts_as_there(env, open_dir):
    closed = open_dir / "ringstream"
    closed.mkdir(mode=0o700)
    (closed / "ringstream.sock").touch()
    env.setattr(address, "SYSTEMD_SOCKET", str(closed / "ringstream.sock"))
    if os.geteuid() != 0:
        closed.chmod(0o000)
    try:
        assert as_other_user(client_socket) == f"ipc://{closed}/ringstream.sock"
    finally:
        closed.chmod(0o700)


def test_unreachable_tells_missing_stale_and_listening_sockets_apart(tmp_path, listener):
    missing = f"ipc://{tmp_path}/missing.sock"
    assert unreachable(missing) == f"no daemon at {missing} (the socket file does not exist)"
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(stale))  # the file stays, nobody listens: a killed daemon's socket
    assert "a stale socket file" in unreachable(f"ipc://{stale}")
    assert unreachable(f"ipc://{listener}") is None
    assert unreachable("tcp://127.0.0.1:1") is None  # only ipc sockets are checked
    assert unix_socket_listening(str(listener)) and not unix_socket_listening(str(stale))
    assert not unix_socket_listening(str(tmp_path / "missing.sock"))


@pytest.mark.e2e
def test_a_socket_in_a_closed_folder_is_permission_denied_not_missing(open_dir):
    closed = open_dir / "closed"
    closed.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(closed / "d.sock"))
        sock.listen()
        if os.geteuid() != 0:
            closed.chmod(0o000)
        try:
            reason = as_other_user(lambda: unreachable(f"ipc://{closed}/d.sock"))
        finally:
            closed.chmod(0o700)
    assert "permission denied" in reason and "does not exist" not in reason, reason


def test_the_systemd_socket_is_where_the_service_binds(monkeypatch):
    unit = Path(__file__).resolve().parents[2] / "systemd" / "ringstream.service"
    [runtime] = [line.split("=", 1)[1] for line in unit.read_text().splitlines() if line.startswith("RuntimeDirectory=")]
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"/run/{runtime}")  # what systemd gives the daemon
    assert default_socket() == f"ipc://{address.SYSTEMD_SOCKET}"
