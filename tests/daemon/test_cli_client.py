"""The CLI's client commands against a synthetic daemon: defaults, stop strings, stdin, $RINGSTREAM_SOCKET, --version."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import msgspec
import pytest

import ringstream
from ringstream.daemon import cli
from ringstream.ipc import address
from ringstream.ipc.client import GENERATE_DEFAULTS, AsyncClient, Client, InvalidRequest
from tests.other_uid import as_other_user

SYNTHETIC = ("--engine", "synthetic", "--synthetic-step-ms", "1", "--devices", "cpu")
CLIENT_DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon(*SYNTHETIC)


@pytest.fixture
def no_default_socket(monkeypatch, tmp_path):
    """No $RINGSTREAM_SOCKET, no systemd socket, a per-user socket in ``tmp_path`` where no daemon runs."""
    monkeypatch.delenv(address.SOCKET_ENV, raising=False)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(address, "SYSTEMD_SOCKET", str(tmp_path / "no-service.sock"))
    return monkeypatch


def _json_chunks(out: str) -> list[dict]:
    return [msgspec.json.decode(line) for line in out.splitlines()]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"ringstream {ringstream.__version__}\n"


@pytest.mark.e2e
def test_generate_dash_reads_the_prompt_from_stdin(daemon, capsys, monkeypatch):
    with Client(daemon.address) as client:
        expected = client.complete("Return the", max_tokens=2).usage.prompt_tokens
        dash = client.complete("-", max_tokens=2).usage.prompt_tokens
    assert expected != dash
    monkeypatch.setattr("sys.stdin", io.StringIO("Return the\n"))
    assert cli.main(["generate", "--socket", daemon.address, "--max-tokens", "2", "--json", "-"]) == 0
    assert _json_chunks(capsys.readouterr().out)[-1]["usage"]["prompt_tokens"] == expected


@pytest.mark.e2e
def test_the_cli_and_the_library_share_one_set_of_defaults(daemon, capsys):
    generate = cli.build_parser().parse_args(["generate", "x"])
    assert (generate.max_tokens, generate.temperature, generate.top_p, generate.top_k, generate.priority) == tuple(
        GENERATE_DEFAULTS[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "priority"))
    assert cli.main(["generate", "--socket", daemon.address, "--ignore-eos", "--json", "x"]) == 0
    from_cli = _json_chunks(capsys.readouterr().out)[-1]["usage"]["completion_tokens"]
    with Client(daemon.address) as client:
        from_library = client.complete("x", ignore_eos=True).usage.completion_tokens
    assert from_cli == from_library == GENERATE_DEFAULTS["max_tokens"]


def test_the_client_docs_state_the_defaults():
    [paragraph] = [p for p in CLIENT_DOC.read_text().split("\n\n") if p.startswith("Defaults of a request")]
    stated = dict(re.findall(r"`(\w+)=([^`]+)`", paragraph))
    assert stated and {k: str(GENERATE_DEFAULTS[k]) for k in stated} == stated


@pytest.mark.e2e
def test_a_stop_string_or_a_list_of_them(daemon, capsys):
    params = dict(prompt_token_ids=[5, 6, 7], max_tokens=20, ignore_eos=True)
    with Client(daemon.address) as client:
        one = client.complete(stop=" t3", **params)
        several = client.complete(stop=[" t5", " t2"], **params)

    async def run_async():
        async with AsyncClient(daemon.address) as client:
            return await client.complete(stop=" t3", **params)

    assert (one.text, one.finish_reason, one.stop_reason) == (" t0 t1 t2", "stop", " t3")
    assert asyncio.run(run_async()).text == " t0 t1 t2"
    assert several.text == " t0 t1"
    assert cli.main(["generate", "--socket", daemon.address, "--ignore-eos", "--stop", " t1", "x"]) == 0
    assert capsys.readouterr().out == " t0"


@pytest.mark.e2e
def test_async_admin_changes_and_refuses_settings(daemon):
    async def main():
        async with AsyncClient(daemon.address) as client:
            before = (await client.status()).settings["max_concurrency"]
            try:
                assert (await client.admin(max_concurrency=3)).settings["max_concurrency"] == 3
                with pytest.raises(InvalidRequest, match="max_concurrency"):
                    await client.admin(max_concurrency=0)
            finally:
                await client.admin(max_concurrency=before)

    asyncio.run(main())


@pytest.mark.e2e
def test_ringstream_socket_names_the_daemon_for_the_cli_and_the_library(daemon, no_default_socket, capsys, tmp_path):
    assert cli.main(["status"]) == 1
    assert "the socket file does not exist" in capsys.readouterr().err
    no_default_socket.setenv(address.SOCKET_ENV, daemon.address)
    assert cli.main(["status", "--json"]) == 0
    assert msgspec.json.decode(capsys.readouterr().out)["ready"] is True
    assert cli.main(["generate", "--max-tokens", "2", "--ignore-eos", "x"]) == 0
    assert capsys.readouterr().out == " t0 t1"
    with Client() as client:
        assert client.address == daemon.address and client.status().ready
    # an explicit --socket or --instance still wins
    assert cli.main(["status", "--socket", f"ipc://{tmp_path}/elsewhere.sock"]) == 1
    assert cli.main(["status", "--instance", "elsewhere"]) == 1
    assert capsys.readouterr().err.count("does not exist") == 2
    no_default_socket.setenv(address.SOCKET_ENV, "localhost:5555")
    assert cli.main(["status"]) == 1
    assert "RINGSTREAM_SOCKET 'localhost:5555': use ipc://PATH or tcp://HOST:PORT" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_cli_says_permission_denied_for_a_socket_in_a_closed_folder():
    top = Path(tempfile.mkdtemp(prefix="ringstream-cli-"))
    try:
        top.chmod(0o755)
        closed = top / "closed"
        closed.mkdir(mode=0o700)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(closed / "d.sock"))
            listener.listen()
            if os.geteuid() != 0:
                closed.chmod(0o000)

            def action() -> str:
                err = io.StringIO()
                with contextlib.redirect_stderr(err):
                    code = cli.main(["status", "--socket", f"ipc://{closed}/d.sock"])
                return f"{code} {err.getvalue()}"

            try:
                report = as_other_user(action)
            finally:
                closed.chmod(0o700)
    finally:
        shutil.rmtree(top)
    assert report.startswith("1 ") and "permission denied" in report and "does not exist" not in report, report


@pytest.mark.parametrize("argv,expected", [
    (["--max-tokens", "5", "generate", "x"], ["generate", "--max-tokens", "5", "x"]),
    (["--socket", "ipc:///s", "status", "--json"], ["status", "--socket", "ipc:///s", "--json"]),
    (["admin", "--instance", "x", "set", "k=v"], ["admin", "set", "--instance", "x", "k=v"]),
    (["--version"], ["--version"]),
    (["generate", "--max-tokens", "5", "x"], ["generate", "--max-tokens", "5", "x"]),
    # an option's value is never the command: the status of instance "serve", a demo of model "serve"
    (["--instance", "serve", "status"], ["status", "--instance", "serve"]),
    (["--model", "demo", "serve"], ["serve", "--model", "demo"]),
    (["--instance=serve", "status"], ["status", "--instance=serve"]),
    (["--ignore-eos", "generate", "x"], ["generate", "--ignore-eos", "x"]),
    (["admin", "--instance", "set", "set", "k=v"], ["admin", "set", "--instance", "set", "k=v"]),
    (["--", "serve"], ["serve"]),
    (["--inst", "serve", "status"], ["status", "--inst", "serve"]),  # argparse's prefixes
    (["--mod", "demo", "serve"], ["serve", "--mod", "demo"]),
    (["--instance", "x", "nonsense", "serve"], ["--instance", "x", "nonsense", "serve"]),  # left to the parser
])
def test_options_before_their_command_are_moved_after_it(argv, expected):
    assert cli.reorder_options(argv) == expected


def test_the_serve_flags_people_reach_for_become_settings(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr("ringstream.daemon.front.shell.serve", lambda config, path, overrides: seen.update(
        config=config, overrides=overrides) or 0)
    monkeypatch.setattr("ringstream.daemon.common.proctitle.set_process_title", lambda title: None)
    assert cli.main(["serve", "--port", "8123", "--dtype", "bfloat16", "--max-num-seqs", "8",
                     "--memory-utilization", "0.5", "--served-model-name", "m"]) == 0
    config = seen["config"]
    assert (config.http, config.dtype, config.max_num_seqs, config.memory_utilization, config.served_model_name) == (
        "127.0.0.1:8123", "bfloat16", 8, 0.5, "m")
    assert cli.main(["serve", "--port", "1", "--http", "127.0.0.1:2"]) == 2
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert cli.main(["serve", "--http", "0.0.0.0:8123"]) == 0  # a key (here from the environment) allows it
    assert seen["config"].api_key == "from-env"
    assert cli.main(["serve", "--api-key", "k", "--port", "1"]) == 0 and seen["config"].api_key == "k"
    assert cli.main(["serve", "--api-key", "k", "--api-key-file", "/etc/key", "--port", "1"]) == 2
    # the environment's key yields to a key file, given as a flag or in the config, and to no HTTP at all
    assert cli.main(["serve", "--api-key-file", "/etc/key", "--port", "1"]) == 0
    assert (seen["config"].api_key, seen["config"].api_key_file) == (None, "/etc/key")
    config_file = tmp_path / "ringstream.toml"
    config_file.write_text('api_key_file = "/etc/key"\n')
    assert cli.main(["serve", "--config", str(config_file), "--port", "1"]) == 0
    assert (seen["config"].api_key, seen["config"].api_key_file) == (None, "/etc/key")
    assert cli.main(["serve"]) == 0 and seen["config"].api_key is None
    assert cli.main(["serve", "--port", "99999"]) == 2
    assert "0 to 65535" in capsys.readouterr().err
