"""Shell completion scripts and the man page of sessionctl, both generated
from its argparse definitions (`supervisor.ctl.cli._parser`), so that neither
can fall behind a new command or flag.

    sessionctl completion bash > /etc/bash_completion.d/sessionctl
    sessionctl completion zsh > "${fpath[1]}/_sessionctl"
    python -m supervisor.ctl.manpage > sessionctl.1            (make man)

Session ids are completed from the daemon at completion time with
`sessionctl [--socket PATH] ls -q` (the --socket on the command line being
completed is passed on); a daemon that is down completes nothing.  The
`sessionctl` run is the one being completed, as typed (`.venv/bin/sessionctl`
works without being on PATH), else `program`: the sessionctl that generated
the script, by its absolute path.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from dataclasses import dataclass, field

from supervisor import __version__

__all__ = ["Command", "bash_script", "commands", "man_page", "this_program", "zsh_script"]

# Options whose next word is their value, not a command or a session id.
_TAKES_VALUE = "--id|--limit|--interval|--sample-secs|--from|--set|--handler|--sort|--state|--owner|--timeout"


def this_program() -> str:
    """The absolute path of the sessionctl running now (the console script,
    or the one beside this interpreter for `python -m supervisor.ctl`);
    plain `sessionctl` if there is none."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "sessionctl" and os.access(argv0, os.X_OK):
        return os.path.abspath(argv0)
    beside = os.path.join(os.path.dirname(sys.executable), "sessionctl")
    return beside if os.access(beside, os.X_OK) else "sessionctl"


@dataclass
class Command:
    name: str
    help: str
    options: list[str] = field(default_factory=list)  # every option string, e.g. --limit
    takes_id: bool = False  # the first positional is a session id
    positionals: list[str] = field(default_factory=list)
    choices: dict[str, list[str]] = field(default_factory=dict)  # positional/option -> values
    parser: argparse.ArgumentParser | None = None


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise LookupError("sessionctl has no subcommands?")


def commands(parser: argparse.ArgumentParser) -> list[Command]:
    sub = _subparsers(parser)
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    out = []
    for name, p in sub.choices.items():
        cmd = Command(name=name, help=helps.get(name, ""), parser=p)
        for action in p._actions:
            if action.option_strings:
                if "-h" in action.option_strings:
                    continue
                cmd.options.extend(action.option_strings)
                if action.choices:
                    cmd.choices[action.option_strings[-1]] = [str(c) for c in action.choices]
            else:
                cmd.positionals.append(action.dest)
                if action.choices:
                    cmd.choices[action.dest] = [str(c) for c in action.choices]
        cmd.takes_id = bool(cmd.positionals) and cmd.positionals[0] == "id"
        out.append(cmd)
    return out


def _global_options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions if a.option_strings and "-h" not in a.option_strings
            for s in a.option_strings] + ["--help"]


# ---------------------------------------------------------------- bash


def bash_script(parser: argparse.ArgumentParser, program: str = "sessionctl") -> str:
    cmds = commands(parser)
    cases = []
    for c in cmds:
        opts = " ".join(c.options + ["--help"])
        values = ""
        for opt, choices in c.choices.items():
            if opt.startswith("-"):
                values += f"            {opt}) COMPREPLY=($(compgen -W {shlex.quote(' '.join(choices))} -- \"$cur\")); return;;\n"
        if c.takes_id:
            words = "$(_sessionctl_ids)"
        elif c.name == "import":
            words = "__files__"
        elif c.positionals and c.positionals[0] in c.choices:
            words = " ".join(c.choices[c.positionals[0]])
        else:
            words = ""
        cases.append(
            f"        {c.name})\n"
            f"            case \"$prev\" in\n{values}"
            f"                {_TAKES_VALUE}) return;;\n"
            f"            esac\n"
            f"            if [[ $cur == -* ]]; then COMPREPLY=($(compgen -W {shlex.quote(opts)} -- \"$cur\"))\n"
            f"            elif (( npos == 0 )); then\n"
            + ("                COMPREPLY=($(compgen -f -- \"$cur\"))\n" if words == "__files__" else
               f"                COMPREPLY=($(compgen -W \"{words}\" -- \"$cur\"))\n")
            + "            fi;;\n"
        )
    names = " ".join(c.name for c in cmds)
    globals_ = " ".join(_global_options(parser))
    return f"""# bash completion for sessionctl {__version__} (generated: sessionctl completion bash)
_sessionctl_ids() {{
    local cmd=${{COMP_WORDS[0]/#\\~/$HOME}}
    if ! type -P "$cmd" >/dev/null 2>&1; then cmd={shlex.quote(program)}; fi
    "$cmd" ${{_sessionctl_socket:+--socket "$_sessionctl_socket"}} ls -q 2>/dev/null
}}
_sessionctl() {{
    local cur prev cmd="" npos=0 i w _sessionctl_socket=""
    cur=${{COMP_WORDS[COMP_CWORD]}}
    prev=${{COMP_WORDS[COMP_CWORD-1]}}
    for (( i = 1; i < COMP_CWORD; i++ )); do
        w=${{COMP_WORDS[i]}}
        case "$w" in
            --socket) _sessionctl_socket=${{COMP_WORDS[i+1]}}; (( i++ )); continue;;
            --socket=*) _sessionctl_socket=${{w#--socket=}}; continue;;
            {_TAKES_VALUE}) (( i++ )); continue;;
            -*) continue;;
        esac
        if [[ -z $cmd ]]; then cmd=$w; else (( npos++ )); fi
    done
    if [[ $prev == --socket ]]; then COMPREPLY=($(compgen -f -- "$cur")); return; fi
    if [[ -z $cmd ]]; then
        if [[ $cur == -* ]]; then COMPREPLY=($(compgen -W {shlex.quote(globals_)} -- "$cur"))
        else COMPREPLY=($(compgen -W {shlex.quote(names)} -- "$cur")); fi
        return
    fi
    case "$cmd" in
{''.join(cases)}    esac
}}
complete -F _sessionctl sessionctl
"""


# ---------------------------------------------------------------- zsh


def _zsh_quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace(":", "\\:").replace("'", "'\\''")


def zsh_script(parser: argparse.ArgumentParser, program: str = "sessionctl") -> str:
    cmds = commands(parser)
    described = "\n".join(f"        '{c.name}:{_zsh_quote(c.help)}'" for c in cmds)
    cases = []
    for c in cmds:
        opts = " ".join(c.options + ["--help"])
        if c.takes_id:
            first = "_sessionctl_ids"
        elif c.name == "import":
            first = "_files"
        elif c.positionals and c.positionals[0] in c.choices:
            first = f"compadd -- {' '.join(c.choices[c.positionals[0]])}"
        else:
            first = ":"
        sort = c.choices.get("--sort")
        sort_case = (f"    elif [[ ${{words[CURRENT-1]}} == --sort ]]; then compadd -- {' '.join(sort)}\n"
                     if sort else "")
        cases.append(
            f"    {c.name})\n"
            f"      if [[ $PREFIX == -* ]]; then compadd -- {opts}\n{sort_case.replace('    elif', '      elif')}"
            f"      elif (( npos == 0 )); then {first}\n"
            f"      fi;;\n"
        )
    globals_ = " ".join(_global_options(parser))
    return f"""#compdef sessionctl
# zsh completion for sessionctl {__version__} (generated: sessionctl completion zsh)
_sessionctl_ids() {{
  local -a ids
  local cmd=${{~words[1]}}
  (( $+commands[$cmd] )) || [[ -x $cmd ]] || cmd={shlex.quote(program)}
  ids=(${{(f)"$($cmd ${{socket:+--socket $socket}} ls -q 2>/dev/null)"}})
  compadd -a ids
}}
_sessionctl() {{
  local cmd="" socket="" npos=0 i w
  local -a commands
  commands=(
{described}
  )
  for (( i = 2; i < CURRENT; i++ )); do
    w=${{words[i]}}
    case $w in
      --socket) socket=${{words[i+1]}}; (( i++ )); continue;;
      --socket=*) socket=${{w#--socket=}}; continue;;
      {_TAKES_VALUE}) (( i++ )); continue;;
      -*) continue;;
    esac
    if [[ -z $cmd ]]; then cmd=$w; else (( npos++ )); fi
  done
  if [[ ${{words[CURRENT-1]}} == --socket ]]; then _files; return; fi
  if [[ -z $cmd ]]; then
    if [[ $PREFIX == -* ]]; then compadd -- {globals_}; else _describe 'command' commands; fi
    return
  fi
  case $cmd in
{''.join(cases)}  esac
}}
_sessionctl "$@"
"""


# ---------------------------------------------------------------- man page


def _roff(text: str) -> str:
    lines = []
    for line in text.replace("\\", "\\e").splitlines():
        if line.startswith((".", "'")):
            line = "\\&" + line
        lines.append(line.replace("-", "\\-"))
    return "\n".join(lines)


def man_page(parser: argparse.ArgumentParser) -> str:
    """sessionctl(1) in roff (man -l renders it)."""
    today = datetime.date.today().isoformat()
    out = [
        f'.TH SESSIONCTL 1 "{today}" "sessiond {__version__}" "User Commands"',
        ".SH NAME", "sessionctl \\- talk to sessiond, the session supervisor for LLM agents",
        ".SH SYNOPSIS", ".B sessionctl", "[\\-\\-socket PATH] [\\-\\-json] COMMAND [ARGS]",
        ".SH DESCRIPTION", _roff(parser.description or ""),
        ".SH OPTIONS",
    ]
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._SubParsersAction):
            out += [".TP", "\\fB" + _roff(", ".join(action.option_strings)) + "\\fR", _roff(action.help or "")]
    out.append(".SH COMMANDS")
    for c in commands(parser):
        assert c.parser is not None
        usage = c.parser.format_usage().replace("usage: ", "").strip()
        out += [".SS " + c.name, _roff(c.help), ".PP", ".nf", _roff(usage), ".fi"]
        for action in c.parser._actions:
            if "-h" in action.option_strings:
                continue
            name = ", ".join(action.option_strings) or action.dest
            if action.help and action.help != argparse.SUPPRESS:
                out += [".TP", "\\fB" + _roff(name) + "\\fR", _roff(action.help.replace("%%", "%"))]
    epilog = parser.epilog or ""
    examples, _, codes = epilog.partition("exit codes:")
    out += [".SH EXAMPLES", ".nf", _roff(examples.replace("examples:", "").strip("\n")), ".fi",
            ".SH EXIT STATUS", ".nf", _roff(codes.strip("\n")), ".fi",
            ".SH ENVIRONMENT", ".TP", "\\fBSESSIOND_SOCKET\\fR",
            "the daemon's socket when \\-\\-socket is not given",
            ".SH SEE ALSO", "sessiond(1), the README of sessiond"]
    return "\n".join(out) + "\n"
