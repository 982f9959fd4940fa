"""The bounded labels of the metrics: why a turn failed, a provider's status."""

from __future__ import annotations

import pytest

from supervisor.core.recorder import NO_METRICS
from supervisor.core.recorder import NoMetrics as Recorder  # (the off recorder)
from supervisor.ops.metrics import FAILURE_KINDS, failure_kind, provider_status


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
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",),
                "info": ("_info",)}
    exported = {family.name + suffix for family in registry.collect() for suffix in suffixes[family.type]}
    dashboard = json.loads((REPO / "contrib" / "grafana" / "sessiond.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {name for e in exprs for name in re.findall(r"\bsessiond_[a-z_]+", e)}
    assert named and named <= exported, named - exported


def _scrape(recorder) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:  # type: ignore[no-untyped-def]
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(recorder.exposition()[0].decode())
            for s in family.samples}


@pytest.mark.component
def test_a_fresh_daemon_s_metrics_have_every_known_series_at_0_its_process_and_its_build() -> None:
    from ipc.contract import ExitReason
    from supervisor import __version__
    from supervisor.ops.labels import TOOL_KINDS, TOOL_OUTCOMES
    from supervisor.ops.metrics import PrometheusRecorder

    s = _scrape(PrometheusRecorder(lambda: [], lambda: 0))
    names = {name for name, _ in s}
    # The daemon's own process (prometheus-client's collector) and its build.
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
            "process_start_time_seconds"} <= names, names
    (build,) = [labels for name, labels in s if name == "sessiond_build_info"]
    assert dict(build)["version"] == __version__ and s[("sessiond_build_info", build)] == 1
    # Each labelled counter at 0 for each value it knows, before any event,
    # so that increase() sees the first one.
    zero = {(name, labels) for (name, labels), value in s.items() if value == 0}
    for reason in ExitReason:
        assert ("sessiond_worker_exits_total", (("reason", reason.value),)) in zero
    for reason in FAILURE_KINDS:
        assert ("sessiond_turns_failed_total", (("reason", reason),)) in zero
    for kind in TOOL_KINDS:
        for outcome in TOOL_OUTCOMES:
            assert ("sessiond_tool_calls_total", (("kind", kind), ("outcome", outcome))) in zero
    for outcome in ("ok", "failed"):
        assert ("sessiond_mcp_server_starts_total", (("outcome", outcome),)) in zero
    for outcome in ("exported", "failed", "dropped"):
        assert ("sessiond_trace_spans_total", (("outcome", outcome),)) in zero
    assert ("sessiond_provider_errors_total", (("status", "429"),)) in zero
    assert ("sessiond_budget_exceeded_total", (("ceiling", "turn_max_llm_calls"),)) in zero
    assert ("sessiond_control_requests_total", (("code", "ok"), ("type", "send"))) in zero
    # Turn durations resolve 1 to 50 ms (an echo's turn takes 5-15).
    bounds = sorted(float(dict(labels)["le"]) for name, labels in s if name == "sessiond_turn_duration_seconds_bucket")
    assert sum(0.001 <= b <= 0.05 for b in bounds) >= 6, bounds
    assert {0.005, 0.025, 0.1, 0.5, 1.0, 900.0} <= set(bounds), "the old boundaries stay (dashboards)"


@pytest.mark.component
def test_tool_calls_and_mcp_starts_are_counted_from_the_workers_notices() -> None:
    from supervisor.ops.metrics import PrometheusRecorder

    stats = {"exported": 7, "failed": 1, "dropped": 2, "queued": 3, "exporting": 0, "in_transit": 1}
    recorder = PrometheusRecorder(lambda: [], lambda: 0, tracing=lambda: stats)
    recorder.notice("tool_result", {"id": "c1", "name": "bash", "ok": True, "output": "hi"})
    recorder.notice("tool_result", {"name": "read_file", "ok": False, "output": "error: no such file"})
    recorder.notice("tool_result", {"name": "bash", "ok": False, "output": "error: permission denied: a rule"})
    recorder.notice("tool_result", {"name": "mcp__fs__read", "ok": True, "output": "x"})
    recorder.notice("tool_result", {"name": "bash", "ok": True, "output": "hi", "replayed": True})  # ran before
    recorder.notice("tool_result", {"name": ["hostile"], "ok": "yes", "output": 3})  # nonsense: counted, bounded
    recorder.notice("mcp_server_unavailable", {"server": "fs", "error": "Connection closed"})
    s = _scrape(recorder)

    def tools(kind: str, outcome: str) -> float:
        return s[("sessiond_tool_calls_total", (("kind", kind), ("outcome", outcome)))]

    assert tools("bash", "ok") == 1 and tools("bash", "denied") == 1 and tools("file", "error") == 1
    assert tools("mcp", "ok") == 1 and tools("custom", "error") == 1
    assert sum(v for (name, _), v in s.items() if name == "sessiond_tool_calls_total") == 5
    assert s[("sessiond_mcp_server_starts_total", (("outcome", "failed"),))] == 1
    assert s[("sessiond_trace_spans_total", (("outcome", "exported"),))] == 7
    assert s[("sessiond_trace_spans_total", (("outcome", "dropped"),))] == 2
    assert s[("sessiond_trace_spans_pending", ())] == 4
