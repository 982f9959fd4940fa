"""Operations (run by sessiond): systemd's notify protocol, the Prometheus
metrics, the log lines' session tags and the turns' OpenTelemetry traces
(tracing.py: what the parts tell the tracer; otel.py: the exporting one,
imported only when tracing is on; genai.py: what its spans say to a trace
viewer; labels.py: the bounded words both metrics and traces use).

Leaves the rest of the daemon reports through.  May import: ipc/,
supervisor.config and supervisor.errors; metrics.py also reads
supervisor.core's Session and State, the things it counts.
"""
