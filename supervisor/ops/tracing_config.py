"""Whether turns are traced, and the tracer that does it (run by sessiond at
start, in `_build`).

Off unless configured: `[tracing] exporter = "otlp"`, or, with the key
unset, the standard OTEL_TRACES_EXPORTER=otlp, as every OpenTelemetry SDK
reads it (and OTEL_SDK_DISABLED=true turns it off).  The OpenTelemetry
packages (the `otel` extra) are imported only then, and only by the span
exporter process.  Spans go over OTLP/HTTP (protobuf) or OTLP/gRPC
(`[tracing] protocol`, or OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL); a protocol
sessiond does not speak (http/json) is refused at start, never ignored.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping

import msgspec

from supervisor.config import TracingSettings
from supervisor.errors import StartupError
from ipc.install import install_command
from supervisor.core.tracer import NO_TRACER, Tracer

__all__ = ["build", "protocol", "wanted"]

log = logging.getLogger("sessiond")

_ON = {"otlp"}
# What the exporter process imports (the `otel` extra), by protocol; the
# daemon imports none of it.
_NEEDED = {
    "http/protobuf": ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"),
    "grpc": ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"),
}


def wanted(settings: TracingSettings, environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Tracing is on: `[tracing] exporter = "otlp"`, or, with it unset,
    OTEL_TRACES_EXPORTER names otlp (and OTEL_SDK_DISABLED is not true)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if settings.exporter:
        return settings.exporter == "otlp"
    names = {n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()}
    others = names - _ON - {"none"}
    if others:
        log.warning("OTEL_TRACES_EXPORTER names %s: sessiond exports traces over OTLP only (otlp)",
                    ", ".join(sorted(others)))
    return bool(names & _ON) and "none" not in names


def protocol(settings: TracingSettings, environ: Mapping[str, str] = os.environ) -> str:
    """How spans go: `[tracing] protocol`, else the standard variables, else
    http/protobuf.  Raises StartupError for one the exporter cannot speak."""
    if settings.protocol:
        return settings.protocol
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = environ.get(name, "").strip().lower()
        if value:
            if value not in _NEEDED:
                raise StartupError(f"{name}={value}: sessiond exports traces over OTLP with http/protobuf or "
                                   f"grpc only ([tracing] protocol)")
            return value
    return "http/protobuf"


def build(settings: TracingSettings) -> Tracer:
    """The tracer the config asks for.  Call after the zygote is forked:
    the exporter runs a thread."""
    if not wanted(settings):
        return NO_TRACER
    settings = msgspec.structs.replace(settings, protocol=protocol(settings))
    for module in _NEEDED[settings.protocol]:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            raise StartupError(
                f"tracing is on ([tracing] exporter or OTEL_TRACES_EXPORTER) but OpenTelemetry is not "
                f"installed ({module}): {install_command('otel')}"
            )
    from supervisor.ops.otel import OtelTracer

    return OtelTracer(settings)
