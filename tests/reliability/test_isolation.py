"""Isolation: file modes of the socket and rings, other uids, loopback-only TCP, CURVE, read-only inspection.

Checks that need another uid fork a child that drops to ``nobody``
(:func:`tests.other_uid.run_as`), so they need root.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import zmq.auth

from ringstream.daemon import cli
from ringstream.daemon.common.config import load_config
from ringstream.ipc.client import Client, DaemonUnavailable, InvalidRequest
from tests.daemon_helpers import running_daemon
from tests.other_uid import NOBODY, run_as
from tests.reliability.helpers import write_config
from ringstream.tools import ringtop

pytestmark = pytest.mark.e2e

START_S = 60.0
SYNTHETIC = ("--engine", "synthetic", "--devices", "cpu")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another uid")


@pytest.fixture
def open_dir():
    """A directory every user may traverse (pytest's own tmp directories are owner-only)."""
    path = Path(tempfile.mkdtemp(prefix="ringstream-iso-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _connect(path: str):
    def action() -> int:
        with socket.socket(socket.AF_UNIX) as sock:
            try:
                sock.connect(path)
            except PermissionError:
                return 13
            return 0
    return action


def _open(path: str, flags: int):
    def action() -> int:
        try:
            os.close(os.open(path, flags))
        except PermissionError:
            return 13
        return 0
    return action


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_daemons_internal_sockets_are_owner_only(tmp_path):
    with running_daemon(tmp_path, *SYNTHETIC) as d:
        internal = sorted(p for p in (tmp_path / "ringstream").iterdir() if p.suffix in (".events", ".cmd"))
        assert sorted(p.suffix for p in internal) == [".cmd", ".events"]  # one worker's commands, the workers' events
        assert all(_mode(str(p)) == 0o600 for p in internal), {p.name: oct(_mode(str(p))) for p in internal}


@needs_root
def test_owner_only_modes_keep_other_uids_out(open_dir):
    with running_daemon(open_dir, *SYNTHETIC) as d:
        sock_path = d.address[len("ipc://"):]
        [ring] = d.segments()
        assert _mode(sock_path) == 0o600 and os.stat(sock_path).st_uid == os.getuid()
        assert _mode(ring) == 0o600
        assert run_as(NOBODY, NOBODY, _connect(sock_path)) == (13, "")
        assert run_as(NOBODY, NOBODY, _open(ring, os.O_RDONLY)) == (13, "")
        # controls: the same child reaches a socket and a segment whose mode lets it
        control_sock = socket.socket(socket.AF_UNIX)
        control_path = str(open_dir / "control.sock")
        control_sock.bind(control_path)
        control_sock.listen()
        os.chmod(control_path, 0o666)
        control_ring = f"/dev/shm/ringstream-control-{os.getpid()}"
        Path(control_ring).write_bytes(b"x")
        os.chmod(control_ring, 0o644)
        try:
            assert run_as(NOBODY, NOBODY, _connect(control_path)) == (0, "")
            assert run_as(NOBODY, NOBODY, _open(control_ring, os.O_RDONLY)) == (0, "")
        finally:
            control_sock.close()
            os.unlink(control_ring)
        with Client(d.address) as client:  # the owner is served as ever
            assert client.complete(prompt_token_ids=[5, 6, 7], max_tokens=3).usage.completion_tokens == 3


@needs_root
def test_ringstream_top_needs_only_group_read_access(open_dir):
    config = write_config(open_dir, "socket_mode = 0o660\n")
    with running_daemon(open_dir, *SYNTHETIC, "--config", config) as d:
        [ring] = d.segments()
        assert _mode(d.address[len("ipc://"):]) == 0o660
        assert _mode(ring) == 0o640 and os.stat(ring).st_gid == os.getgid()
        group = os.getgid()
        assert run_as(NOBODY, group, _open(ring, os.O_RDWR)) == (13, "")  # the group may not write
        code, output = run_as(NOBODY, group, lambda: ringtop.main(
            ["--instance", d.instance, "--once", "--json", "--interval", "0.2"]))
        assert code == 0, output
        [seen] = json.loads(output)["rings"]
        assert seen["name"] == os.path.basename(ring) and seen["error"] is None
        assert seen["owner_pid"] == d.proc.pid


def test_tcp_binds_loopback_only_without_curve(tmp_path):
    for host in ("0.0.0.0", "10.1.2.3", "*", "[::]"):
        with running_daemon(tmp_path, *SYNTHETIC, "--socket", f"tcp://{host}:5999", ready=False) as d:
            assert d.proc.wait(START_S) == 2
            assert "TCP binds loopback only unless CURVE is configured" in d.log()
    keys = tmp_path / "keys"
    keys.mkdir()
    _, secret = zmq.auth.create_certificates(keys, "server")
    config = load_config(None, socket="tcp://0.0.0.0:5999", curve_secret_key_file=secret,
                         curve_allowed_clients_dir=str(keys))
    assert config.address() == "tcp://0.0.0.0:5999"  # with CURVE a non-loopback address is accepted
    with pytest.raises(ValueError, match="give both or neither"):
        load_config(None, curve_secret_key_file=secret)


@pytest.fixture
def curve_keys(tmp_path):
    """Server, allowed-client and stranger key pairs; only the client's public key is in the allowed directory."""
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    pairs = {}
    for name in ("server", "client", "stranger"):
        public_file, secret_file = zmq.auth.create_certificates(keys, name)
        pairs[name] = zmq.auth.load_certificate(secret_file) + (secret_file,)
    shutil.copy(keys / "client.key", allowed / "client.key")
    return pairs, allowed


def _curve_daemon_settings(tmp_path, pairs, allowed) -> tuple[str, str]:
    """A free loopback TCP address and a config file with the server's key and the allowed-clients directory."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = write_config(tmp_path, f'curve_secret_key_file = "{pairs["server"][2]}"\n'
                                    f'curve_allowed_clients_dir = "{allowed}"\n')
    return f"tcp://127.0.0.1:{port}", config


def test_curve_on_loopback_admits_only_listed_clients(tmp_path, curve_keys, capsys):
    pairs, allowed = curve_keys
    server_public = pairs["server"][0]
    address, config = _curve_daemon_settings(tmp_path, pairs, allowed)
    with running_daemon(tmp_path, *SYNTHETIC, "--socket", address, "--config", config, ready=False) as d:
        def client(name: str | None, **kwargs) -> Client:
            keys = {} if name is None else dict(curve_server_key=server_public, curve_public_key=pairs[name][0],
                                                curve_secret_key=pairs[name][1])
            return Client(address, **keys, **kwargs)

        with client("client") as trusted:
            trusted.wait_ready(START_S)
            done = trusted.complete(prompt_token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True)
            assert done.finish_reason == "length" and done.text == "".join(f" t{i}" for i in range(8))
            with pytest.raises(InvalidRequest, match="admin is accepted only on an ipc socket"):
                trusted.admin(max_concurrency=1)
        for name in (None, "stranger"):  # no CURVE at all, or a key the daemon does not list
            with client(name, timeout_s=1.0) as outsider:
                with pytest.raises(DaemonUnavailable):
                    outsider.status()
        with pytest.raises(ValueError, match="together"):
            Client(address, curve_server_key=server_public)
        server_cert = Path(pairs["server"][2]).with_name("server.key")  # the public half only
        cli_args = ["generate", "--socket", address, "--curve-server-cert", str(server_cert), "--max-tokens", "4",
                    "--ignore-eos", "--json", "x"]
        assert cli.main(cli_args + ["--curve-cert", pairs["client"][2]]) == 0
        chunks = [msgspec.json.decode(line) for line in capsys.readouterr().out.splitlines()]
        # A chunk may carry several tokens (the front sends what the ring holds when it reads): count tokens, not lines.
        assert [c["seq"] for c in chunks] == list(range(len(chunks)))
        assert sum(len(c["token_ids"]) for c in chunks) == 4 and chunks[-1]["finish_reason"] == "length"
        assert cli.main(cli_args + ["--curve-cert", str(server_cert)]) == 1  # a public certificate: no secret
        assert "holds no secret key" in capsys.readouterr().err
        segments = d.segments()
        assert d.stop() == 0
    assert segments and not glob.glob(f"/dev/shm/ringstream-{d.instance}-*")
    assert "CURVE: 1 client key(s) allowed" in d.log()


def test_a_curve_daemon_reloads_its_allow_list_on_sighup(tmp_path, curve_keys):
    pairs, allowed = curve_keys
    server_public = pairs["server"][0]
    address, config = _curve_daemon_settings(tmp_path, pairs, allowed)
    stranger = dict(curve_server_key=server_public, curve_public_key=pairs["stranger"][0],
                    curve_secret_key=pairs["stranger"][1])
    with running_daemon(tmp_path, *SYNTHETIC, "--socket", address, "--config", config, ready=False) as d:
        with Client(address, curve_server_key=server_public, curve_public_key=pairs["client"][0],
                    curve_secret_key=pairs["client"][1]) as trusted:
            trusted.wait_ready(START_S)
        shutil.copy(Path(pairs["stranger"][2]).with_name("stranger.key"), allowed / "stranger.key")
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "CURVE: 2 client key(s) allowed" not in d.log():
            assert time.monotonic() < deadline, "allow-list not reloaded"
            time.sleep(0.05)
        with Client(address, timeout_s=5.0, **stranger) as now_trusted:
            assert now_trusted.status().ready
        assert d.stop() == 0
