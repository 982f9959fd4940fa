"""config.toml: loading, validation, defaults, per-session overrides.
Runs in the daemon and is run by `sessiond config` (May import: supervisor.errors
and ipc/); `defaults.py` writes the commented defaults.

The file is read with tomllib straight into typed msgspec Structs with
`forbid_unknown_fields`, so a typo is an error and not a silently ignored
key.  Every error names the dotted key and the file.  `sessiond config
default` prints the embedded defaults with tomli-w.

Per-session overrides (`sessionctl create --set agent.limits.max_memory_mb=64`)
are not configuration but a client's request: `supervisor.core.overrides` says
which leaf keys a session may set and within which bounds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ipc import inputs
from ipc.errors import BadOverride
from ipc.mcp import rule_problem
from ipc.mcpjson import servers_from_json
from ipc.paths import default_socket_path
from ipc.settings import BUILTIN_TOOLS, ConfigSection, McpServer, SessionSettings
# Re-exported: daemon.py and cli.py name it supervisor.config.ConfigError.
from supervisor.errors import ConfigError

__all__ = [
    "Config",
    "ConfigError",
    "DaemonSettings",
    "StoreSettings",
    "TracingSettings",
    "default_config_path",
    "default_socket_path",
    "default_state_dir",
    "default_toml",
    "load_config",
    "metrics_address",
    "parse_override",
    "plain_error",
    "uid_range",
    "valid_handler_name",
    "workspace_root",
]


class DaemonSettings(ConfigSection):
    # Control socket path; empty = $RUNTIME_DIRECTORY, /run/sessiond or $XDG_RUNTIME_DIR.
    socket: str = ""
    # Permission bits of the control socket, as an octal string ("0660").
    socket_mode: str = "0660"
    # Group owning the control socket (name or number); empty = the daemon's.
    socket_group: str = ""
    # When the daemon runs as root: the user (name or uid) workers and their
    # tools run as.  Empty = as the daemon (a warning is logged for root).
    worker_user: str = ""
    # Where sessions live; empty = $STATE_DIRECTORY, /var/lib/sessiond or $XDG_STATE_HOME.
    state_dir: str = ""
    max_frame_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 16 * 1024 * 1024
    allowed_uids: list[int] = msgspec.field(default_factory=list)
    allowed_gids: list[int] = msgspec.field(default_factory=list)
    # Users who may see and act on every session (root always may).  Being
    # the daemon's own uid does not make a client admin: under the unit,
    # that is also the uid a session's tools run as.
    admin_uids: list[int] = msgspec.field(default_factory=list)
    # As root without worker_user, each session runs as its own uid from
    # this range ("FIRST-LAST"; no passwd entry needed), so sessions are kept
    # apart by file modes and per-user kernel limits.  The default block
    # lies past systemd's container ranges, where nothing else allocates.
    session_uid_range: str = "1879048192-1879113727"
    # Run workers and tools as root (as root without worker_user): only if
    # this says so.  Without it and with session_uid_range = "", the daemon
    # refuses to start.
    allow_root_tools: bool = False
    # auto: a cgroup per session, the kernel's kill and caps (memory, pids,
    # CPU weight): a cgroup v2 where the daemon's own is delegated to it
    # (systemd Delegate=yes), else, as root, the cgroup v1 memory and pids
    # (and cpu, freezer) hierarchies; off: never (see README, Security).
    cgroups: Literal["auto", "off"] = "auto"
    # Sessions' workers and tools run this much nicer than the daemon, and
    # (with a cpu cgroup) all sessions together at the CPU weight of one task
    # at that nice level, one equal weight per user below that: the daemon's
    # control plane comes first when CPUs are short.  0: as the daemon.
    # Read at start.
    session_nice: Annotated[int, Meta(ge=0, le=19)] = 10
    # Sessions (sub-agents included) and connections one non-admin uid may hold.
    max_sessions_per_uid: Annotated[int, Meta(ge=1, le=1_000_000)] = 128
    max_connections_per_uid: Annotated[int, Meta(ge=1, le=1_000_000)] = 64
    # Live sessions (holding a worker) one non-admin uid may have at once:
    # past it that uid's own least recently used idle session is hibernated
    # to make room, else its request is refused (capacity); other users are
    # not affected.  0 = half of [agent.limits] max_concurrent_sessions as
    # the daemon's fds hold it (rounded up), so that one user never holds
    # every live slot.
    max_live_sessions_per_uid: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    # Tasks (processes and threads) all sessions of one owner uid may hold
    # together: the pids.max of its level in the sessions' cgroups (u-UID),
    # so that no user alone fills the unit's TasksMax.  A create (or revive)
    # whose owner is at it is refused (capacity), and its sessions' forks
    # fail with EAGAIN; other users are not affected.  A session's
    # max_processes is held below it.  0 = half of the daemon's task ceiling
    # (the unit's TasksMax=4096: 2048; without one, the kernel's task table).
    # Needs a cgroup per session with a pids controller (docs/limits.md).
    max_processes_per_uid: Annotated[int, Meta(ge=0, le=1 << 22)] = 0
    # Memory (MiB) all sessions of one owner uid may hold together: the
    # memory limit of its u-UID level.  At it that user's largest session is
    # killed (killed_memory, its detail naming this key), never another
    # user's.  0 = half of the daemon's memory ceiling (the unit's
    # MemoryMax=80%: 40% of the host; without one, half of the host's
    # memory).  Needs a cgroup per session with a memory controller.
    max_memory_mb_per_uid: Annotated[int, Meta(ge=0, le=1 << 30)] = 0
    # Bytes queued for one client that is not reading; past it the client is
    # told it lagged and is cut off.  One frame always fits.
    client_buffer_bytes: Annotated[int, Meta(ge=65536, le=1 << 32)] = 8 * 1024 * 1024
    # Bytes all connections of one non-admin uid may make the daemon hold
    # together: frames partly received and replies a paused client has not
    # read.  Past it the connection that went over is told (capacity) and
    # closed.  At least max_frame_bytes (one frame must be able to arrive).
    client_buffer_bytes_per_uid: Annotated[int, Meta(ge=1 << 20, le=1 << 40)] = 64 * 1024 * 1024
    # The largest session document `import` takes and `export` makes
    # (JSON); past it the request is refused (limit_exceeded).  One frame
    # carries a document too: the smaller of this and max_frame_bytes wins.
    max_document_bytes: Annotated[int, Meta(ge=65536, le=1 << 30)] = 16 * 1024 * 1024
    # A frame that has begun to arrive must be whole within this.
    frame_timeout_secs: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    # On SIGTERM: how long running turns may go on before workers are stopped.
    shutdown_grace_secs: Annotated[float, Meta(ge=0, le=3600)] = 10.0
    # A worker asked to stop gets this long before its process group is killed.
    stop_grace_secs: Annotated[float, Meta(ge=0, le=600)] = 5.0
    # Workers the zygote keeps forked and waiting, so that a create or a
    # revive does not wait for a fork (each costs ~4 MiB of private memory).
    spare_workers: Annotated[int, Meta(ge=0, le=64)] = 2
    # Modules the zygote imports once before it forks workers, besides the
    # handlers' own ("package.module"): what a session's handler imports
    # later (a framework's heavy parts) is then shared by every session
    # instead of imported by each.  The modules of `agent.handler`,
    # `agent.allowed_handlers`, `agent.subagents.allowed_handlers` and
    # `tools.custom` are preloaded without being listed.  Imported as the
    # daemon's user, before any session: an import must start no thread and
    # read no secret (docs/agent.md, "Preloaded handlers").  Fixed at start:
    # a reload that changes it says so and changes nothing until a restart.
    preload_modules: list[str] = msgspec.field(default_factory=list)
    # How long create/revive waits for a new worker to say Ready.
    boot_timeout_secs: Annotated[float, Meta(gt=0, le=600)] = 30.0
    # Events kept per session for Attach{from_seq}: at most this many, and
    # at most this many bytes (a long streamed reply must not make the
    # daemon hold megabytes per session).
    event_retention: Annotated[int, Meta(ge=16, le=1_000_000)] = 4096
    event_retention_bytes: Annotated[int, Meta(ge=4096, le=1 << 30)] = 1024 * 1024
    # All sessions' retained events together; past it each session keeps
    # its share (at least its newest event).
    event_retention_total_bytes: Annotated[int, Meta(ge=65536, le=1 << 40)] = 256 * 1024 * 1024
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # "text": journald's fields under systemd (or `<N>` lines without its
    # socket), timestamped lines elsewhere.  "json": one JSON object a line
    # on stderr with the same fields, for log shippers (docs/operations.md).
    log_format: Literal["text", "json"] = "text"
    # Prometheus metrics at http://HOST:PORT/metrics ("127.0.0.1:9464"; IPv6
    # as "[::1]:9464"), or on a Unix socket (an absolute path).  Empty = off.
    # No authentication: keep it on loopback or a private network.
    metrics_listen: str = ""
    # Series per session on the metrics endpoint: off by default, since
    # they name every user's session ids (and their sizes) to whoever can
    # reach the endpoint, which has no authentication (any local user, for
    # a loopback address).  Off, only daemon-wide figures are served.
    metrics_per_session: bool = False
    # With metrics_per_session: how many of the largest live sessions get
    # an RSS series of their own (sessiond_session_rss_bytes{session="ID"});
    # 0 = none (the total stays).
    metrics_top_sessions: Annotated[int, Meta(ge=0, le=1000)] = 20


class StoreSettings(ConfigSection):
    # Where sessions' state is kept: "file" (under state_dir, one machine) or
    # "postgres" (a PostgreSQL database, needs the `cluster` extra: pip
    # install 'sessiond[cluster]').
    backend: Literal["file", "postgres"] = "file"
    # For backend = "postgres": a libpq connection string ("host=/run/postgresql
    # dbname=sessiond" or "postgresql://user@host/db"); keep passwords in
    # ~/.pgpass or PGPASSFILE rather than here.
    dsn: str = ""
    # How long one store operation keeps retrying a lost database connection
    # (the daemon waits meanwhile) before the write fails.
    retry_secs: Annotated[float, Meta(ge=0, le=600)] = 5.0


class ClusterSettings(ConfigSection):
    # Where sessions' workers run: "off" (this machine, the zygote) or "ray"
    # (node hosts on a Ray cluster; needs the `cluster` extra and
    # [store] backend = "postgres").  Taken at start, not on reload.
    backend: Literal["off", "ray"] = "off"
    # The Ray cluster to join ("HOST:PORT" of its head's GCS, as `ray start
    # --head` prints it); empty: the RAY_ADDRESS environment variable, else
    # a cluster already running on this machine.
    address: str = ""
    # The custom resource that counts worker slots on a node: a node takes
    # sessions only if it was started with it (`ray start --resources
    # '{"sessiond_slots": 50}'`), and at most that many at once.
    resource: str = "sessiond_slots"
    # The Ray namespace of the node-host actors: fronts of one deployment share it.
    namespace: str = "sessiond"
    # A node host kills a front's workers once that front has not renewed
    # its lease for this long (it died, or cannot reach the node); and with
    # the PostgreSQL store, another daemon may end a turn this daemon was
    # running once its row in sessiond_fronts is this old (supervisor.cluster.fronts).
    front_lease_secs: Annotated[float, Meta(ge=1, le=600)] = 10.0
    # Ray's token authentication: a file holding the cluster's token (the
    # one its nodes were started with: RAY_AUTH_MODE=token). Readable by the
    # daemon's user only. Empty: whatever Ray's own environment variables say.
    auth_token_file: str = ""


class TracingSettings(ConfigSection):
    # OpenTelemetry traces of turns (docs/tracing.md; needs the `otel` extra:
    # pip install 'sessiond[otel]'): "otlp" exports them over OTLP,
    # "none" never; empty = as OTEL_TRACES_EXPORTER says (otlp: on; unset:
    # off). The other OTEL_* variables (endpoint, headers, service name,
    # sampler, resource attributes) are read as every OpenTelemetry SDK
    # reads them. Read at start, not on reload.
    exporter: Literal["", "otlp", "none"] = ""
    # How spans go to the collector: "http/protobuf" (OTLP/HTTP, port 4318)
    # or "grpc" (OTLP/gRPC, port 4317); empty =
    # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL,
    # else http/protobuf (any other value there is refused at start).
    protocol: Literal["", "http/protobuf", "grpc"] = ""
    # Over HTTP the traces endpoint ("http://collector:4318/v1/traces");
    # empty = OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else
    # OTEL_EXPORTER_OTLP_ENDPOINT + "/v1/traces", else
    # http://localhost:4318/v1/traces. Over gRPC the collector's address
    # ("http://collector:4317": http plaintext, https TLS); empty = the
    # same variables as they are, else http://localhost:4317.
    endpoint: str = ""
    # The spans' service.name; empty = OTEL_SERVICE_NAME, else "sessiond".
    service_name: str = ""
    # Put what was said into the spans: each LLM call's messages and answer
    # (gen_ai.input.messages, gen_ai.output.messages), each tool call's
    # arguments and result, the turn's input and reply (input.value,
    # output.value); up to 64 KiB each. Whoever reads the traces then reads
    # the conversations. Also on with
    # OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true.
    capture_content: bool = False
    # Spans held for export while the collector is slow or down; past it
    # new spans are dropped and counted (sessionctl stats --json), so a
    # collector that is down never grows the daemon's memory.
    queue_size: Annotated[int, Meta(ge=64, le=1_000_000)] = 2048
    # Spans a turn's worker may send; past it they are dropped and counted.
    max_spans_per_turn: Annotated[int, Meta(ge=1, le=100_000)] = 1000
    # How long one export request to the collector may take.
    export_timeout_secs: Annotated[float, Meta(gt=0, le=600)] = 10.0


class Config(SessionSettings):
    daemon: DaemonSettings = msgspec.field(default_factory=DaemonSettings)
    store: StoreSettings = msgspec.field(default_factory=StoreSettings)
    cluster: ClusterSettings = msgspec.field(default_factory=ClusterSettings)
    tracing: TracingSettings = msgspec.field(default_factory=TracingSettings)

    def session_settings(self) -> SessionSettings:
        """What sessions run with: one object per config, shared by every
        session without overrides (never written into: a reload replaces it)."""
        if _SHARED and _SHARED[0][0] is self:
            return _SHARED[0][1]
        settings = SessionSettings(
            agent=self.agent, provider=self.provider, tools=self.tools,
            permissions=self.permissions, sandbox=self.sandbox, mcp=self.mcp,
        )
        _SHARED[:] = [(self, settings)]
        return settings


# The last config's session settings (Config.session_settings).
_SHARED: list[tuple[Config, SessionSettings]] = []


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")


def _describe(exc: msgspec.ValidationError, source: str, data: Any = None) -> str:
    """Turn msgspec's `... - at `$.agent.limits`` into a dotted key."""
    text = str(exc)
    path = ""
    at = _AT.search(text)
    if at:
        path = re.sub(r"\[(\d+)\]", r"[\1]", at.group("path"))
        text = text[: at.start()]
    unknown = _UNKNOWN.match(text)
    if unknown:
        key = f"{path}.{unknown.group('field')}" if path else unknown.group("field")
        return f"{source}: unknown key '{key}'"
    if path:
        return f"{source}: invalid value for '{path}': {plain_error(text, Config, path, _value_at(data, path))}"
    return f"{source}: {text}"


_MISSING: Any = object()
_EXPECTED = re.compile(r"Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`")
# msgspec's type names as a person reading a config file says them.
_TYPE_WORDS = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "a string",
               "array": "a list", "object": "a table", "null": "nothing"}


def plain_error(text: str, root: Any, path: str, value: Any = _MISSING) -> str:
    """msgspec's message about the value at `path` of a `root` (a Struct
    type), said plainly: an enum's allowed values listed, a type by its
    name in TOML, the value given shown."""
    given = "" if value is _MISSING else f" {_shown(value)}"
    if text.startswith("Invalid enum value"):
        choices = _literal_choices(root, path)
        if choices:
            return f"{given.strip() or 'the value'} is not one of: {', '.join(map(str, choices))}"
    expected = _EXPECTED.fullmatch(text)
    if expected:
        want = " or ".join(_TYPE_WORDS.get(w.strip(), w.strip()) for w in expected.group("want").split("|"))
        got = _TYPE_WORDS.get(expected.group("got"), expected.group("got"))
        return f"expected {want}, got {given.strip() if given else got}"
    return text


def _shown(value: Any) -> str:
    """A value as TOML (and JSON) write it: "x", true, 1.5."""
    try:
        return msgspec.json.encode(value).decode()[:200]
    except (TypeError, msgspec.EncodeError):
        return repr(value)[:200]


def _literal_choices(root: Any, path: str) -> tuple[Any, ...]:
    """The values a Literal field at `path` allows (empty if it is no Literal)."""
    tp: Any = root
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        tp = _unwrap(tp)
        if part.startswith("["):
            args = typing.get_args(tp)
            tp = args[0] if args else Any
        else:
            try:
                tp = typing.get_type_hints(tp, include_extras=True).get(part, Any)
            except TypeError:
                return ()
    tp = _unwrap(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def _unwrap(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return _unwrap(args[0])
    return tp


def _value_at(data: Any, path: str) -> Any:
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        try:
            data = data[int(part[1:-1])] if part.startswith("[") else data[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return _MISSING
    return data


def _unimportable(module: str) -> str | None:
    """Why the workers could not import `module` (they are forks of this
    process: the same sys.path); None if they can.  Only found, not
    imported (its parent packages are)."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return f"module {module!r} cannot be imported: {exc}"
    return None if found is not None else f"no module named {module!r} on the daemon's Python path"


def _validate_mode(cfg: Config, source: str) -> None:
    try:
        mode = int(cfg.daemon.socket_mode, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise ConfigError(
            f"{source}: invalid value for 'daemon.socket_mode': "
            f"expected octal permission bits like \"0660\", got {cfg.daemon.socket_mode!r}"
        )


def uid_range(text: str) -> range | None:
    """`[daemon] session_uid_range` ("FIRST-LAST") as a range; None when empty."""
    if not text.strip():
        return None
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        raise ValueError(f'expected "FIRST-LAST" uids, got {text!r}') from None
    if not sep or not 1000 <= lo <= hi < 2**31 - 1 or 65534 in range(lo, hi + 1):
        raise ValueError(
            f"expected FIRST-LAST with 1000 <= FIRST <= LAST < 2^31-1, not containing 65534 (nobody); got {text!r}"
        )
    return range(lo, hi + 1)


def metrics_address(text: str) -> tuple[str, int] | str | None:
    """`[daemon] metrics_listen` as (host, port), a Unix socket path, or
    None when empty (metrics off)."""
    if not text:
        return None
    if text.startswith("/"):
        if len(os.fsencode(text)) >= 108 or "\0" in text:
            raise ValueError(f"a Unix socket path must be shorter than 108 bytes; got {text!r}")
        return text
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if (not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535
            or (":" in host and not bracketed) or any(c.isspace() or c in "/[]" for c in host)):
        raise ValueError(
            f'expected "HOST:PORT" (e.g. "127.0.0.1:9464", "[::1]:9464") or an absolute '
            f"Unix socket path; got {text!r}"
        )
    return host, int(port)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def valid_handler_name(name: str, pattern: bool = False) -> bool:
    """"agent", "echo" or "package.module:factory" (with pattern=True also
    "package.module:*")."""
    if name in ("agent", "echo"):
        return True
    module, sep, attr = name.partition(":")
    return (
        bool(sep) and all(_IDENT.fullmatch(p) for p in module.split("."))
        and (_IDENT.fullmatch(attr) is not None or (pattern and attr == "*"))
    )


def _validate_handlers(cfg: Config, source: str) -> None:
    """The default handler and the enabled tools are checked here, at
    `config check` and at start, not at each `create`: a handler the
    workers cannot load would fail every session, one by one."""
    handler = cfg.agent.handler
    if not valid_handler_name(handler):
        raise ConfigError(f"{source}: invalid value for 'agent.handler': {_shown(handler)} (use \"agent\", "
                          "\"echo\" or \"package.module:factory\")")
    if handler not in ("agent", "echo") and (why := _unimportable(handler.partition(":")[0])):
        raise ConfigError(f"{source}: invalid value for 'agent.handler': {_shown(handler)}: {why}")
    customs = {spec.rpartition(":")[2] for spec in cfg.tools.custom}
    for tool in cfg.tools.enabled:
        if tool not in BUILTIN_TOOLS and tool not in customs:
            raise ConfigError(f"{source}: invalid value for 'tools.enabled': unknown tool {_shown(tool)} "
                              f"(allowed: {', '.join(BUILTIN_TOOLS)}, or the name of a tools.custom function)")
    for module in cfg.daemon.preload_modules:
        named = all(_IDENT.fullmatch(p) for p in module.split("."))
        if why := _unimportable(module) if named else 'not a module name ("package.module")':
            raise ConfigError(f"{source}: invalid value for 'daemon.preload_modules': {_shown(module)}: {why}")
    for name in cfg.agent.allowed_handlers:
        if valid_handler_name(name, pattern=True):
            continue
        raise ConfigError(
            f"{source}: invalid value for 'agent.allowed_handlers': {name!r} "
            "(use \"agent\", \"echo\", \"package.module:factory\" or \"package.module:*\")"
        )


def _import_mcp(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`[mcp] import`: the servers of a Claude Code / Cursor `.mcp.json`
    join `[[mcp.servers]]` (each checked as a table of this file would be)."""
    mcp = data.get("mcp")
    name = mcp.get("import") if isinstance(mcp, dict) else None
    if not name or not isinstance(name, str) or not isinstance(mcp, dict):
        return data  # (a value of the wrong type is the schema's to name)
    path = Path(source).parent / name if source and not os.path.isabs(name) else Path(name)
    where = f"{source}: invalid value for 'mcp.import': {str(path)!r}"
    try:
        document = json.loads(path.read_bytes())
        tables = servers_from_json(document)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    for table in tables:
        try:
            msgspec.convert(table, McpServer)
        except msgspec.ValidationError as exc:
            text = str(exc)
            at = _AT.search(text)
            key = f".{at.group('path')}" if at else ""
            problem = plain_error(text[: at.start()] if at else text, McpServer, key.lstrip("."))
            raise ConfigError(f"{where}: server {table['name']!r}{key}: {problem}") from None
    return {**data, "mcp": {**mcp, "servers": [*mcp.get("servers", []), *tables]}}


def _validate_mcp(cfg: Config, source: str) -> None:
    """What only the whole file can say: a permission rule that names no
    tool this configuration can have matches nothing, and so guards
    nothing (`mcp__memory` with no server named memory); the tool lists
    are the daemon's to fill; a read path is a directory or a file."""
    if cfg.mcp.listed:
        raise ConfigError(f"{source}: 'mcp.listed' is filled by the daemon (the servers' tool lists), "
                          "not set in a config file")
    tools = [*BUILTIN_TOOLS, *(spec.rpartition(":")[2] for spec in cfg.tools.custom)]
    servers = [server.name for server in cfg.mcp.servers]
    for i, rule in enumerate(cfg.permissions):
        if problem := rule_problem(rule.tool, tools, servers):
            raise ConfigError(f"{source}: invalid value for 'permissions[{i}].tool': {rule.tool!r} "
                              f"can never match a tool: {problem}")
    for i, path in enumerate(cfg.sandbox.read_paths):
        if os.path.exists(path) and not (os.path.isdir(path) or os.path.isfile(path)):
            raise ConfigError(f"{source}: invalid value for 'sandbox.read_paths[{i}]': {path!r} is neither "
                              "a directory nor a file (a socket or a device is never mounted for tools)")


def parse_config(data: dict[str, Any], source: str) -> Config:
    data = _import_mcp(data, source)
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe(exc, source, data)) from None
    _validate_mode(cfg, source)
    _validate_handlers(cfg, source)
    _validate_mcp(cfg, source)
    if cfg.daemon.event_retention_bytes > cfg.daemon.client_buffer_bytes:
        # A client attaching --from the oldest event is sent the whole ring
        # at once: it must fit in what one client may have queued.
        raise ConfigError(
            f"{source}: 'daemon.event_retention_bytes' ({cfg.daemon.event_retention_bytes}) must not "
            f"exceed 'daemon.client_buffer_bytes' ({cfg.daemon.client_buffer_bytes})"
        )
    limits = cfg.agent.limits
    if limits.free_slots_low_water_pct > limits.free_slots_high_water_pct:
        raise ConfigError(
            f"{source}: invalid value for 'agent.limits.free_slots_low_water_pct': "
            f"{limits.free_slots_low_water_pct} is above 'agent.limits.free_slots_high_water_pct' "
            f"({limits.free_slots_high_water_pct}): hibernation ahead of demand starts below the low "
            "mark and stops at the high one")
    if cfg.daemon.client_buffer_bytes_per_uid < cfg.daemon.max_frame_bytes:
        raise ConfigError(
            f"{source}: 'daemon.client_buffer_bytes_per_uid' ({cfg.daemon.client_buffer_bytes_per_uid}) "
            f"must be at least 'daemon.max_frame_bytes' ({cfg.daemon.max_frame_bytes})"
        )
    if cfg.store.backend == "postgres" and not cfg.store.dsn.strip():
        raise ConfigError(f"{source}: 'store.dsn' must be set when 'store.backend' is \"postgres\"")
    if cfg.cluster.backend == "ray" and cfg.store.backend != "postgres":
        raise ConfigError(
            f"{source}: 'cluster.backend' = \"ray\" needs 'store.backend' = \"postgres\" (with "
            "'store.dsn'): sessions move between machines, so their state cannot stay in one "
            "machine's files")
    if cfg.tracing.endpoint and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", cfg.tracing.endpoint):
        raise ConfigError(f"{source}: invalid value for 'tracing.endpoint': expected an http:// or "
                          f"https:// URL (\"http://collector:4318/v1/traces\"); got {cfg.tracing.endpoint!r}")
    try:
        metrics_address(cfg.daemon.metrics_listen)
    except ValueError as exc:
        raise ConfigError(f"{source}: invalid value for 'daemon.metrics_listen': {exc}") from None
    try:
        uid_range(cfg.daemon.session_uid_range)
    except ValueError as exc:
        raise ConfigError(f"{source}: invalid value for 'daemon.session_uid_range': {exc}") from None
    return cfg


def load_config(path: Path | None) -> Config:
    """Load `path`, or the embedded defaults when it is None."""
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(data, str(path))


def default_toml() -> str:
    """Every key with its default and, above it, its meaning
    (`sessiond config default`; supervisor.config.defaults)."""
    from supervisor.config.defaults import render

    return render(Config())


def parse_override(item: str) -> tuple[str, Any]:
    """`KEY=VALUE` from the command line; VALUE is read as a TOML value
    (64, 1.5, true, "text", ["a", "b"]) and as a plain string otherwise
    (the parsing is ipc.inputs', shared with sessionctl)."""
    try:
        return inputs.parse_override(item)
    except BadOverride as exc:
        raise ConfigError(str(exc)) from None


# ---------------------------------------------------------------- default paths


def _is_root() -> bool:
    return os.geteuid() == 0


def default_config_path() -> Path | None:
    """The config file used without --config, if it exists."""
    if _is_root():
        path = Path("/etc/sessiond/config.toml")
    else:
        base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        path = Path(base) / "sessiond" / "config.toml"
    return path if path.exists() else None


def daemon_socket_path(cfg: Config) -> Path:
    if cfg.daemon.socket:
        return Path(cfg.daemon.socket)
    runtime = os.environ.get("RUNTIME_DIRECTORY")  # set by systemd's RuntimeDirectory=
    if runtime:
        return Path(runtime.split(":")[0]) / "sessiond.sock"
    return default_socket_path()


def workspace_root(cfg: Config, state_dir: Path) -> Path:
    """Where sessions' workspaces live: [tools] workspace_dir, else
    <state_dir>/workspaces."""
    base = cfg.tools.workspace_dir
    return Path(base) if base else state_dir / "workspaces"


def default_state_dir(cfg: Config) -> Path:
    if cfg.daemon.state_dir:
        return Path(cfg.daemon.state_dir)
    state = os.environ.get("STATE_DIRECTORY")  # set by systemd's StateDirectory=
    if state:
        return Path(state.split(":")[0])
    if _is_root():
        return Path("/var/lib/sessiond")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "sessiond"
