"""`sessiond`: run the daemon, or work with its config file.

    sessiond [run] [--config PATH] [--socket PATH] [--state-dir PATH]
    sessiond config default        print the embedded defaults as TOML
    sessiond config check PATH     validate a config file (exit 0, or 2 naming the key)
    sessiond mcp import FILE       a Claude Code / Cursor .mcp.json as [[mcp.servers]] tables
    sessiond version
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from ipc.mcp import variables
from supervisor import __version__
from ipc.install import install_command
from supervisor.config import Config, ConfigError, default_config_path, default_toml, load_config

__all__ = ["main"]

EXIT_USAGE = 2


_EPILOG = """\
examples:
  sessiond                               run in the foreground (systemd runs it so)
  sessiond run --config /etc/sessiond/config.toml
  sessiond config default > config.toml  every key, its default and its meaning
  sessiond config check config.toml      validate before a reload
  sessiond mcp import .mcp.json >> config.toml   Claude Code's MCP servers, as tables

exit codes:
  0  done (the daemon stopped cleanly)
  1  the daemon could not start (the reason is on stderr)
  2  usage, or a config file that is not valid (naming the key and file)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sessiond", description="Process-isolated session supervisor for LLM agents.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sessiond {__version__}")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the daemon in the foreground (the default)")
    for p in (parser, run):
        p.add_argument("--config", type=Path, help="config.toml (default: /etc/sessiond/config.toml "
                       "as root, else $XDG_CONFIG_HOME/sessiond/config.toml, if present)")
        p.add_argument("--socket", type=Path, help="control socket path")
        p.add_argument("--state-dir", type=Path, help="where sessions are kept")
    cfg = sub.add_parser("config", help="print or check a config file")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    cfg_sub.add_parser("default", help="print the default config as TOML")
    check = cfg_sub.add_parser("check", help="validate a config file")
    check.add_argument("path", type=Path)
    mcp = sub.add_parser("mcp", help="MCP servers as other tools write them")
    mcp_sub = mcp.add_subparsers(dest="mcp_command", required=True)
    imp = mcp_sub.add_parser("import", help="print a Claude Code / Cursor .mcp.json's servers as "
                             "[[mcp.servers]] tables (or name the file in [mcp] import)")
    imp.add_argument("file", type=Path)
    sub.add_parser("version", help="print the version")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "version":
        print(f"sessiond {__version__}")
        return 0
    if args.command == "mcp":
        return _mcp_import(args.file)
    if args.command == "config":
        if args.config_command == "default":
            sys.stdout.write(default_toml())
            return 0
        try:
            cfg = load_config(args.path)
        except ConfigError as exc:
            print(f"sessiond: {exc}", file=sys.stderr)
            return EXIT_USAGE
        provider = cfg.provider
        missing = provider.missing()
        if missing and (provider.base_url or provider.model):
            print(f"sessiond: {args.path}: [provider] is incomplete: {provider.missing_text(args.path)}; "
                  "until then agent sessions are refused at create", file=sys.stderr)
            return EXIT_USAGE
        if provider.api_key_env and not os.environ.get(provider.api_key_env):
            print(f"sessiond: warning: {args.path}: provider.api_key_env names "
                  f"{provider.api_key_env}, which is not set in this environment", file=sys.stderr)
        if cfg.mcp.servers and importlib.util.find_spec("mcp") is None:
            print(f"sessiond: warning: {args.path}: [[mcp.servers]] needs the MCP SDK, which is not "
                  f"installed: {install_command('mcp')}", file=sys.stderr)
        from supervisor.daemon import fd_clamp_here

        if clamp := fd_clamp_here(cfg):
            print(f"sessiond: warning: {args.path}: with this shell's hard RLIMIT_NOFILE, {clamp}", file=sys.stderr)
        for warning in _mcp_warnings(cfg):
            print(f"sessiond: warning: {args.path}: {warning}", file=sys.stderr)
        if missing:
            print(f"{args.path}: ok (no [provider]: new sessions run echo; "
                  "--handler agent is refused)")
            return 0
        print(f"{args.path}: ok")
        return 0

    from supervisor.daemon import StartupError, configure_logging, run_daemon

    config_path = args.config or default_config_path()
    try:
        cfg = load_config(config_path)
    except ConfigError as exc:
        print(f"sessiond: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(cfg.daemon.log_level, cfg.daemon.log_format)
    try:
        return run_daemon(cfg, args.state_dir, args.socket, config_path)
    except StartupError as exc:
        print(f"sessiond: {exc}", file=sys.stderr)
        return 1


def _mcp_warnings(cfg: Config) -> list[str]:
    """What may work where the daemon runs but not here: variables its
    environment file may set, read paths of another host."""
    out = []
    for server in cfg.mcp.servers:
        for header, variable in server.headers_env.items():
            if not os.environ.get(variable):
                out.append(f"MCP server {server.name!r}: headers_env.{header} names {variable}, which is not "
                           "set in this environment")
        texts = [*(server.command or ()), *server.env.values(), server.url or "", *server.headers.values()]
        for name, has_default in variables(texts):
            if not has_default and name not in os.environ:
                out.append(f"MCP server {server.name!r} names ${{{name}}}, which is not set in this "
                           "environment (the daemon reads it from its own: its EnvironmentFile)")
    out += [f"sandbox.read_paths: {path} does not exist here" for path in cfg.sandbox.read_paths
            if not os.path.exists(path)]
    return out


def _mcp_import(path: Path) -> int:
    """`sessiond mcp import FILE`: the servers as TOML, checked as a config's."""
    import json

    import msgspec
    import tomli_w

    from ipc.mcpjson import servers_from_json
    from ipc.settings import McpSettings

    try:
        tables = servers_from_json(json.loads(path.read_bytes()))
        msgspec.convert({"servers": tables}, McpSettings)
    except OSError as exc:
        print(f"sessiond: {path}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, msgspec.ValidationError) as exc:
        print(f"sessiond: {path}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"# MCP servers of {path} (sessiond mcp import); ${{VAR}} is read from the daemon's environment")
    sys.stdout.write(tomli_w.dumps({"mcp": {"servers": tables}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
