"""config.toml: defaults, validation errors that name key and file, overrides."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness import env_for_children
from supervisor.config import (
    Config,
    default_toml,
    load_config,
    parse_config,
    parse_override,
)
from supervisor.errors import ConfigError


@pytest.mark.pure
def test_default_toml_round_trips() -> None:
    text = default_toml()
    assert parse_config(tomllib.loads(text), "default") == Config()
    for section in ("[agent]", "[agent.limits]", "[agent.worker]", "[agent.subagents]",
                    "[agent.loop]", "[daemon]", "[provider]", "[tools]"):
        assert section in text


@pytest.mark.process
def test_sessiond_config_default_and_check(tmp_path: Path) -> None:
    env = env_for_children()
    out = subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "default"],
                         capture_output=True, text=True, env=env, check=True).stdout
    path = tmp_path / "c.toml"
    path.write_text(out)
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "check", str(path)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


@pytest.mark.pure
@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[agent]\nmax_turns = 'many'\n", "agent.max_turns"),
        ("[agent]\nmax_turns = 0\n", "agent.max_turns"),
        ("[agent.limits]\nmax_memory_mb = -1\n", "agent.limits.max_memory_mb"),
        ("[agent.limits]\nbogus = 1\n", "agent.limits.bogus"),
        ("[daemon]\nsocket_mode = 'rwx'\n", "daemon.socket_mode"),
        ("[nope]\nx = 1\n", "nope"),
        ("[[permissions]]\ntool = 'bash'\naction = 'maybe'\n", "permissions"),
        ("[provider]\nkind = 'smoke-signals'\n", "provider.kind"),
    ],
)
def test_bad_keys_and_values_name_the_key_and_the_file(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert key in str(err.value) and str(path) in str(err.value)


@pytest.mark.pure
def test_not_toml_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[agent\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.pure
def test_parse_override_values() -> None:
    assert parse_override("a.b=64") == ("a.b", 64)
    assert parse_override("a.b=1.5") == ("a.b", 1.5)
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override('a.b=["x", "y"]') == ("a.b", ["x", "y"])
    assert parse_override("a.b=hello world") == ("a.b", "hello world")
    with pytest.raises(ConfigError):
        parse_override("novalue")


@pytest.mark.pure
def test_retention_must_fit_a_clients_buffer() -> None:
    with pytest.raises(ConfigError, match="event_retention_bytes.*client_buffer_bytes"):
        parse_config({"daemon": {"event_retention_bytes": 4 << 20, "client_buffer_bytes": 1 << 20}}, "c.toml")


@pytest.mark.pure
def test_bad_session_uid_range_and_handler_patterns_name_the_key() -> None:
    for bad in ("1-2", "x-y", "70000-60000", "60000-70000"):
        with pytest.raises(ConfigError, match="daemon.session_uid_range"):
            parse_config({"daemon": {"session_uid_range": bad}}, "c.toml")
    with pytest.raises(ConfigError, match="agent.allowed_handlers"):
        parse_config({"agent": {"allowed_handlers": ["../x:y"]}}, "c.toml")
    assert parse_config({"daemon": {"session_uid_range": ""}}, "c.toml").daemon.session_uid_range == ""


@pytest.mark.pure
def test_metrics_listen_takes_host_port_or_a_socket_path_and_names_the_key() -> None:
    from supervisor.config import metrics_address

    assert Config().daemon.metrics_listen == "" and metrics_address("") is None
    assert metrics_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert metrics_address("[::1]:0") == ("::1", 0)
    assert metrics_address("localhost:9464") == ("localhost", 9464)
    assert metrics_address("/run/sessiond/metrics.sock") == "/run/sessiond/metrics.sock"
    for good in ("0.0.0.0:9464", "[::]:9464", "/tmp/m.sock"):
        assert parse_config({"daemon": {"metrics_listen": good}}, "c.toml").daemon.metrics_listen == good
    for bad in ("9464", "127.0.0.1", "127.0.0.1:", ":9464", "127.0.0.1:99999", "host:port",
                "::1:9464", "a b:1", "relative/path.sock", "/" + "x" * 120, "http://127.0.0.1:9464"):
        with pytest.raises(ConfigError, match=r"c\.toml: invalid value for 'daemon\.metrics_listen'"):
            parse_config({"daemon": {"metrics_listen": bad}}, "c.toml")
    assert "metrics_listen = \"\"" in default_toml()
    assert "# Prometheus metrics at http://HOST:PORT/metrics" in default_toml()
