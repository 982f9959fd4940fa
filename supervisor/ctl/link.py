"""What a client's connection to the control socket allows, in the client
library (supervisor.ctl.client) and sessionctl's one-shot path
(supervisor.ctl.fast) alike; both run in the client's process.  No
imports: the one-shot path loads it at start-up."""

__all__ = ["CONNECT_TIMEOUT_SECS", "MAX_REPLY_FRAME_BYTES"]

# How long connecting, and the daemon's answer to hello, may take.
CONNECT_TIMEOUT_SECS = 5.0
# The largest reply frame a client reads (a listing of many sessions, an
# export); the daemon's own limit on what it reads is smaller.
MAX_REPLY_FRAME_BYTES = 1 << 30
