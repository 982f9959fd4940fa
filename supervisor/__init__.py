"""sessiond's supervisor: the daemon, its client library and the CLIs."""

__version__ = "0.1.0"
