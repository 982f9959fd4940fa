"""config.toml: loading, validation, defaults, per-session overrides.

The file is read with tomllib straight into typed msgspec Structs with
`forbid_unknown_fields`, so a typo is an error and not a silently ignored
key.  Every error names the dotted key and the file.  `sessiond config
default` prints the embedded defaults with tomli-w.

Per-session overrides (`sessionctl create --set agent.limits.max_memory_mb=64`)
go through the same validation, plus one rule: a limit can only be tightened,
never raised above the operator's value.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomli_w
from msgspec import Meta

from session_worker.settings import ConfigSection, SessionSettings

__all__ = [
    "Config",
    "ConfigError",
    "DaemonSettings",
    "apply_overrides",
    "default_config_path",
    "default_socket_path",
    "default_state_dir",
    "default_toml",
    "load_config",
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
    # As root without worker_user, tools would run as root: the daemon
    # refuses to start unless this says that is really meant.
    allow_root_tools: bool = False
    # Sessions (sub-agents included) and connections one non-admin uid may hold.
    max_sessions_per_uid: Annotated[int, Meta(ge=1, le=1_000_000)] = 128
    max_connections_per_uid: Annotated[int, Meta(ge=1, le=1_000_000)] = 64
    # Bytes queued for one client that is not reading; past it the client is
    # told it lagged and is cut off.  One frame always fits.
    client_buffer_bytes: Annotated[int, Meta(ge=65536, le=1 << 32)] = 8 * 1024 * 1024
    # A frame that has begun to arrive must be whole within this.
    frame_timeout_secs: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    # On SIGTERM: how long running turns may go on before workers are stopped.
    shutdown_grace_secs: Annotated[float, Meta(ge=0, le=3600)] = 10.0
    # A worker asked to stop gets this long before its process group is killed.
    stop_grace_secs: Annotated[float, Meta(ge=0, le=600)] = 5.0
    # Workers the zygote keeps forked and waiting, so that a create or a
    # revive does not wait for a fork (each costs ~4 MiB of private memory).
    spare_workers: Annotated[int, Meta(ge=0, le=64)] = 2
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


class Config(SessionSettings):
    daemon: DaemonSettings = msgspec.field(default_factory=DaemonSettings)

    def session_settings(self) -> SessionSettings:
        return SessionSettings(
            agent=self.agent, provider=self.provider, tools=self.tools,
            permissions=self.permissions,
        )


class ConfigError(Exception):
    """A config file or an override that cannot be used; the text says which
    key, in which file, and why."""


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")


def _describe(exc: msgspec.ValidationError, source: str) -> str:
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
        return f"{source}: invalid value for '{path}': {text}"
    return f"{source}: {text}"


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


def parse_config(data: dict[str, Any], source: str) -> Config:
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
    _validate_mode(cfg, source)
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
    data = msgspec.to_builtins(Config())
    return tomli_w.dumps(_drop_none(data))


def _drop_none(obj: Any) -> Any:
    # TOML has no null: unset optional keys are simply absent.
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    return obj


# Keys that are limits: an override may lower them, never raise them.
_CEILINGS = (
    "agent.max_turns",
    "agent.max_tool_calls_per_turn",
    "agent.session_timeout_secs",
    "agent.turn_timeout_secs",
    "agent.limits.max_memory_mb",
    "agent.limits.memory_high_mb",
    "agent.limits.max_concurrent_sessions",
    "agent.limits.max_processes",
    "agent.limits.max_file_size_mb",
    "agent.worker.max_restart_attempts",
    "agent.subagents.max_concurrent",
    "agent.subagents.max_depth",
    "agent.subagents.max_total_spawns",
    "agent.subagents.child_timeout_secs",
    "tools.bash_timeout_secs",
    "tools.output_limit_bytes",
)
# Keys a session may not set at all: they decide where the API key is sent
# and which environment variable is read.
_OPERATOR_ONLY = (
    "provider.base_url", "provider.api_key_env", "tools.workspace_dir", "tools.custom",
    "agent.subagents.allowed_handlers",
)
_OVERRIDABLE_ROOTS = ("agent", "provider", "tools", "permissions")


def _get(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def apply_overrides(
    base: SessionSettings, overrides: dict[str, Any], *, privileged: bool = False
) -> SessionSettings:
    """Return `base` with dotted-key overrides applied and validated."""
    if not overrides:
        return base
    tree = msgspec.to_builtins(base)
    base_tree = msgspec.to_builtins(base)
    for key, value in overrides.items():
        parts = key.split(".")
        if parts[0] not in _OVERRIDABLE_ROOTS or not all(parts):
            raise ConfigError(
                f"--set {key}: only keys under agent., provider., tools. or permissions can be set per session"
            )
        if key in _OPERATOR_ONLY and not privileged:
            raise ConfigError(f"--set {key}: only the operator's config.toml may set this key")
        node = tree
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: unknown key '{key}'")
            node = child
        if parts[-1] not in node and not (
            parts[-1] in _optional_fields(parts[:-1])
        ):
            raise ConfigError(f"--set {key}: unknown key '{key}'")
        node[parts[-1]] = value
    try:
        settings = msgspec.convert(tree, SessionSettings)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe(exc, "--set")) from None
    new_tree = msgspec.to_builtins(settings)
    for key in _CEILINGS:
        old, new = _get(base_tree, key), _get(new_tree, key)
        if isinstance(old, (int, float)) and isinstance(new, (int, float)) and new > old:
            raise ConfigError(f"--set {key}={new}: above the operator's limit of {old}")
        if old is not None and new is None:
            raise ConfigError(f"--set {key}: cannot lift the operator's limit of {old}")
    return settings


def _optional_fields(path: list[str]) -> set[str]:
    """Field names of the section at `path` (to_builtins drops unset optionals)."""
    typ: Any = SessionSettings
    for part in path:
        fields = {f.name: f.type for f in msgspec.structs.fields(typ)}
        typ = fields.get(part)
        if typ is None or not isinstance(typ, type) or not issubclass(typ, msgspec.Struct):
            return set()
    return {f.name for f in msgspec.structs.fields(typ)}


def parse_override(item: str) -> tuple[str, Any]:
    """`KEY=VALUE` from the command line; VALUE is read as a TOML value
    (64, 1.5, true, "text", ["a", "b"]) and as a plain string otherwise."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


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


def default_socket_path() -> Path:
    env = os.environ.get("SESSIOND_SOCKET")
    if env:
        return Path(env)
    if _is_root():
        return Path("/run/sessiond/sessiond.sock")
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/sessiond-{os.getuid()}"
    return Path(runtime) / "sessiond" / "sessiond.sock"


def daemon_socket_path(cfg: Config) -> Path:
    if cfg.daemon.socket:
        return Path(cfg.daemon.socket)
    runtime = os.environ.get("RUNTIME_DIRECTORY")  # set by systemd's RuntimeDirectory=
    if runtime:
        return Path(runtime.split(":")[0]) / "sessiond.sock"
    return default_socket_path()


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
