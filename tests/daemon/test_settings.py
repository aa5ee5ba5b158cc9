"""Live settings: all or nothing, any-case log level, notes for what a worker cannot run, no change noticed."""

from __future__ import annotations

import pytest

from ringstream.daemon.common.config import Config, load_config
from ringstream.daemon.common.settings import LIVE_SETTINGS, change_settings, reload_changes


def test_a_change_returns_the_new_config_and_only_what_differs():
    config = Config()
    result = change_settings(config, {"max_concurrency": 8, "queue_size": config.queue_size})
    assert result.config.max_concurrency == 8
    assert result.changed == {"max_concurrency": 8}
    assert result.notes == ()
    assert config.max_concurrency == 64  # the old config is untouched


def test_nothing_changed_is_said_so():
    config = Config()
    result = change_settings(config, {"max_concurrency": config.max_concurrency, "log_level": "INFO"})
    assert result.changed == {} and result.config is config


@pytest.mark.parametrize("level", ["DEBUG", "Debug", "debug"])
def test_log_level_in_any_case(level):
    assert change_settings(Config(), {"log_level": level}).config.log_level == "debug"


def test_log_level_in_any_case_from_the_config_file_too(tmp_path):
    path = tmp_path / "ringstream.toml"
    path.write_text('log_level = "WARNING"\n')
    assert load_config(path).log_level == "warning"


def test_max_concurrency_above_the_workers_slots_says_what_takes_effect():
    result = change_settings(Config(), {"max_concurrency": 1000}, max_num_seqs=[64, 32])
    assert result.config.max_concurrency == 1000
    (note,) = result.notes
    assert "takes effect as 32" in note and "max_num_seqs=32" in note
    assert change_settings(Config(), {"max_concurrency": 16}, max_num_seqs=[64, 32]).notes == ()


@pytest.mark.parametrize("changes, words", [
    ({"max_num_seqs": 8}, "not a live setting: max_num_seqs"),
    ({"max_concurrency": 0}, "max_concurrency = 0"),
    ({"log_level": "loud"}, "log_level"),
    ({"queue_size": "many"}, "queue_size"),
    ({"aging_rate": float("inf")}, "aging_rate = inf"),  # every queue key inf: priorities lost
    ({"aging_rate": float("nan")}, "aging_rate = nan"),
    ({"aging_rate": 1e12}, "aging_rate"),
])
def test_bad_changes_are_refused_whole(changes, words):
    config = Config()
    with pytest.raises(ValueError, match=words):
        change_settings(config, {"queue_size": 5, **changes})
    assert config.queue_size != 5


def test_queue_timeout_zero_means_none():
    config = change_settings(Config(), {"queue_timeout_s": 2.0}).config
    assert change_settings(config, {"queue_timeout_s": 0}).config.queue_timeout_s is None


def test_reload_separates_live_from_restart_settings():
    live, restart = reload_changes(Config(), Config(max_concurrency=4, max_num_seqs=8, block_size=32))
    assert live == {"max_concurrency": 4}
    assert restart == ["block_size", "max_num_seqs"]
    assert set(live) <= set(LIVE_SETTINGS)


def test_the_environments_api_key_yields_to_a_key_file_at_start_and_at_each_reload(tmp_path, monkeypatch):
    from ringstream.daemon.common.config import API_KEY_ENV, load_serve_config

    monkeypatch.setenv(API_KEY_ENV, "envkey")
    config_file = tmp_path / "ringstream.toml"
    config_file.write_text('http = "127.0.0.1:8000"\n')
    assert load_serve_config(config_file, {}).api_key == "envkey"
    config_file.write_text('http = "127.0.0.1:8000"\napi_key_file = "/etc/ringstream/key"\n')  # then a reload
    config = load_serve_config(config_file, {})
    assert (config.api_key, config.api_key_file) == (None, "/etc/ringstream/key")
    assert load_serve_config(None, {}).api_key is None  # no HTTP: unused
    monkeypatch.setenv(API_KEY_ENV, "  ")
    with pytest.raises(ValueError, match="RINGSTREAM_API_KEY is set but empty"):
        load_serve_config(None, {"http": "127.0.0.1:8000"})


@pytest.mark.parametrize("port", [0, -5, 70000])
def test_a_metrics_port_out_of_range_is_a_bad_setting(port):
    with pytest.raises(ValueError, match=f"metrics_port = {port}: a TCP port is 1 to 65535"):
        load_config(None, metrics_port=port)


def test_an_unknown_setting_is_answered_with_the_closest_one():
    with pytest.raises(ValueError, match=r"unknown field `max_num_seq` \(did you mean max_num_seqs\?\)"):
        load_config(None, max_num_seq=3)
    with pytest.raises(ValueError, match=r"unknown field `zzz` \(ringstream config lists every setting\)"):
        load_config(None, zzz=1)
