"""The control socket (run by sessiond): the server and its connections
(hello, pacing, dispatch, replies), accepting with descriptors in reserve,
who the peer is, export/import/history and the export document, `ls`
selected and paged, a stored turn told as its clients saw it, and
rate-limited logging.

Owns the clients' connections.  May import: ipc/, supervisor.config,
supervisor.errors, supervisor.logtag, supervisor.core (its public
operations, and the recorder and tracer protocols it calls),
supervisor.store and supervisor.spawn.  Never supervisor.ops nor
supervisor.cluster: what of them it serves (`sessionctl drain`, `reload`,
the metrics recorder) the daemon hands the server when it builds it.
"""
