"""The bounded labels of the metrics: why a turn failed, a provider's status."""

from __future__ import annotations

import pytest

from supervisor.ops.metrics import FAILURE_KINDS, NO_METRICS, Recorder, failure_kind, provider_status


@pytest.mark.pure
def test_turn_failures_fall_into_a_fixed_set_of_reasons() -> None:
    cases = {
        "killed_memory: memory cap 64 MiB exceeded at 131 MiB (signal SIGKILL)": "killed_memory",
        "killed_turn_timeout: turn 3 ran past 60 s (signal SIGKILL)": "killed_turn_timeout",
        "crashed (signal SIGSEGV)": "crashed",
        "boot_failed: ImportError: no module x (exit code 3)": "boot_failed",
        "the session was stopped": "stopped",
        "the daemon stopped during this turn": "daemon_restart",
        "LLM provider error: provider answered HTTP 503: overloaded": "provider",
        "the turn could not be saved: disk full": "store",
        "internal error: KeyError: 'x'": "internal",
        "KeyError: 'missing' (at handler.py:12)": "handler",
        "my tool crashed": "handler",  # a handler's own words never pass for an exit reason
        "": "handler",
    }
    for reason, kind in cases.items():
        assert failure_kind(reason) == kind, reason
        assert kind in FAILURE_KINDS
    assert len(FAILURE_KINDS) == len(set(FAILURE_KINDS))


@pytest.mark.pure
def test_provider_status_is_three_digits_or_none() -> None:
    assert provider_status("provider answered HTTP 429: slow down") == "429"
    assert provider_status("LLM provider error: provider answered HTTP 500: x (gave up after 3 attempts)") == "500"
    assert provider_status("connection refused") == "none"
    assert provider_status("HTTP 99999 and HTTP 600") == "none"


@pytest.mark.pure
def test_the_off_recorder_does_nothing_and_imports_nothing() -> None:
    assert type(NO_METRICS) is Recorder
    NO_METRICS.commit(0.1, records=4)
    NO_METRICS.notice("provider_retry", {"error": "HTTP 500"})
    NO_METRICS.request("ping", "ok")


@pytest.mark.pure
def test_the_grafana_dashboard_queries_only_metrics_the_daemon_exports() -> None:
    import json
    import re

    from harness import REPO
    from supervisor.ops.metrics import PrometheusRecorder

    registry = PrometheusRecorder(lambda: [], lambda: 0).registry
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    exported = {family.name + suffix for family in registry.collect() for suffix in suffixes[family.type]}
    dashboard = json.loads((REPO / "contrib" / "grafana" / "sessiond.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {name for e in exprs for name in re.findall(r"\bsessiond_[a-z_]+", e)}
    assert named and named <= exported, named - exported
