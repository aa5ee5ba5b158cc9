"""The systemd integration files: the unit verifies, keeps its lifecycle and sandbox settings,
and agrees with the daemon's own timeouts; the sysusers/tmpfiles entries and the example
config are valid. Tests that run systemd tools skip when systemd is not installed."""

import re
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

from ringstream.daemon.common.config import Config, load_config
from ringstream.daemon.front.core import ABORT_GRACE_S
from ringstream.daemon.common.config_example import EXAMPLES, example_config
from ringstream.daemon.common.supervision import JOIN_GRACE_S

SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD_DIR / "ringstream.service"
SYSUSERS = SYSTEMD_DIR / "ringstream.sysusers"
TMPFILES = SYSTEMD_DIR / "ringstream.tmpfiles"
EXAMPLE_CONFIG = SYSTEMD_DIR / "ringstream.toml"
MAX_EXPOSURE = 2.0
"""Highest acceptable `systemd-analyze security` exposure (0 = locked down, 10 = unprotected)."""
TOOL_TIMEOUT_S = 60
EXAMPLE_NOT_DEFAULT = set(EXAMPLES)
"""Keys the example config shows with an example value rather than the default."""

TIME_UNITS_S = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "ms": 0.001}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Unit file -> {section: {key: [values in order]}} (keys may repeat; '\\' continues a line)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"malformed unit line: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(span: str) -> float:
    """A systemd time span such as ``60``, ``90s``, ``5min 20s`` -> seconds."""
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span):
        total += float(number) * TIME_UNITS_S[unit]
    return total


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


@pytest.fixture(scope="module")
def service(unit) -> dict[str, str]:
    """[Service] with the last assignment of each key winning, as systemd applies scalar settings."""
    return {key: values[-1] for key, values in unit["Service"].items()}


def systemd_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian package 'systemd'); .ci/run installs it")
    return path


# ---------------------------------------------------------------- systemd's own checks

@pytest.mark.e2e
def test_unit_passes_systemd_analyze_verify(tmp_path):
    """No unknown key, bad value or missing executable (ExecStart runs /usr/bin/env, present everywhere)."""
    analyze = systemd_tool("systemd-analyze")
    copy = tmp_path / UNIT.name
    shutil.copy(UNIT, copy)
    result = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True,
                            timeout=TOOL_TIMEOUT_S, cwd=tmp_path)
    about_unit = [line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line]
    assert result.returncode == 0, result.stderr
    assert about_unit == []


@pytest.mark.e2e
def test_security_exposure_stays_low(tmp_path):
    analyze = systemd_tool("systemd-analyze")
    copy = tmp_path / UNIT.name
    shutil.copy(UNIT, copy)
    result = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(copy)],
                            capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, cwd=tmp_path)
    if "--offline" in result.stderr and result.returncode != 0:
        pytest.skip(f"this systemd-analyze has no offline security review: {result.stderr.strip()}")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout + result.stderr)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout


@pytest.mark.e2e
def test_sysusers_entry_creates_the_service_user(tmp_path, service):
    sysusers = systemd_tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    for name in ("passwd", "group", "shadow", "gshadow"):
        (tmp_path / "etc" / name).touch()
    subprocess.run([sysusers, f"--root={tmp_path}", str(SYSUSERS)], check=True, capture_output=True,
                   timeout=TOOL_TIMEOUT_S)
    user = (tmp_path / "etc/passwd").read_text().strip().split(":")
    group = (tmp_path / "etc/group").read_text().strip().split(":")
    assert user[0] == service["User"] and group[0] == service["Group"]
    assert user[3] == group[2]  # the user's primary group is the service group
    assert user[5] == f"/var/lib/{service['StateDirectory']}"
    assert user[6].endswith("nologin")


@pytest.mark.e2e
def test_tmpfiles_entry_creates_the_configuration_directory(tmp_path, service):
    tmpfiles = systemd_tool("systemd-tmpfiles")
    subprocess.run([tmpfiles, f"--root={tmp_path}", "--create", str(TMPFILES)], check=True, capture_output=True,
                   timeout=TOOL_TIMEOUT_S)
    config_dir = tmp_path / "etc" / service["ConfigurationDirectory"]
    assert config_dir.is_dir()
    assert config_dir.stat().st_mode & 0o777 == 0o755


# ---------------------------------------------------------------- lifecycle

def test_lifecycle_settings(service):
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert re.search(r"\bringstream serve --config %E/ringstream/ringstream\.toml$", service["ExecStart"])
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["KillMode"] == "mixed"
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] == "on-failure"
    assert seconds(service["RestartSec"]) > 0
    assert service["RestartPreventExitStatus"] == "2"  # the CLI's exit status for a bad config


def test_timeouts_cover_the_daemons_own_deadlines(service):
    defaults = Config()
    # drain, abort confirmation, blocked-client flush, then Shutdown and SIGTERM joins of the workers
    worst_stop_s = defaults.drain_timeout_s + 2 * ABORT_GRACE_S + 2 * JOIN_GRACE_S
    assert seconds(service["TimeoutStopSec"]) > worst_stop_s
    assert seconds(service["TimeoutStartSec"]) > defaults.worker_start_timeout_s
    watchdog_s = seconds(service["WatchdogSec"])
    assert watchdog_s == 30
    assert watchdog_s >= 10 * defaults.worker_heartbeat_s  # a busy worker may miss a few beats


def test_identity_and_directories(unit, service):
    assert service["User"] == service["Group"] == "ringstream"
    for key in ("RuntimeDirectory", "StateDirectory", "CacheDirectory", "ConfigurationDirectory"):
        assert service[key] == "ringstream", key
    assert service["RuntimeDirectoryMode"] == "0750"  # group ringstream reaches the 0660 socket
    assert service["UMask"] == "0077"
    assert int(service["LimitNOFILE"]) >= 65536
    environment = dict(value.split("=", 1) for value in unit["Service"]["Environment"])
    assert environment["PATH"].split(":")[0] == "/opt/ringstream/bin"  # the documented virtual environment
    assert environment["HF_HUB_OFFLINE"] == "1"


# ---------------------------------------------------------------- sandbox

HARDENING = {
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateMounts": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "ProtectProc": "invisible",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "RemoveIPC": "yes",
    "SystemCallArchitectures": "native",
    "SystemCallErrorNumber": "EPERM",
    "IPAddressDeny": "any",
    "IPAddressAllow": "localhost",
    # deliberately relaxed, each explained in the unit
    "MemoryDenyWriteExecute": "no",
    "PrivateDevices": "no",
    "DevicePolicy": "closed",
}


@pytest.mark.parametrize("key,expected", sorted(HARDENING.items()))
def test_hardening_setting(service, key, expected):
    assert key in service, f"{key}= missing"
    assert service[key] == expected


def test_address_families_and_syscalls(unit):
    svc = unit["Service"]
    assert svc["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6 AF_NETLINK"]
    assert svc["SystemCallFilter"] == ["@system-service", "~@privileged"]


def test_gpus_and_rings_stay_reachable(unit):
    svc = unit["Service"]
    assert svc["DeviceAllow"] == ["char-nvidia* rw"]
    assert svc["ReadWritePaths"] == ["/dev/shm"]
    wants = " ".join(unit["Unit"]["Wants"])
    assert "modprobe@nvidia.service" in wants and "modprobe@nvidia-uvm.service" in wants


# ---------------------------------------------------------------- packaging entries and example config

def test_sysusers_and_tmpfiles_entries():
    sysusers = [line.split(maxsplit=3) for line in SYSUSERS.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert sysusers == [["u", "ringstream", "-", '"ringstream inference daemon"  /var/lib/ringstream']]
    tmpfiles = [line.split() for line in TMPFILES.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert tmpfiles == [["d", "/etc/ringstream", "0755", "root", "root", "-", "-"]]


def test_example_config_is_the_generated_one():
    assert EXAMPLE_CONFIG.read_text() == example_config(), (
        "systemd/ringstream.toml is not what `ringstream config` writes: run ringstream config > systemd/ringstream.toml")


def test_ringstream_config_prints_it(capsys):
    from ringstream.daemon.cli import main

    assert main(["config"]) == 0
    assert capsys.readouterr().out == example_config()


def test_example_config_is_valid_and_shows_the_defaults():
    assert load_config(EXAMPLE_CONFIG) == Config()
    defaults = Config()
    shown = 0
    for line in EXAMPLE_CONFIG.read_text().splitlines():
        match = re.match(r"^#\s*([a-z_]+)\s*=\s*(.+?)\s*(?:#.*)?$", line)
        if not match:
            continue
        key, value = match.groups()
        assert key in Config.__struct_fields__, f"example key {key!r} is not a config field"
        setting = msgspec.toml.decode(f"{key} = {value}".encode())
        if key in EXAMPLE_NOT_DEFAULT:  # of the right type (alone it may need another setting: api_key, http)
            msgspec.convert(setting, Config)
            continue
        parsed = load_config(None, **setting)
        if key not in EXAMPLE_NOT_DEFAULT:
            assert getattr(parsed, key) == getattr(defaults, key), f"example {key} = {value} is not the default"
        shown += 1
    assert shown >= 10
    unset = [key for key in Config.__struct_fields__ if getattr(defaults, key) is None]
    assert sorted(EXAMPLES) == sorted(unset), "each setting unset by default needs a value to uncomment"
    text = EXAMPLE_CONFIG.read_text()
    missing = [key for key in Config.__struct_fields__ if not re.search(rf"^#\s*{key}\b", text, re.M)]
    assert not missing, f"the example config lacks {missing}: every setting belongs in it"
