#!/usr/bin/env bash
# Install (or upgrade) sessiond as a systemd service. Run as root from a
# checkout of the repository:
#
#   sudo systemd/install.sh
#
# What it does, each step safe to repeat:
#   1. creates or updates the virtualenv /opt/sessiond and pip-installs the
#      checkout into it (the units run /opt/sessiond/bin/sessiond);
#   2. installs sessiond.service and sessiond.socket into /etc/systemd/system
#      and the sysusers.d entry into /etc/sysusers.d, then creates the
#      "sessiond" system group from it (the group that may connect to the
#      control socket; the daemon itself runs as root and gives every
#      session a uid of its own, see sessiond.service);
#   3. writes /etc/sessiond/config.toml from `sessiond config default` only if
#      there is none (an existing config is checked, never overwritten), and an
#      empty /etc/sessiond/environment (mode 0600) for secrets;
#   4. runs `systemctl daemon-reload` when systemd is the running init, and
#      prints the command that starts the service.
#
# Options:
#   --root DIR   install into DIR instead of / (like DESTDIR=DIR, which is
#                also honoured): for building images and for tests. Nothing
#                outside DIR is touched and systemctl is not run.
#                The venv is built in DIR/opt/sessiond but names its final
#                paths (/opt/sessiond/...) in its scripts, pyvenv.cfg and
#                bytecode, so the tree works once copied to /.
#   --python PATH  the interpreter the venv is made from (>= 3.11; also
#                $PYTHON). Default: the first of /usr/bin/python3,
#                /usr/local/bin/python3, /usr/bin/python3.1[1-9] that is new
#                enough. One under /root, /home or /run/user is refused: the
#                unit's ProtectHome=yes hides it from the service.
#   --allow-hidden-python  accept such an interpreter anyway (a staged
#                install for tests; the service could not start from it).
#   --no-pip     skip step 1 (the venv at ROOT/opt/sessiond must then exist,
#                or at least ROOT/opt/sessiond/bin/sessiond, to write the
#                default config).
#   -h, --help   show this text.
# The checkout is left as it was: the wheel is built from a copy in a
# temporary directory (no build/ or *.egg-info in the checkout).
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

root="${DESTDIR:-/}"
do_pip=1
python="${PYTHON:-}"
allow_hidden=0
while [ $# -gt 0 ]; do
    case "$1" in
        --root) [ $# -ge 2 ] || { echo "install.sh: --root needs a directory" >&2; exit 2; }
                root="$2"; shift 2 ;;
        --root=*) root="${1#--root=}"; shift ;;
        --python) [ $# -ge 2 ] || { echo "install.sh: --python needs a path" >&2; exit 2; }
                  python="$2"; shift 2 ;;
        --python=*) python="${1#--python=}"; shift ;;
        --allow-hidden-python) allow_hidden=1; shift ;;
        --no-pip) do_pip=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown argument: $1 (try --help)" >&2; exit 2 ;;
    esac
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
units="$repo/systemd"
# ROOT-relative paths. "${root%/}" turns "/" into "" so the live paths stay
# /opt/..., /etc/... and a staging root gives DIR/opt/..., DIR/etc/....
R="${root%/}"
live=0
if [ -z "$R" ]; then
    live=1
else
    mkdir -p "$R"
    R="$(cd "$R" && pwd)"   # absolute, so the messages and mktemp agree
fi
final_venv=/opt/sessiond
venv="$R$final_venv"
sessiond_bin="$venv/bin/sessiond"

if [ "$live" = 1 ] && [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root (or use --root DIR for a staging install)" >&2
    exit 1
fi

say() { printf 'install.sh: %s\n' "$*"; }

new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

# The venv's scripts name /opt/sessiond/bin/python, which exists only once a
# staged tree is in place: until then run them with the staged interpreter.
run_sessiond() {
    if [ -n "$R" ] && [ -x "$venv/bin/python" ]; then
        "$venv/bin/python" "$sessiond_bin" "$@"
    else
        "$sessiond_bin" "$@"
    fi
}

# 1. The venv. Re-running `python -m venv` on an existing venv keeps its
#    packages; `pip install --upgrade` replaces the previous sessiond build.
if [ "$do_pip" = 1 ]; then
    if [ -z "$python" ]; then
        # An explicit system interpreter, not the first python3 on PATH
        # (pyenv's shims under /root would win there).
        for candidate in /usr/bin/python3 /usr/local/bin/python3 /usr/bin/python3.1[1-9]; do
            if [ -x "$candidate" ] && new_enough "$candidate"; then python="$candidate"; break; fi
        done
        [ -n "$python" ] || {
            echo "install.sh: no system Python >= 3.11 in /usr/bin or /usr/local/bin; pass --python PATH" >&2
            exit 1; }
    fi
    new_enough "$python" || { echo "install.sh: $python is not a Python 3.11 or newer" >&2; exit 1; }
    # Where the interpreter really lives (through shims, symlinks, venvs).
    real="$("$python" -c 'import os, sys; print(os.path.realpath(sys.executable)); print(os.path.realpath(sys.base_prefix))')"
    while IFS= read -r path; do
        case "$path/" in
            /root/*|/home/*|/run/user/*)
                if [ "$allow_hidden" = 1 ]; then
                    say "WARNING: $python lives in $path, which ProtectHome=yes hides from sessiond.service (--allow-hidden-python)"
                    break
                fi
                echo "install.sh: $python lives in $path, which sessiond.service cannot see (ProtectHome=yes hides /root, /home and /run/user): the daemon would not start. Pass --python with a system interpreter, e.g. --python /usr/bin/python3 (--allow-hidden-python overrides this, for staged test installs only)" >&2
                exit 1 ;;
        esac
    done <<<"$real"
    say "virtualenv $venv (from $python)"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # Build the wheel from a copy, so the checkout gets no build/ or
    # *.egg-info (owned by root, in a user's clone).
    build="$(mktemp -d)"
    trap 'rm -rf "$build"' EXIT
    mkdir "$build/src" "$build/wheel"
    for item in pyproject.toml README.md LICENSE supervisor session_worker ipc; do
        [ ! -e "$repo/$item" ] || cp -R "$repo/$item" "$build/src/"
    done
    find "$build/src" -name __pycache__ -prune -exec rm -rf {} +
    "$venv/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$build/wheel" "$build/src"
    wheel=("$build"/wheel/sessiond-*.whl)
    # Dependencies first, then this build over whatever version was there.
    "$venv/bin/python" -m pip install --quiet --no-compile --upgrade "${wheel[0]}"
    "$venv/bin/python" -m pip install --quiet --no-compile --no-deps --force-reinstall "${wheel[0]}"
    rm -rf "$build"
    trap - EXIT
    if [ -f "$repo/README.md" ]; then
        install -m 0644 "$repo/README.md" "$venv/README.md"
    fi
    # The README links to these; keep them beside it (the unit's
    # Documentation= names the README).
    [ ! -f "$repo/ARCHITECTURE.md" ] || install -m 0644 "$repo/ARCHITECTURE.md" "$venv/ARCHITECTURE.md"
    if [ -d "$repo/docs" ]; then
        install -d -m 0755 "$venv/docs"
        install -m 0644 "$repo"/docs/*.md "$venv/docs/"
    fi
    if [ -n "$R" ]; then
        # Staged: the venv names $venv in its scripts (shebangs, activate)
        # and pyvenv.cfg; make them name the final path.
        grep -rlIZ -F -- "$venv" "$venv/bin" "$venv/pyvenv.cfg" | xargs -0 -r sed -i "s|$venv|$final_venv|g"
    fi
    # Bytecode now (the unit's /opt is read-only), naming the final paths.
    if [ -n "$R" ]; then
        "$venv/bin/python" -m compileall -q -f -s "$R" -p / "$venv/lib" >/dev/null
    else
        "$venv/bin/python" -m compileall -q "$venv/lib" >/dev/null
    fi
fi

# 2. Units and the socket's group. install(1) overwrites, so upgrades get the
#    new units; local changes belong in drop-ins, which survive.
say "units into $R/etc/systemd/system"
install -d -m 0755 "$R/etc/systemd/system" "$R/etc/sysusers.d"
install -m 0644 "$units/sessiond.service" "$units/sessiond.socket" "$R/etc/systemd/system/"
install -m 0644 "$units/sysusers.d/sessiond.conf" "$R/etc/sysusers.d/sessiond.conf"

if command -v systemd-sysusers >/dev/null 2>&1; then
    if [ "$live" = 1 ]; then
        systemd-sysusers /etc/sysusers.d/sessiond.conf
    elif [ -e "$R/etc/passwd" ]; then
        # A staging root that is an OS tree gets the user in its own
        # /etc/passwd; a bare one is left for systemd-sysusers at first boot.
        systemd-sysusers --root="$R" "$R/etc/sysusers.d/sessiond.conf"
    fi
elif [ "$live" = 1 ] && ! getent group sessiond >/dev/null; then
    groupadd --system sessiond
fi

# 3. Config: created once, then the operator's. Written to a temporary file
#    first so a failing `config default` never leaves an empty config behind.
install -d -m 0755 "$R/etc/sessiond"
config="$R/etc/sessiond/config.toml"
if [ -e "$config" ]; then
    say "keeping existing $config"
    if [ -x "$sessiond_bin" ] && ! run_sessiond config check "$config"; then
        say "WARNING: $config does not pass 'sessiond config check' with this version; fix it before restarting"
    fi
else
    [ -x "$sessiond_bin" ] || {
        echo "install.sh: $sessiond_bin is missing; cannot write the default config (run without --no-pip)" >&2
        exit 1; }
    tmp="$(mktemp "$R/etc/sessiond/.config.toml.XXXXXX")"
    trap 'rm -f "$tmp"' EXIT
    run_sessiond config default >"$tmp"
    chmod 0644 "$tmp"
    mv -f "$tmp" "$config"
    trap - EXIT
    say "wrote default $config"
fi
env_file="$R/etc/sessiond/environment"
if [ ! -e "$env_file" ]; then
    # Secrets (the provider's API key) go here, read by systemd as root before
    # the daemon drops privileges: the daemon's user cannot read this file.
    ( umask 077
      printf '%s\n' \
        '# Environment for sessiond.service (EnvironmentFile=), mode 0600 root.' \
        '# Put the provider API key here under the name that config.toml gives in' \
        '# [provider] api_key_env, for example:' \
        '# OPENAI_API_KEY=sk-...' >"$env_file" )
fi

# 4. Tell systemd, when it is the running init of this very root.
if [ "$live" = 1 ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    say "installed. Next:"
    say "  systemctl enable --now sessiond.socket     # first install"
    say "  systemctl restart sessiond.service         # upgrade of a running daemon"
else
    say "installed into ${R:-/} (systemd is not running there: no daemon-reload). On the target system:"
    say "  systemctl daemon-reload && systemctl enable --now sessiond.socket"
fi
