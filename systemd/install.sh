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
#      "sessiond" system user and group from it;
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
#   --no-pip     skip step 1 (the venv at ROOT/opt/sessiond must then exist,
#                or at least ROOT/opt/sessiond/bin/sessiond, to write the
#                default config).
#   -h, --help   show this text.
# Environment: PYTHON (default python3, >= 3.11) creates the venv.
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

root="${DESTDIR:-/}"
do_pip=1
while [ $# -gt 0 ]; do
    case "$1" in
        --root) [ $# -ge 2 ] || { echo "install.sh: --root needs a directory" >&2; exit 2; }
                root="$2"; shift 2 ;;
        --root=*) root="${1#--root=}"; shift ;;
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
venv="$R/opt/sessiond"
sessiond_bin="$venv/bin/sessiond"

if [ "$live" = 1 ] && [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root (or use --root DIR for a staging install)" >&2
    exit 1
fi

say() { printf 'install.sh: %s\n' "$*"; }

# 1. The venv. Re-running `python -m venv` on an existing venv keeps its
#    packages; `pip install --upgrade` replaces the previous sessiond build.
if [ "$do_pip" = 1 ]; then
    python="${PYTHON:-python3}"
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
        echo "install.sh: $python is older than Python 3.11" >&2; exit 1; }
    say "virtualenv $venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet --upgrade "$repo"
    if [ -f "$repo/README.md" ]; then
        install -m 0644 "$repo/README.md" "$venv/README.md"
    fi
fi

# 2. Units and the system user. install(1) overwrites, so upgrades get the
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
elif [ "$live" = 1 ] && ! getent passwd sessiond >/dev/null; then
    useradd --system --user-group --home-dir /var/lib/sessiond --no-create-home \
        --shell /usr/sbin/nologin --comment "sessiond LLM agent session supervisor" sessiond
fi

# 3. Config: created once, then the operator's. Written to a temporary file
#    first so a failing `config default` never leaves an empty config behind.
install -d -m 0755 "$R/etc/sessiond"
config="$R/etc/sessiond/config.toml"
if [ -e "$config" ]; then
    say "keeping existing $config"
    if [ -x "$sessiond_bin" ] && ! "$sessiond_bin" config check "$config"; then
        say "WARNING: $config does not pass 'sessiond config check' with this version; fix it before restarting"
    fi
else
    [ -x "$sessiond_bin" ] || {
        echo "install.sh: $sessiond_bin is missing; cannot write the default config (run without --no-pip)" >&2
        exit 1; }
    tmp="$(mktemp "$R/etc/sessiond/.config.toml.XXXXXX")"
    trap 'rm -f "$tmp"' EXIT
    "$sessiond_bin" config default >"$tmp"
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
