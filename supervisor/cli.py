"""`sessiond`: run the daemon, or work with its config file.

    sessiond [run] [--config PATH] [--socket PATH] [--state-dir PATH]
    sessiond config default        print the embedded defaults as TOML
    sessiond config check PATH     validate a config file (exit 0, or 2 naming the key)
    sessiond version
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from supervisor import __version__
from ipc.install import install_command
from supervisor.config import ConfigError, default_config_path, default_toml, load_config

__all__ = ["main"]

EXIT_USAGE = 2


_EPILOG = """\
examples:
  sessiond                               run in the foreground (systemd runs it so)
  sessiond run --config /etc/sessiond/config.toml
  sessiond config default > config.toml  every key, its default and its meaning
  sessiond config check config.toml      validate before a reload

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
    sub.add_parser("version", help="print the version")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "version":
        print(f"sessiond {__version__}")
        return 0
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
        for server in cfg.mcp.servers:
            for header, variable in server.headers_env.items():
                if not os.environ.get(variable):
                    print(f"sessiond: warning: {args.path}: MCP server {server.name!r}: headers_env.{header} "
                          f"names {variable}, which is not set in this environment", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
