"""The per-session part of the configuration, as typed msgspec Structs.

Everything a worker needs to run one session lives here: the `[agent]` tree,
`[provider]`, `[tools]` and `[[permissions]]`.  The daemon's own `[daemon]`
section extends this in `supervisor.config`.  The daemon sends a session's
effective settings (operator config plus the session's `--set` overrides) to
the worker at boot, msgpack-encoded, so both sides share this one schema.

Units are in the names (`_mb`, `_secs`, `_ms`); bounds are `Meta` constraints,
so a bad value is refused at load time with the key that holds it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ipc.mcp import McpListing, rule_covers

__all__ = [
    "AgentSettings",
    "BUILTIN_TOOLS",
    "BudgetSettings",
    "ConfigSection",
    "LimitsSettings",
    "LoopSettings",
    "McpServer",
    "McpSettings",
    "PermissionRule",
    "ProviderSettings",
    "SandboxSettings",
    "SessionSettings",
    "SubagentSettings",
    "ToolsSettings",
    "WorkerSettings",
]

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]


class ConfigSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base for every config section: unknown keys are errors, not ignored."""


class LimitsSettings(ConfigSection):
    # Live workers at once; when full the least recently used idle session
    # hibernates.  Held at start to what the daemon's file descriptors allow
    # (each live session holds 9 of them; a warning names LimitNOFILE=).
    max_concurrent_sessions: PositiveInt = 64
    # Live slots kept free ahead of demand, in percent of that ceiling (as
    # the fds hold it; rounded down, so a ceiling under 20 keeps none free
    # by default): once there are more sessions than live
    # slots, when fewer than free_slots_low_water_pct are free the least
    # recently used idle sessions no client is attached to are hibernated in
    # the background until free_slots_high_water_pct are, so that a create
    # or a revive takes a free slot instead of waiting for another session's
    # worker to stop.  Never more than leaves one uid its whole
    # [daemon] max_live_sessions_per_uid; 0 = none kept free (a session is
    # hibernated only when one needs its slot).
    free_slots_low_water_pct: Annotated[int, Meta(ge=0, le=50)] = 5
    free_slots_high_water_pct: Annotated[int, Meta(ge=0, le=50)] = 10
    # RSS cap of a worker plus all of its descendants.
    max_memory_mb: Annotated[int, Meta(ge=16)] = 1024
    # Optional soft threshold: an event and a hint to the worker.
    memory_high_mb: Annotated[int, Meta(ge=1)] | None = None
    memory_poll_interval_ms: Annotated[int, Meta(ge=5, le=60_000)] = 100
    # Processes (and threads) of the session's tools: RLIMIT_NPROC in the
    # sandbox's user namespace or for the session's own uid, so the kernel
    # refuses the fork past it; else the memory sweep counts and kills.
    # None = no limit (root's tools are never limited by RLIMIT_NPROC).
    max_processes: Annotated[int, Meta(ge=8)] | None = 512
    # RLIMIT_NOFILE of the worker and everything it starts (tools, bash, MCP
    # servers), soft and hard alike, so a tool cannot raise it: without it
    # they would inherit the daemon's raised limit and one session could
    # take the host's whole file table (fs.file-max).  1024 is what systemd
    # gives a service's processes.
    max_open_files: Annotated[int, Meta(ge=64, le=1 << 20)] = 1024
    # RLIMIT_FSIZE: the largest file a worker or tool may write.  None = inherited.
    max_file_size_mb: Annotated[int, Meta(ge=1)] | None = None
    # Blocks the session's workspace may hold (allocated: fallocate counts).
    # Where the kernel caps it ([tools] disk_quota; a daemon with
    # CAP_SYS_ADMIN: the shipped unit, a root daemon) a write past it fails
    # (ENOSPC in a workspace image of its own, EDQUOT on btrfs with
    # quotas), files unlinked while held open included; elsewhere, past it
    # the session is stopped (exit reason killed_disk) until files are
    # removed and it is restarted.  A workspace image keeps the size it was
    # made with at the session's first start.  Unless [tools] workspace_dir
    # says otherwise, the workspaces share a filesystem with every
    # session's durable log: 2 GiB holds a large checkout with its
    # dependencies and build output, and keeps one session from filling a
    # common server disk on its own.  None = no quota.
    max_disk_mb: Annotated[int, Meta(ge=1, le=1 << 30)] | None = 2048
    # Files and directories the workspace may hold: a workspace image's
    # inode table (the kernel refuses the next file, ENOSPC; rounded up to
    # fill the table's last block, 15 at most per 128 MiB), else counted
    # by the walk (past it the session is stopped, as for max_disk_mb).
    # Without it a session could use up its filesystem's inodes with empty
    # files; 262,144 holds a large checkout with its node_modules.  None =
    # no cap (a workspace image then gets one inode per 16 KiB, ext4's own).
    max_disk_inodes: Annotated[int, Meta(ge=16, le=1 << 31)] | None = 262_144


class WorkerSettings(ConfigSection):
    heartbeat_interval_secs: Annotated[float, Meta(ge=0.05, le=3600)] = 1.0
    max_restart_attempts: NonNegInt = 5
    restart_window_secs: PositiveFloat = 60.0
    restart_backoff_initial_ms: Annotated[int, Meta(ge=1)] = 100
    restart_backoff_max_ms: Annotated[int, Meta(ge=1)] = 30_000
    # A turn whose worker dies (a crash, the memory cap, missed heartbeats, a
    # node lost, the daemon killed) is resumed on the restarted worker from
    # its last durable step (`ctx.step`), for handlers that use steps (the
    # agent does); false: it fails with TurnFailed.  Handlers that use no
    # steps fail such a turn either way (docs/agent.md, "Durable steps").
    retry_aborted_turn: bool = True
    # The largest result one step (ctx.step) may journal: a handler is
    # untrusted for size; past it the turn fails, naming this key.
    max_step_kb: Annotated[int, Meta(ge=1, le=1 << 20)] = 4096
    # All of one turn's steps together (they are kept until the turn's
    # commit); past it the turn fails, naming this key.
    max_turn_steps_mb: Annotated[int, Meta(ge=1, le=1 << 14)] = 64
    # A full snapshot replaces the log tail every this many turns.
    snapshot_every_turns: PositiveInt = 64


class SubagentSettings(ConfigSection):
    max_concurrent: NonNegInt = 4
    max_depth: NonNegInt = 2
    max_total_spawns: NonNegInt = 32
    child_timeout_secs: PositiveFloat = 600.0
    # Handlers a model may ask spawn_agent for, besides "agent", "echo" and
    # the parent's own: the model must not pick arbitrary importable code.
    allowed_handlers: list[str] = msgspec.field(default_factory=list)


class LoopSettings(ConfigSection):
    compaction_threshold_tokens: Annotated[int, Meta(ge=256)] = 100_000
    # Turns kept verbatim when the older part is summarized.
    compaction_keep_recent_turns: PositiveInt = 4


# A budget ceiling: unset (None) is no ceiling.
Ceiling = Annotated[int, Meta(ge=1, le=1 << 50)] | None


class BudgetSettings(ConfigSection):
    """Ceilings on what the agent's LLM calls spend (docs/limits.md, Budgets).

    Checked before each LLM call against what the daemon counts (the
    session's turns, failed and crashed ones included, plus the running
    turn's calls so far): a call is made only while every ceiling set is
    above what counts against it, so the last call may take a figure past
    its ceiling by that call's own tokens.  Crossing one ends the turn with
    a `limit_exceeded` event of kind `budget` naming the ceiling.  Input
    tokens are what the provider reports as prompt tokens (cache reads and
    writes included); output tokens its completion tokens, which include
    the reasoning tokens that reasoning_tokens also counts on their own."""

    # LLM calls one input may make (compaction summaries included).
    turn_max_llm_calls: Ceiling = None
    # LLM calls one session may make over its whole life.
    session_max_llm_calls: Ceiling = None
    # Input (prompt) tokens one session may spend, cache reads and writes included.
    session_max_input_tokens: Ceiling = None
    # Output (completion) tokens one session may spend, reasoning included.
    session_max_output_tokens: Ceiling = None
    # Reasoning tokens one session may spend.
    session_max_reasoning_tokens: Ceiling = None
    # LLM calls all sessions of one owner uid may make together (a removed
    # session's no longer count).  The uid_ ceilings are not settable per session.
    uid_max_llm_calls: Ceiling = None
    # Input tokens all sessions of one owner uid may spend together.
    uid_max_input_tokens: Ceiling = None
    # Output tokens all sessions of one owner uid may spend together.
    uid_max_output_tokens: Ceiling = None
    # Reasoning tokens all sessions of one owner uid may spend together.
    uid_max_reasoning_tokens: Ceiling = None


class AgentSettings(ConfigSection):
    # Handler run by new sessions: "agent", "echo" or "package.module:factory".
    # "agent" runs "echo" when no [provider] is configured at all (said at
    # start-up); a client naming "agent", or a provider missing base_url or
    # model, is refused at create instead.
    handler: str = "agent"
    # Handlers a client may name at create (besides `handler` above):
    # "agent", "echo", "package.module:factory", or "package.module:*" for
    # every factory of one module.  Nothing else is imported for a client.
    allowed_handlers: list[str] = msgspec.field(default_factory=lambda: ["agent", "echo"])
    system_prompt: str = "You are a helpful assistant working inside a sandboxed workspace."
    max_turns: PositiveInt = 25
    max_tool_calls_per_turn: PositiveInt = 16
    session_timeout_secs: PositiveFloat = 1800.0
    turn_timeout_secs: PositiveFloat = 600.0
    # Frames sent to a client that takes none of them (for at least a second,
    # its write buffer full) before it is told it lagged and is cut off; a
    # client that reads, however slowly, is bounded by client_buffer_bytes.
    stream_buffer_size: Annotated[int, Meta(ge=16)] = 1024
    limits: LimitsSettings = msgspec.field(default_factory=LimitsSettings)
    worker: WorkerSettings = msgspec.field(default_factory=WorkerSettings)
    subagents: SubagentSettings = msgspec.field(default_factory=SubagentSettings)
    loop: LoopSettings = msgspec.field(default_factory=LoopSettings)
    budget: BudgetSettings = msgspec.field(default_factory=BudgetSettings)


class ProviderSettings(ConfigSection):
    # "openai": POST {base_url}/chat/completions (OpenAI and the servers that
    # copy it); "anthropic": POST {base_url}/messages, Anthropic's Messages API.
    kind: Literal["openai", "anthropic"] = "openai"
    # e.g. "https://api.openai.com/v1", "https://api.anthropic.com/v1" or
    # "http://127.0.0.1:8000/v1"; unset = no provider.
    base_url: str | None = None
    model: str | None = None
    # Name of the environment variable that holds the API key (never the key itself).
    api_key_env: str | None = None
    # Models a session may pick with --set provider.model (besides `model`).
    allowed_models: list[str] = msgspec.field(default_factory=list)
    connect_timeout_secs: PositiveFloat = 10.0
    read_timeout_secs: PositiveFloat = 120.0
    max_retries: NonNegInt = 3
    # First wait before retrying a 429/5xx without Retry-After; doubles each retry.
    retry_backoff_initial_ms: Annotated[int, Meta(ge=1)] = 500
    # Longest wait between retries; a Retry-After asking for more fails the turn
    # at once instead of stalling it.
    retry_backoff_max_ms: Annotated[int, Meta(ge=1)] = 60_000
    # Send `stream_options: {include_usage: true}` (token usage in the stream).
    # Older Azure API versions and some proxies answer 400 to it: turn it off
    # for them (a server that rejects it by name is also retried without it).
    stream_usage: bool = True
    # Most output tokens per model call.  Anthropic requires one: 4096 when
    # unset.  OpenAI-compatible servers get `max_tokens` only when it is set.
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    # Anthropic extended thinking: `thinking: {type: enabled, budget_tokens}`
    # when > 0 (Anthropic wants at least 1024, and less than max_tokens).
    thinking_budget_tokens: NonNegInt = 0
    # Which reasoning text (DeepSeek/Kimi `reasoning_content`, OpenRouter/vLLM
    # `reasoning`, Anthropic thinking blocks) is sent back in the history:
    # "tool_turns": on the assistant messages of the running turn only, which
    # is what DeepSeek and Anthropic require after a tool call (DeepSeek
    # answers 400 without it) and what DeepSeek asks for earlier turns (leave
    # it out); "all": every turn's (Kimi's thinking models keep it all);
    # "none": never (servers that reject the field).
    reasoning_history: Literal["tool_turns", "all", "none"] = "tool_turns"

    @property
    def configured(self) -> bool:
        return bool(self.base_url and self.model)

    def missing(self) -> str | None:
        """The key(s) an agent session lacks to reach a provider, or None."""
        if not self.base_url and not self.model:
            return "provider.base_url and provider.model"
        if not self.base_url:
            return "provider.base_url"
        if not self.model:
            return "provider.model"
        return None

    def missing_text(self, where: str = "the config file sessiond runs with") -> str | None:
        """What an agent session lacks, and what to do about it; None when
        nothing is missing."""
        missing = self.missing()
        if missing is None:
            return None
        both = " and " in missing
        return (f"{missing} {'are' if both else 'is'} not set: add {'them' if both else 'it'} under [provider] "
                f"in {where} (`sessiond config default` shows every key), then `sessionctl reload`")


# The built-in tools' names (a contract: docs/agent.md): what `tools.enabled`
# may list besides the names of `tools.custom` functions.
BUILTIN_TOOLS = ("bash", "read_file", "write_file", "list_dir", "spawn_agent")


class ToolsSettings(ConfigSection):
    enabled: list[str] = msgspec.field(
        default_factory=lambda: ["bash", "read_file", "write_file", "list_dir", "spawn_agent"]
    )
    # User tools: "package.module:function" with a type-annotated signature.
    custom: list[str] = msgspec.field(default_factory=list)
    # Workspace of each session; empty = "<state_dir>/workspaces/<session id>".
    workspace_dir: str = ""
    # How max_disk_mb and max_disk_inodes hold (docs/limits.md): "auto" =
    # the kernel's where it can (a btrfs qgroup per workspace on btrfs with
    # quotas, else an ext4 image per workspace on a loop device: both need
    # CAP_SYS_ADMIN), else the workspace walked every few seconds and the
    # session stopped past a cap (blind to files unlinked while held open);
    # "kernel" = refuse to start where the kernel's cannot be had;
    # "measured" = the walk alone (no mounts made).  `sessionctl stats`
    # (disk_quota) and the start-up log say which holds and why.
    disk_quota: Literal["auto", "kernel", "measured"] = "auto"
    bash_timeout_secs: PositiveFloat = 120.0
    output_limit_bytes: Annotated[int, Meta(ge=256)] = 32_768
    # Tools run again when the worker died while they ran (read-only tools):
    # the others are answered to the model as killed, never re-run.
    rerun_after_crash: list[str] = msgspec.field(default_factory=lambda: ["read_file", "list_dir"])
    # Tools whose calls in one response the agent runs at the same time:
    # consecutive calls of these tools run together (their results go to
    # the model in the order of the calls); any other call runs alone, in
    # order.  Read-only tools by default: tools that act may race each other.
    parallel: list[str] = msgspec.field(default_factory=lambda: ["read_file", "list_dir"])


class PermissionRule(ConfigSection, kw_only=True):
    # The tool it is about: its name, "*" for every tool, or for MCP tools
    # Claude Code's shapes: "mcp__SERVER" or "mcp__SERVER__*" (every tool
    # of that server), "mcp__SERVER__TOOL".  A rule that can match no tool
    # of the configuration is refused (config check, reload).
    tool: str
    # Glob on the tool's main argument (command for bash, path for file
    # tools, the first argument of a custom or MCP tool).
    match: str = "*"
    action: Literal["allow", "deny", "ask"]

    def covers(self, tool: str) -> bool:
        """This rule names `tool`: "*", the name, or Claude Code's shapes
        for MCP tools, `mcp__SERVER` and `mcp__SERVER__*` (ipc.mcp)."""
        return rule_covers(self.tool, tool)


NetworkPolicy = Literal["none", "loopback", "full"]
# Least to most reach: a session override may only move left of the operator's.
NETWORK_LEVELS: tuple[str, ...] = ("none", "loopback", "full")


class SandboxSettings(ConfigSection):
    """Where a session's tools run: see README, Security."""

    # auto: the full sandbox; where a part of it cannot be built (namespaces,
    # Landlock, seccomp) the daemon starts and says so, and tools do not run
    # (fail closed); required: the daemon refuses to start instead; off:
    # tools run as the worker's user with no confinement.
    mode: Literal["auto", "required", "off"] = "auto"
    # auto: bubblewrap namespaces, and no tool runs where the daemon's probe
    # finds them unusable; off: Landlock, seccomp and the rest without them
    # (then tools may create no Unix socket: Landlock does not cover
    # connect() to a socket's path).
    namespaces: Literal["auto", "off"] = "auto"
    # Socket families tools may create: none: Unix only (with namespaces);
    # loopback: and inet/inet6 on a loopback of the session's own (needs
    # namespaces; else treated as none); full: and the host's network.
    network: NetworkPolicy = "none"
    # Extra read-only paths tools may see (a toolchain under /opt, say).
    read_paths: list[Annotated[str, Meta(pattern=r"^/")]] = msgspec.field(default_factory=list)
    # Size of the private /tmp (a tmpfs, with namespaces).
    tmp_size_mb: Annotated[int, Meta(ge=1, le=1 << 20)] = 256

    def refusal(self, namespaces: bool, why_no_namespaces: str, landlock_abi: int, why_no_seccomp: str,
                unmeasured: str = "") -> str:
        """Fail closed: why tools do not run with these settings on a host
        that offers what the arguments say, naming what is missing and the
        setting that is the operator's explicit weaker choice; '' when they
        run.  One wording for the worker's tool error, `stats` and the log.
        `unmeasured`: why the daemon could not hold a session's memory and
        processes to their caps (it cannot read its workers' /proc entries
        and has no cgroup for them)."""
        if self.mode == "off":
            return ""
        missing: list[str] = []
        if self.namespaces != "off" and not namespaces:
            missing.append(f"namespaces ({why_no_namespaces or 'unavailable'}); "
                           '[sandbox] namespaces = "off" runs tools under Landlock and seccomp without them')
        if not landlock_abi:
            missing.append("Landlock (not in this kernel, or not enabled: lsm=landlock)")
        if why_no_seccomp:
            missing.append(f"seccomp ({why_no_seccomp})")
        if unmeasured:
            missing.append(f"the daemon's measure of its sessions ({unmeasured})")
        if not missing:
            return ""
        return ("tools do not run: the sandbox cannot be built here: missing " + "; ".join(missing)
                + '; [sandbox] mode = "off" runs them unconfined')


# A server's name is part of every tool name the model sees,
# `mcp__<name>__<tool>`, and providers allow only [A-Za-z0-9_-] in tool
# names (64 characters at most): letters and digits, with single `-` or `_`
# between them, so that `__` separates the parts unambiguously.
MCP_NAME_PATTERN = r"^[A-Za-z0-9]+(?:[-_][A-Za-z0-9]+)*$"
_EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128)]
_HeaderName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9-]{1,64}$")]


class McpServer(ConfigSection):
    """One `[[mcp.servers]]` table: a Model Context Protocol server whose
    tools sessions are offered as `mcp__<name>__<tool>`.  `command`, `url`,
    `env` and `headers` may hold `${VAR}` and `${VAR:-default}`, read from
    the daemon's environment when the server is started."""

    # Letters and digits, single - or _ between them; unique among the servers.
    name: Annotated[str, Meta(min_length=1, max_length=24, pattern=MCP_NAME_PATTERN)]
    # A stdio server: its argv, started in each session's sandbox (as the
    # session's tools are: its identity, limits and view of the files).
    command: Annotated[list[Annotated[str, Meta(max_length=4096)]], Meta(min_length=1, max_length=64)] | None = None
    # An HTTP server: its endpoint, reached by the session's worker
    # (outside the sandbox), and no other URL.
    url: Annotated[str, Meta(pattern=r"^(https?://|\$\{)[^\s]+$", max_length=2048)] | None = None
    # An HTTP server's transport: "http" (streamable HTTP, the default) or
    # "sse" (the legacy HTTP+SSE transport); "stdio" for a command.
    type: Literal["", "stdio", "http", "sse"] = ""
    # Extra environment of a stdio server (its tools otherwise get the
    # scrubbed environment every tool gets).
    env: Annotated[dict[_EnvName, Annotated[str, Meta(max_length=4096)]], Meta(max_length=64)] = (
        msgspec.field(default_factory=dict))
    # HTTP headers of an HTTP server: {Authorization = "Bearer ${SEARCH_TOKEN}"}
    # (the secret in the daemon's environment, not in this file).
    headers: Annotated[dict[_HeaderName, Annotated[str, Meta(max_length=4096)]], Meta(max_length=16)] = (
        msgspec.field(default_factory=dict))
    # HTTP headers of an HTTP server, each from a variable of the daemon's
    # environment (never the secret itself): {Authorization = "SEARCH_MCP_AUTH"}.
    headers_env: Annotated[dict[_HeaderName, _EnvName], Meta(max_length=16)] = msgspec.field(default_factory=dict)
    # true: the daemon lists its tools once and every session is offered
    # them; a session starts its own copy only when the model first calls
    # one.  false: each session starts it (and lists its tools) at its
    # first turn: for a server whose tools depend on the session (its
    # workspace, its network).
    lazy: bool = True

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of `command` (stdio) or `url` (HTTP)")
        if self.env and self.command is None:
            raise ValueError(f"MCP server {self.name!r}: `env` is for a stdio server (`command`)")
        if (self.headers_env or self.headers) and self.url is None:
            raise ValueError(f"MCP server {self.name!r}: `headers` and `headers_env` are for an HTTP server (`url`)")
        if self.type in ("http", "sse") and self.url is None or self.type == "stdio" and self.command is None:
            raise ValueError(f"MCP server {self.name!r}: type {self.type!r} needs "
                             f"{'`command`' if self.type == 'stdio' else '`url`'}")

    @property
    def transport(self) -> str:
        """stdio, http or sse."""
        return "stdio" if self.command is not None else (self.type or "http")


class McpSettings(ConfigSection):
    # The MCP servers whose tools sessions are offered ([[mcp.servers]] tables).
    servers: Annotated[list[McpServer], Meta(max_length=32)] = msgspec.field(default_factory=list)
    # A Claude Code / Cursor style JSON file ({"mcpServers": {...}}, as in
    # `.mcp.json`) whose servers join mcp.servers, read at start and at
    # each reload; relative to this file's directory.  Empty = none.
    import_: Annotated[str, Meta(max_length=4096)] = msgspec.field(default="", name="import")
    # Names of the servers sessions are offered; unset = all of them.  A
    # session may narrow it (--set mcp.enabled=[...]), never widen it.
    enabled: Annotated[list[Annotated[str, Meta(max_length=24)]], Meta(max_length=32)] | None = None
    # Longest wait for one MCP tool call; past it the call fails (a stdio
    # server is then stopped, and started again at its next call).
    call_timeout_secs: PositiveFloat = 120.0
    # Longest wait for a server to start and list its tools.
    start_timeout_secs: PositiveFloat = 30.0
    # A server that cannot be started or listed is not tried again for
    # this long (doubling at each failure in a row, up to 32 times it):
    # neither by the daemon nor by a session, whose turns go on without it.
    retry_backoff_secs: Annotated[float, Meta(gt=0, le=86_400)] = 30.0
    # The daemon lists each lazy server again this often, to follow a new
    # version of it (a reload lists a changed table at once).
    relist_interval_secs: Annotated[float, Meta(ge=60, le=7 * 86_400)] = 3600.0
    # Filled by the daemon, never by this file: the tool lists of the lazy
    # servers, which it tells every session.
    listed: Annotated[list[McpListing], Meta(max_length=32)] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        names = [server.name for server in self.servers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"MCP server names must be unique: {', '.join(twice)} listed twice")
        unknown = [n for n in self.enabled or () if n not in names]
        if unknown:
            raise ValueError(f"enabled names no server of mcp.servers: {', '.join(unknown)}")

    def offered(self) -> list[McpServer]:
        """The servers a session is offered, in the operator's order."""
        if self.enabled is None:
            return list(self.servers)
        return [server for server in self.servers if server.name in self.enabled]


class SessionSettings(ConfigSection):
    """What one session runs with: the operator's config plus its overrides."""

    agent: AgentSettings = msgspec.field(default_factory=AgentSettings)
    provider: ProviderSettings = msgspec.field(default_factory=ProviderSettings)
    tools: ToolsSettings = msgspec.field(default_factory=ToolsSettings)
    permissions: list[PermissionRule] = msgspec.field(default_factory=list)
    sandbox: SandboxSettings = msgspec.field(default_factory=SandboxSettings)
    mcp: McpSettings = msgspec.field(default_factory=McpSettings)
