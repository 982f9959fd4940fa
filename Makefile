# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# `make run CONFIG=path/to/config.toml`; empty: the embedded defaults.
CONFIG ?=

.PHONY: run test test-fast typecheck bench clean system-deps man

# The checkout goes into the venv as a plain path line (.pth), not through
# setuptools' default editable import hook: that hook runs at every start of
# the venv's Python and imports pathlib, re and urllib.parse, ~25 ms of the
# 50 a one-shot `sessionctl ls` may take (bench/README.md, idle.py).  A
# setuptools without the (transitional) compat mode gets the default one.
EDITABLE := --config-settings editable_mode=compat

# Two stamps: `make run` needs the package alone (a one-machine daemon never
# imports Ray: 21 s and 240 MB of the venv); `make test` adds the `test`
# extra (which holds the `otel` one: OpenTelemetry's SDK and OTLP exporter)
# and the `cluster` extra (PostgreSQL driver, Ray), whose tests it runs.
# The test stamp installs the package and its extras in one pip run (one
# resolve, one editable build), not on top of `make run`'s install: in a
# fresh clone the two runs took twice as long.  It then stands for both.
# --no-compile: pip byte-compiles every module it installs (9,100 files,
# ~9 s of CPU, a third of the venv's build); the suite imports about a
# quarter of them, compiled once at first import instead, by the root
# processes that import them (the tests run with bytecode written, see
# PYTEST below).  Fresh venv, same machine: 19.2 s against 13.2 s; the
# first run of test_adapters_e2e.py (the frameworks' SDKs) then took
# 10.1 s against 7.8 s, the next one 8.0 s.
define new_venv
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
endef

$(VENV)/.installed: pyproject.toml
	$(new_venv)
	$(PY) -m pip install -q -e . $(EDITABLE) || $(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml
	$(new_venv)
	$(PY) -m pip install -q --no-compile -e '.[test,cluster]' $(EDITABLE) || \
	  $(PY) -m pip install -q --no-compile -e '.[test,cluster]' || { \
	  echo "make: could not install the 'test' and 'cluster' extras (pytest; psycopg[binary], the PostgreSQL driver; ray):" \
	       "check that a package index is reachable (pip config list), then run make again" >&2; \
	  exit 1; }
	touch $(VENV)/.installed $@

run: $(VENV)/.installed
	$(VENV)/bin/sessiond run$(if $(CONFIG), --config "$(CONFIG)")

# What the tests start for real and a fresh machine may lack: bubblewrap
# (each session's sandbox), PostgreSQL's server binaries (the postgres
# store), zsh (its completion script is parsed by zsh itself), btrfs-progs
# (the kernel disk cap's tests), Node.js (the Node client of the published
# protocol, clients/node/, is run against a daemon; tests/test_node_client.py
# fails without it) and a headless Chromium with its driver (the web
# console's browser test).  Each is named as Debian/Ubuntu and as Fedora
# package it (`need DEB RPM`).  As root with apt-get or dnf they are
# installed from the distribution; otherwise make stops and names them.
# PG_BIN=/path/to/bin points at a PostgreSQL installed elsewhere.
system-deps:
	@deb=""; rpm=""; \
	need() { deb="$$deb $$1"; rpm="$$rpm $$2"; }; \
	command -v bwrap >/dev/null 2>&1 || need bubblewrap bubblewrap; \
	command -v zsh >/dev/null 2>&1 || need zsh zsh; \
	command -v mkfs.btrfs >/dev/null 2>&1 || need btrfs-progs btrfs-progs; \
	command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	  || need chromium chromium; \
	command -v chromedriver >/dev/null 2>&1 || need chromium-driver chromedriver; \
	command -v mkfs.ext4 >/dev/null 2>&1 || test -x /usr/sbin/mkfs.ext4 || test -x /sbin/mkfs.ext4 \
	  || need e2fsprogs e2fsprogs; \
	command -v ipcmk >/dev/null 2>&1 || need util-linux util-linux; \
	command -v node >/dev/null 2>&1 || need nodejs nodejs; \
	command -v useradd >/dev/null 2>&1 && command -v groupadd >/dev/null 2>&1 || need passwd shadow-utils; \
	{ test -n "$$PG_BIN" && test -x "$$PG_BIN/initdb"; } || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
	  || command -v initdb >/dev/null 2>&1 || need postgresql postgresql-server; \
	if [ -n "$$deb" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make: installing$$deb from the distribution" >&2; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$deb >/dev/null \
	      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	           --no-install-recommends $$deb >/dev/null; } \
	      || { echo "make: could not install$$deb with apt-get" >&2; exit 1; }; \
	  elif [ "$$(id -u)" = 0 ] && command -v dnf >/dev/null 2>&1; then \
	    echo "make: installing$$rpm from the distribution" >&2; \
	    dnf install -y -q $$rpm >/dev/null || { echo "make: could not install$$rpm with dnf" >&2; exit 1; }; \
	  else \
	    echo "make: the tests need$$deb: install with your package manager (Debian/Ubuntu:" \
	         "apt-get install$$deb; Fedora: dnf install$$rpm), then run make test again" >&2; \
	    exit 1; \
	  fi; \
	fi

# The process tier's tests wait on daemons, sockets and polls more than they
# compute: PYTEST_WORKERS of them run side by side (pytest-xdist), also on
# two cores.  One worker runs each file whole (--dist loadfile): a module's
# fixtures (the Ray cluster, test_hostile_unit's PostgreSQL) start once, and
# tests that find their tools' processes by command line among all of the
# machine's (test_sandbox, test_session_cost, test_cgroups) never see a
# sibling's.  (Not loadgroup: pytest 9.2 drops its node id suffix and so
# its grouping, pytest-dev/pytest-xdist#1386.)  PYTEST_WORKERS=0: in order.
# The files are handed out longest first (tests/conftest.py: the most
# process-tier tests first), not xdist's default of the most tests first
# (--no-loadscope-reorder): that sent test_architecture's 233 checks of a
# few milliseconds first and left files of a few slow daemon tests (the
# suite's own report, 8 s) for the end, where the other workers waited.
# Four, on 2 cores: with three the cores were a third idle (7:08 of CPU in
# 5:15) and the suite took 5:15; with four, 4:29 and 4:43, same machine.
PYTEST_WORKERS ?= 4

# The suite starts hundreds of Python processes (daemons, zygotes, workers,
# sessionctl, Ray's) and rewrites the asserts of 130 test modules in each
# pytest worker: with PYTHONDONTWRITEBYTECODE set (some shells and
# containers set it) each of them compiled sessiond's modules anew, a third
# of the suite's CPU.  The tests write their caches (__pycache__/, ignored
# by git) whatever the caller's setting.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

test: $(VENV)/.installed-test system-deps
	$(PYTEST) -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The pure, protocol and component tiers: no daemon, no child processes;
# in-process and independent, so the workers split them test by test.  A
# third of their time is waiting (a timeout to fire, PostgreSQL, a fake
# server's pacing), so three workers beat two also on 2 cores: 14.4 s and
# 14.4 s against 17.4 s and 17.5 s, alternated, same machine (four: 14.7 s).
FAST_WORKERS ?= 3

test-fast: $(VENV)/.installed-test system-deps
	$(PYTEST) -q -m "not process" -n $(FAST_WORKERS)

typecheck: $(VENV)/.installed-test
	$(PY) -m mypy

# sessionctl(1) from the argparse definitions: `man -l man/sessionctl.1`.
man: $(VENV)/.installed
	mkdir -p man
	$(PY) -m supervisor.ctl.manpage > man/sessionctl.1

BENCHES := spawn ipc memory limits restart persist agent hostile sandbox mcp metrics load fsync_batch idle cluster pg_batch sweep steps tracing frameworks

bench: $(VENV)/.installed-test
	for b in $(BENCHES); do $(PY) bench/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache man
