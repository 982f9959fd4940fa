"""Operations (run by sessiond): systemd's notify protocol, the Prometheus
metrics and the turns' OpenTelemetry traces (tracing_config.py: whether
and how; otel.py: the exporting tracer, imported only when tracing is on;
genai.py: what its spans say to a trace viewer; labels.py: the bounded
words both metrics and traces use), the reload.

Above the core: it implements the recorder and the tracer the core calls
(supervisor.core.recorder, supervisor.core.tracer: protocols, with their
no-ops).  May import: ipc/, supervisor.config, supervisor.errors,
supervisor.logtag and supervisor.core (metrics.py reads its Session and
State, the things it counts).  Only the daemon's composition root imports it.
"""
