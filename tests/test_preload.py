"""The zygote preloads the operator's handler modules (supervisor/spawn/preload.py,
session_worker/zygote.py): which modules, and a start-up that stops, naming
the module, when one cannot be imported or starts a thread."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO, env_for_children
from supervisor.config import parse_config
from supervisor.spawn import preload


@pytest.mark.pure
def test_every_handler_module_is_preloaded_once_in_order() -> None:
    cfg = parse_config({
        "agent": {"handler": "json:loads", "allowed_handlers": ["agent", "echo", "json:*", "string:*"],
                  "subagents": {"allowed_handlers": ["textwrap:*"]}},
        "tools": {"custom": ["fractions:Fraction"], "enabled": ["bash", "Fraction"]},
        "daemon": {"preload_modules": ["decimal", "json"]},
    }, "test")
    assert preload.modules(cfg) == ["json", "string", "textwrap", "fractions", "decimal"]


@pytest.mark.pure
def test_a_reload_naming_new_modules_says_they_wait_for_a_restart(caplog: pytest.LogCaptureFixture) -> None:
    old = parse_config({}, "old")
    new = parse_config({"daemon": {"preload_modules": ["decimal"]}}, "new")
    with caplog.at_level(logging.WARNING, logger="sessiond.zygote"):
        preload.reloaded(old, old)
        assert not caplog.records
        preload.reloaded(old, new)
    assert "has not preloaded (decimal)" in caplog.text and "until the daemon is restarted" in caplog.text


@pytest.mark.pure
def test_config_check_refuses_a_preload_module_it_cannot_find() -> None:
    with pytest.raises(Exception, match=r"daemon.preload_modules.*no_such_module_here"):
        parse_config({"daemon": {"preload_modules": ["no_such_module_here"]}}, "config.toml")
    with pytest.raises(Exception, match="not a module name"):
        parse_config({"daemon": {"preload_modules": ["not a module"]}}, "config.toml")


@pytest.mark.process
@pytest.mark.parametrize(("source", "said"), [
    ("raise RuntimeError('no database here')", "cannot preload module 'broken_mod': RuntimeError: no database here"),
    ("import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()",
     "preloading module 'broken_mod' started 1 thread(s) in the zygote"),
])
def test_a_module_that_fails_or_starts_a_thread_stops_the_start_up_naming_it(
        tmp_path: Path, source: str, said: str) -> None:
    (tmp_path / "broken_mod.py").write_text(source + "\n")
    (tmp_path / "config.toml").write_text('[daemon]\npreload_modules = ["broken_mod"]\nallow_root_tools = true\n')
    env = env_for_children()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "run", "--config", str(tmp_path / "config.toml"),
         "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert done.returncode != 0
    assert said in done.stderr, done.stderr
