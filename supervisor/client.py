"""`supervisor.client`, the path the README and applications import: the
client library lives in supervisor/ctl/client.py (run by the application's
process); this name re-exports it."""

from supervisor.ctl.client import AsyncClient, Client
from supervisor.ctl.errors import DaemonUnavailable, InputUnacknowledged, RequestError, TurnFailedError

__all__ = ["AsyncClient", "Client", "DaemonUnavailable", "InputUnacknowledged", "RequestError", "TurnFailedError"]
