"""What a client's connection to the control socket allows, in the client
library (supervisor.ctl.client) and sessionctl's one-shot path
(supervisor.ctl.fast) alike; both run in the client's process.  No
imports: the one-shot path loads it at start-up."""

__all__ = ["CONNECT_TIMEOUT_SECS", "MAX_REPLY_FRAME_BYTES", "RECONNECT_SECS", "RECONNECT_SECS_ENV", "START_HINT"]

# How long connecting, and the daemon's answer to hello, may take.
CONNECT_TIMEOUT_SECS = 5.0
# The largest reply frame a client reads (a listing of many sessions, an
# export); the daemon's own limit on what it reads is smaller.
MAX_REPLY_FRAME_BYTES = 1 << 30
# How long a client that lost the daemon mid-stream (a `send` following
# its turn, an `attach`) tries to reconnect before it gives up: long
# enough for systemd to restart a killed daemon, short enough that a
# daemon that is not coming back is said within a minute.  sessionctl:
# --reconnect-secs, else $SESSIOND_RECONNECT_SECS; the library: an argument.
RECONNECT_SECS = 30.0
RECONNECT_SECS_ENV = "SESSIOND_RECONNECT_SECS"
# Said after "cannot connect" when nothing listens at the socket (no such
# file, or a socket left by a daemon that is gone).
START_HINT = ("; is the daemon running? Start it with `make run` in a checkout (or `sessiond run`), "
              "or `sudo systemctl start sessiond.socket` where it is installed; or point --socket "
              "or $SESSIOND_SOCKET at the one that runs")
