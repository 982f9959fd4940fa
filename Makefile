# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# `make run CONFIG=path/to/config.toml`; empty: the embedded defaults.
CONFIG ?=

.PHONY: run test test-fast typecheck bench clean postgres-binaries

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@# The `cluster` extra (PostgreSQL driver): its tests run in `make test`.
	$(PY) -m pip install -q -e '.[test,cluster]' || { \
	  echo "make: could not install the 'cluster' extra (psycopg[binary], the PostgreSQL driver):" \
	       "check that a package index is reachable (pip config list), then run make again" >&2; \
	  exit 1; }
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/sessiond run$(if $(CONFIG), --config "$(CONFIG)")

# The PostgreSQL store's tests start a real server from these binaries.
PG_BIN ?= $(firstword $(wildcard /usr/lib/postgresql/*/bin) $(dir $(shell command -v initdb 2>/dev/null)))

postgres-binaries:
	@test -x "$(PG_BIN)/initdb" -a -x "$(PG_BIN)/pg_ctl" || { \
	  echo "make: the PostgreSQL server binaries (initdb, pg_ctl) are missing; the tests of" \
	       "[store] backend = \"postgres\" need them: apt-get install postgresql (Debian/Ubuntu)," \
	       "dnf install postgresql-server (Fedora), or PG_BIN=/path/to/bin make test" >&2; \
	  exit 1; }

test: $(VENV)/.installed postgres-binaries
	PG_BIN=$(PG_BIN) $(PY) -m pytest -q

# The pure, protocol and component tiers: no daemon, no child processes.
test-fast: $(VENV)/.installed postgres-binaries
	PG_BIN=$(PG_BIN) $(PY) -m pytest -q -m "not process"

typecheck: $(VENV)/.installed
	$(PY) -m mypy

BENCHES := spawn ipc memory limits restart persist agent hostile

bench: $(VENV)/.installed
	for b in $(BENCHES); do $(PY) bench/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache
